"""KVCacheManager: each request's block table, and the prefix cache over full blocks.

A full block's hash is H(parent hash, its token ids), so a lookup walks a prompt block by block
and stops at the first miss; a hit compares the stored tokens, not only the hash. The last
prompt token is never served from the cache, so that its logits get computed.
"""
from __future__ import annotations

from .block_pool import Block, BlockKey, BlockPool
from .request import Request

_ROOT_HASH = 0x5EED


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, enable_prefix_caching: bool = True,
                 watermark_blocks: int = 0):
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = watermark_blocks
        self._blocks: dict[str, list[Block]] = {}
        self._hashes: dict[str, list[int]] = {}
        self.pins: dict[str, list[Block]] = {}

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def _chain(self, token_ids: list[int], start: int, parent: int, count: int):
        """Yield (hash, key) of full blocks `start .. start+count-1` of token_ids."""
        bs = self.block_size
        for i in range(start, start + count):
            key: BlockKey = (parent, tuple(token_ids[i * bs:(i + 1) * bs]))
            parent = hash(key)
            yield parent, key

    def find_cached_prefix(self, request: Request) -> list[Block]:
        """The longest run of cached blocks that starts `request`'s tokens."""
        if not self.enable_prefix_caching:
            return []
        hits: list[Block] = []
        limit = (request.num_tokens - 1) // self.block_size
        for block_hash, key in self._chain(request.token_ids, 0, _ROOT_HASH, limit):
            block = self.pool.lookup(block_hash, key)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate(self, request: Request, num_tokens: int, hits: list[Block] = (),
                 admitting: bool = False) -> bool:
        """Make room for `request`'s first `num_tokens` tokens, taking `hits` as its first blocks.

        False (and nothing changed) when memory is short. Admission of a new request also keeps
        `watermark_blocks` free, so running requests can grow before anything is preempted.
        """
        blocks = self._blocks.get(request.request_id, [])
        new = self.blocks_needed(num_tokens) - len(blocks) - len(hits)
        if not self.can_allocate(request, num_tokens, hits, admitting):
            return False
        self.pool.touch(list(hits))
        blocks = self._blocks.setdefault(request.request_id, blocks)
        blocks.extend(hits)
        if new > 0:
            blocks.extend(self.pool.allocate(new))
        return True

    def can_allocate(self, request: Request, num_tokens: int, hits: list[Block] = (),
                     admitting: bool = False, reserve: int = 0) -> bool:
        """Whether `allocate` would succeed with `reserve` more blocks kept free."""
        have = len(self._blocks.get(request.request_id, ())) + len(hits)
        needed = max(self.blocks_needed(num_tokens) - have, 0) + self.pool.evictable_count(hits)
        return needed + reserve + (self.watermark_blocks if admitting else 0) <= self.pool.num_free

    def blocks_to_grow(self, request: Request, num_tokens: int) -> int:
        """New blocks `request` needs to hold its first `num_tokens` tokens."""
        return max(self.blocks_needed(num_tokens) - len(self._blocks.get(request.request_id, ())), 0)

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that are full once its first `num_tokens` are computed.

        Called when a chunk is scheduled, not after it ran: every layer writes all new K/V of a
        step before any request reads, so a request admitted in the same step can already share
        these blocks. A shared system prompt is thus computed once even in the first step.
        """
        if not self.enable_prefix_caching:
            return
        hashes = self._hashes.setdefault(request.request_id, [])
        full = num_tokens // self.block_size
        if full <= len(hashes):
            return
        blocks = self._blocks[request.request_id]
        parent = hashes[-1] if hashes else _ROOT_HASH
        for i, (block_hash, key) in enumerate(
                self._chain(request.token_ids, len(hashes), parent, full - len(hashes)), len(hashes)):
            self.pool.cache(blocks[i], block_hash, key)
            hashes.append(block_hash)

    def uncache_from(self, request: Request, num_tokens: int) -> None:
        """Unregister the request's blocks past its first `num_tokens` tokens (a step that
        failed registered them when it was scheduled, but never wrote their K/V)."""
        hashes = self._hashes.get(request.request_id)
        if not hashes:
            return
        keep = num_tokens // self.block_size
        for block in self._blocks[request.request_id][keep:len(hashes)]:
            self.pool.uncache(block)
        del hashes[keep:]

    def free(self, request: Request) -> None:
        self.pool.release(self._blocks.pop(request.request_id, []))
        self._hashes.pop(request.request_id, None)

    # Pins keep a prefix's blocks alive (referenced) while, for example, a session lives.
    def pin(self, name: str, request: Request) -> int:
        """Hold references on `request`'s cached prefix under `name`; returns tokens pinned."""
        blocks = self._blocks.get(request.request_id, [])[: len(self._hashes.get(request.request_id, []))]
        return self._pin(name, blocks)

    def pin_tokens(self, name: str, token_ids: list[int]) -> int:
        """Hold references on the cached blocks that start `token_ids` (as far as they are
        cached); returns tokens pinned. Used right after a prefix was computed."""
        blocks = []
        if self.enable_prefix_caching:
            for block_hash, key in self._chain(token_ids, 0, _ROOT_HASH, len(token_ids) // self.block_size):
                block = self.pool.lookup(block_hash, key)
                if block is None:
                    break
                blocks.append(block)
        return self._pin(name, blocks)

    def pin_copy(self, source: str, name: str) -> int:
        """Pin under `name` the blocks pinned under `source` (nothing recomputed)."""
        return self._pin(name, list(self.pins.get(source, [])))

    def _pin(self, name: str, blocks: list[Block]) -> int:
        self.pool.touch(blocks)  # before unpinning: re-pinning the same blocks must not free them
        self.unpin(name)
        self.pins[name] = blocks
        return len(blocks) * self.block_size

    def unpin(self, name: str) -> None:
        self.pool.release(self.pins.pop(name, []))
