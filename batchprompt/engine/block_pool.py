"""BlockPool: fixed-size KV blocks with reference counts and an LRU list of evictable blocks.

Pure bookkeeping: no tensors. The pool grows on demand up to `max_blocks` (the KV memory
budget), so memory follows the working set rather than being taken up front; the runner sizes
its tensors to `num_blocks`. A block whose reference count drops to zero stays findable by its
hash until it is reused: that is the prefix cache's memory.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

BlockKey = tuple[int, tuple[int, ...]]  # (parent block hash, this block's token ids)


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    key: BlockKey | None = None  # set once the block is full, computed and cached
    block_hash: int | None = None


class NoFreeBlocks(Exception):
    pass


class BlockPool:
    def __init__(self, max_blocks: int):
        if max_blocks < 1:
            raise ValueError("the KV budget must hold at least one block")
        self.max_blocks = max_blocks
        self.blocks: list[Block] = []
        # ref_count == 0 blocks; the first is evicted first. Uncached blocks go to the front,
        # cached ones to the back, so a prefix stays findable as long as possible.
        self._free: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[int, Block] = {}

    @property
    def num_blocks(self) -> int:
        """Blocks created so far (the runner's tensors must hold this many)."""
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: free ones plus those not yet created."""
        return len(self._free) + self.max_blocks - len(self.blocks)

    @property
    def num_used(self) -> int:
        return len(self.blocks) - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def allocate(self, n: int) -> list[Block]:
        if n > self.num_free:
            raise NoFreeBlocks(f"asked for {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                block = self.blocks[self._free.popitem(last=False)[0]]
                self._uncache(block)
            else:
                block = Block(len(self.blocks))
                self.blocks.append(block)
            block.ref_count = 1
            out.append(block)
        return out

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on cached blocks (a prefix-cache hit)."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def release(self, blocks: list[Block]) -> None:
        """Drop one reference on each block; the tail of a sequence is evicted first."""
        for block in reversed(blocks):
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block.block_id} released twice"
            if block.ref_count == 0:
                self._free[block.block_id] = None
                if block.key is None:
                    self._free.move_to_end(block.block_id, last=False)

    def lookup(self, block_hash: int, key: BlockKey) -> Block | None:
        block = self._cached.get(block_hash)
        return block if block is not None and block.key == key else None

    def cache(self, block: Block, block_hash: int, key: BlockKey) -> None:
        """Make a full, computed block findable. A duplicate of a cached block stays private."""
        if block.key is not None or block_hash in self._cached:
            return
        block.key, block.block_hash = key, block_hash
        self._cached[block_hash] = block

    def uncache(self, block: Block) -> None:
        """Make a block unfindable (its K/V are not what its key says)."""
        self._uncache(block)

    def _uncache(self, block: Block) -> None:
        if block.block_hash is not None and self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.key = block.block_hash = None

    def drop_free_cached(self) -> None:
        """Forget every cached block nobody holds (after a failed step: their K/V may be torn)."""
        for block_id in list(self._free):
            self._uncache(self.blocks[block_id])

    def evictable_count(self, blocks: list[Block]) -> int:
        """How many of these (cached) blocks sit in the free list now."""
        return sum(1 for b in blocks if b.ref_count == 0)
