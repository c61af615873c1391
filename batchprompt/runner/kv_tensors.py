"""The KV cache's storage: one K and one V tensor for all layers, grown with the block pool."""
from __future__ import annotations

import torch

from ..models.attention import LayerCache
from ..models.config import ModelArgs


#: Spare blocks a growth adds beyond what the step asks: a share of it, at least a minimum.
SPARE_SHARE = 0.25
SPARE_MIN_BLOCKS = 64


class KVTensors:
    def __init__(self, args: ModelArgs, block_size: int, dtype: torch.dtype, device: torch.device):
        self.args, self.block_size, self.dtype, self.device = args, block_size, dtype, device
        self.capacity_blocks = 0
        self.k = self.v = torch.empty(0)
        self.layers: list[LayerCache] = []

    @staticmethod
    def bytes_per_block(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return 2 * args.num_layers * block_size * args.kv_size * itemsize

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def ensure(self, num_blocks: int, max_blocks: int) -> None:
        """Hold at least `num_blocks` blocks; grows by doubling, or to `num_blocks` plus spare
        blocks (SPARE_SHARE of them, at least SPARE_MIN_BLOCKS) where that is more (never past
        `max_blocks`). The spare
        blocks are what a step run inside this one (a chat arriving mid-step) can take: the
        tensors cannot grow under a paused step, so a growth to the exact size made the first
        chat beside a long prompt wait for that prompt's whole step."""
        if num_blocks <= self.capacity_blocks:
            return
        spare = max(SPARE_MIN_BLOCKS, int(num_blocks * SPARE_SHARE))
        new_cap = min(max(num_blocks + spare, 2 * self.capacity_blocks), max_blocks)
        a = self.args
        shape = (a.num_layers, new_cap * self.block_size, a.num_kv_heads, a.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        used = self.capacity_blocks * self.block_size
        if used:
            k[:, :used] = self.k
            v[:, :used] = self.v
        self.k, self.v, self.capacity_blocks = k, v, new_cap
        self.layers = [LayerCache(k[i], v[i]) for i in range(a.num_layers)]
