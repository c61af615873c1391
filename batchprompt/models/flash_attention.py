"""Variable-length attention for CUDA: FlashAttention through PyTorch, one call per layer for a
whole step (see attention.VarlenBatch).

The padded SDPA groups that serve other devices make the host wait on the GPU in every layer
on CUDA (a boolean mask with grouped-query heads takes PyTorch's math path): the host never
runs ahead of the GPU. FlashAttention's variable-length kernel takes the flat tokens as they
are, with grouped-query heads and a causal mask aligned to the end of each request's keys, and
queues its work like any other kernel.

`varlen_op` checks the kernel once per device against `varlen_reference` on a small case with
a cached prefix and uses it only where the two agree; anywhere else (no CUDA, float32, an older
GPU or PyTorch, BATCHPROMPT_ATTENTION=sdpa) the padded groups serve.
"""
from __future__ import annotations

import itertools
import logging
import os
from typing import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_checked: dict[tuple, bool] = {}


def flash_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """q [T, H, D], k and v [K, Hkv, D] (Hkv dividing H) -> [T, H, D]."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False,
                                                   scale=scale)[0]


def varlen_reference(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """What the kernel computes, one request at a time in plain PyTorch (any device): request i's
    queries are its last tokens, and query j sees its keys up to its own position."""
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for i in range(len(bq) - 1):
        qi, ki, vi = q[bq[i]:bq[i + 1]], k[bk[i]:bk[i + 1]], v[bk[i]:bk[i + 1]]
        nq, nk = qi.shape[0], ki.shape[0]
        visible = torch.arange(nk, device=q.device) <= (nk - nq + torch.arange(nq, device=q.device)).unsqueeze(1)
        o = F.scaled_dot_product_attention(
            qi.transpose(0, 1), ki.repeat_interleave(groups, 1).transpose(0, 1),
            vi.repeat_interleave(groups, 1).transpose(0, 1), attn_mask=visible, scale=scale)
        out[bq[i]:bq[i + 1]] = o.transpose(0, 1)
    return out


def varlen_op(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
              head_dim: int) -> Callable | None:
    """FlashAttention's variable-length kernel where it serves this device and model and gives
    varlen_reference's results; else None."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return None
    if os.environ.get("BATCHPROMPT_ATTENTION", "").lower() == "sdpa":
        return None
    key = (str(device), dtype, head_dim, num_heads, num_kv_heads)
    if key not in _checked:
        _checked[key] = _agrees(device, dtype, num_heads, num_kv_heads, head_dim)
    return flash_varlen if _checked[key] else None


def _agrees(device, dtype, num_heads, num_kv_heads, head_dim) -> bool:
    """One request with a cached prefix (3 new of 21 keys), one decode row, one whole prompt."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q_lens, k_lens = [3, 1, 7], [21, 9, 7]
    rand = lambda n, h: torch.randn(n, h, head_dim, generator=g).to(device, dtype)  # noqa: E731
    q, k, v = rand(sum(q_lens), num_heads), rand(sum(k_lens), num_kv_heads), rand(sum(k_lens), num_kv_heads)
    cum = lambda xs: torch.tensor([0, *itertools.accumulate(xs)], dtype=torch.int32, device=device)  # noqa: E731
    args = (q, k, v, cum(q_lens), cum(k_lens), max(q_lens), max(k_lens), head_dim ** -0.5)
    try:
        got = flash_varlen(*args)
    except (RuntimeError, NotImplementedError) as e:
        log.info("FlashAttention's variable-length kernel is not available here (%s); padded SDPA "
                 "groups serve attention", e)
        return False
    want = varlen_reference(*args)
    err = (got.float() - want.float()).abs().max().item()
    if err > 0.02:
        log.warning("FlashAttention's variable-length kernel differs from the reference by %.3g on "
                    "this GPU; padded SDPA groups serve attention", err)
        return False
    return True
