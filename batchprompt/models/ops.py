"""The elementwise steps of a Llama layer, as one replaceable object.

`TorchOps` computes them with PyTorch operations on any device. On the CPU the runner swaps
in the compiled versions from batchprompt.kernels, which fuse each step into one pass over
its rows and round where these do, so both give the same results to float rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .rotary import apply_rotary


class TorchOps:
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Normalized in float32 and scaled in the model dtype, as the reference implementation does."""
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)

    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """residual += delta (in place); returns the normalized residual."""
        residual.add_(delta)
        return self.rms_norm(residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """The greedy token of each row of logits [N, V] (float32 or the model's dtype)."""
        return logits.argmax(dim=-1)

    def rotary_to_cache(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor,
                        sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> torch.Tensor:
        """Rotate q and k of qkv [T, H + 2 Hkv, D]; write k and v to the cache at their slots.
        Returns q [T, H, D]."""
        qk = apply_rotary(qkv[:, :num_heads + num_kv_heads], cos, sin)  # q and k in one pass
        k_cache.index_copy_(0, slot_mapping, qk[:, num_heads:])
        v_cache.index_copy_(0, slot_mapping, qkv[:, num_heads + num_kv_heads:])
        return qk[:, :num_heads]


TORCH_OPS = TorchOps()
