"""How many of a source's next items go to a replica as one block, and where to cut.

Items arrive in trie order (the batch API sorts them by token ids), so prompts that share a
prefix are neighbours. A block is a run of neighbours; it is cut where the shared prefix is
shortest, so that a group of prompts sharing a long prefix (a document with many questions)
goes to one replica and is computed there once. A system prompt shared by every item is
computed once per replica: its prefix cache keeps it from one block to the next.
"""
from __future__ import annotations

from typing import Sequence


def block_size(queued: int, replicas: int, blocks_in_flight: int, block_rows: int) -> int:
    """Rows in the next block: a share of what is queued such that every replica gets several
    blocks (small jobs are spread over all replicas), at most `block_rows` (so that a lost
    replica costs at most blocks_in_flight * block_rows rows re-run)."""
    share = -(-queued // max(1, replicas * blocks_in_flight))
    return max(1, min(block_rows, share, queued))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def cut(token_ids: Sequence[Sequence[int]], size: int) -> int:
    """Where to end a block of at most `size` of these (trie-ordered) prompts: at the boundary
    in the block's second half whose neighbours share the fewest tokens (the last such), so
    prefix groups stay whole where they fit. Returns a count from 1 to `size`."""
    if size >= len(token_ids):
        return len(token_ids)
    best, best_shared = size, common_prefix(token_ids[size - 1], token_ids[size])
    for end in range(size - 1, max(size // 2, 1) - 1, -1):
        shared = common_prefix(token_ids[end - 1], token_ids[end])
        if shared < best_shared:
            best, best_shared = end, shared
    return best
