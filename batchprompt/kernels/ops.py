"""The layer's elementwise steps through the compiled CPU kernels (see models/ops.py)."""
from __future__ import annotations

import torch

from ..models.ops import TorchOps


class CompiledOps(TorchOps):
    def __init__(self, module):
        self.m = module

    def rms_norm(self, x, weight, eps):
        return self.m.rms_norm(x, weight, eps)

    def add_rms_norm(self, residual, delta, weight, eps):
        return self.m.add_rms_norm(residual, delta, weight, eps)

    def silu_mul(self, gate_up):
        return self.m.silu_mul(gate_up)

    def argmax(self, logits):
        return self.m.argmax_rows(logits)

    def rotary_to_cache(self, qkv, num_heads, num_kv_heads, cos, sin, k_cache, v_cache, slot_mapping) -> torch.Tensor:
        self.m.rotary_to_cache(qkv, num_heads, num_kv_heads, cos, sin, k_cache, v_cache, slot_mapping)
        return qkv[:, :num_heads]
