"""Attention over a paged KV cache.

The model works on a flat list of tokens (every request's new tokens, back to back), so its
matmuls never see padding. Only attention groups tokens by request: each group is a padded
[requests, queries] block whose keys are gathered from the cache by slot index, and one
`scaled_dot_product_attention` call serves the whole group. Decode rows (one query) form one
group; prefill chunks form one or a few groups of similar length. On the CPU, decode rows go
instead to a compiled kernel (batchprompt.kernels) that reads the cache through the block
table directly. On CUDA, where FlashAttention serves (models/flash_attention.py), all of a
step's tokens go instead to one variable-length call per layer (VarlenBatch): no padding, no
mask, and nothing that makes the host wait on the GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass
class AttentionGroup:
    """Requests whose attention runs as one padded SDPA call."""

    query_index: torch.Tensor  # [B, Q] flat token index of each query (padding points at a real token)
    key_slots: torch.Tensor  # [B, K] cache slot of each key (padding points at slot 0)
    mask: torch.Tensor | None  # [B, 1, Q, K] bool, True where a query may look; None: all
    valid: torch.Tensor | None  # [B*Q] flat positions of real queries; None: no query padding
    # Set when the group's queries are the contiguous, unpadded tokens [start, stop): they are
    # then read and written as a slice instead of gathered and scattered.
    token_range: tuple[int, int] | None = None

    @property
    def tokens(self) -> torch.Tensor:
        flat = self.query_index.reshape(-1)
        return flat if self.valid is None else flat[self.valid]


@dataclass
class DecodeBatch:
    """Decode rows (one query each) served by a compiled paged-attention kernel, which reads
    the keys through the block table where they lie: no gather, no padding. Their tokens are
    the flat range [start, stop)."""

    start: int
    stop: int
    block_table: torch.Tensor  # [B, max_blocks] int64
    context_lens: torch.Tensor  # [B] int64: keys each query sees, its own included
    block_size: int
    op: Callable  # (q [B, H, D], k_cache, v_cache, block_table, context_lens, block_size, scale) -> [B, H, D]


@dataclass
class VarlenBatch:
    """Every token of the step in one variable-length attention call: the queries are the flat
    tokens, request after request; each request's keys are gathered from the cache back to
    back; the causal mask of a request is aligned to the end of its keys (its new tokens are
    its last ones)."""

    key_slots: torch.Tensor  # [K] cache slot of every key, request after request
    cu_q: torch.Tensor  # [N + 1] int32: where each request's queries start in the flat tokens
    cu_k: torch.Tensor  # [N + 1] int32: where each request's keys start in key_slots
    max_q: int
    max_k: int
    op: Callable  # (q [T, H, D], k [K, Hkv, D], v, cu_q, cu_k, max_q, max_k, scale) -> [T, H, D]


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built by the runner, read by every layer."""

    slot_mapping: torch.Tensor  # [T] cache slot where each new token's K and V are written
    groups: list[AttentionGroup]
    num_tokens: int
    decode: DecodeBatch | None = None
    varlen: VarlenBatch | None = None


@dataclass
class LayerCache:
    """One layer's K and V storage: [slots, kv_heads, head_dim] each."""

    k: torch.Tensor
    v: torch.Tensor


def paged_attention(q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata,
                    rows: int | None = None) -> torch.Tensor:
    """q [T, Hq, D] for the new tokens, whose K and V are already in the cache -> [rows, Hq * D]
    (rows: T by default; rows past T are zeros, padding for the next GEMM)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    out = q.new_empty(rows or meta.num_tokens, num_heads * head_dim)
    if out.shape[0] > meta.num_tokens:
        out[meta.num_tokens:].zero_()
    if (vb := meta.varlen) is not None:
        keys, values = cache.k.index_select(0, vb.key_slots), cache.v.index_select(0, vb.key_slots)
        o = vb.op(q[:meta.num_tokens].contiguous(), keys, values, vb.cu_q, vb.cu_k, vb.max_q, vb.max_k,
                  head_dim ** -0.5)
        out[:meta.num_tokens] = o.reshape(meta.num_tokens, -1)
        return out
    if (d := meta.decode) is not None:
        out[d.start:d.stop] = d.op(q[d.start:d.stop], cache.k, cache.v, d.block_table, d.context_lens,
                                   d.block_size, head_dim ** -0.5).view(d.stop - d.start, -1)
    for g in meta.groups:
        b, nq = g.query_index.shape
        nk = g.key_slots.shape[1]
        slots = g.key_slots.reshape(-1)
        keys = cache.k.index_select(0, slots).view(b, nk, -1, head_dim).transpose(1, 2)
        values = cache.v.index_select(0, slots).view(b, nk, -1, head_dim).transpose(1, 2)
        if g.token_range is not None:
            queries = q[g.token_range[0]:g.token_range[1]]
        else:
            queries = q.index_select(0, g.query_index.reshape(-1))
        o = F.scaled_dot_product_attention(
            queries.reshape(b, nq, num_heads, head_dim).transpose(1, 2), keys, values,
            attn_mask=g.mask, enable_gqa=keys.shape[1] != num_heads,
        )
        o = o.transpose(1, 2).reshape(b * nq, num_heads * head_dim)
        if g.token_range is not None:
            out[g.token_range[0]:g.token_range[1]] = o
            continue
        if g.valid is not None:
            o = o.index_select(0, g.valid)
        out.index_copy_(0, g.tokens, o)
    return out
