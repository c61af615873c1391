"""Rotary position embeddings (RoPE), with the `linear` and `llama3` frequency scalings, and a
GGUF file's `rope_freqs` factors (llama.cpp's form of `llama3`)."""
from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_scaling(inv_freq, scaling)
    if kind == "freq_factors":
        factors = torch.tensor(scaling["factors"], dtype=torch.float64)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_freqs holds {factors.numel()} factors; the heads' {head_dim} dimensions need "
                             f"{inv_freq.numel()}")
        return inv_freq / factors
    raise ValueError(f"rope scaling {kind!r} is not supported (supported: linear, llama3)")


def _llama3_scaling(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(is_mid, mid, scaled)


def rotary_table(head_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [max_position, head_dim] (each half repeated), in float32."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [tokens, heads, head_dim] by per-token cos/sin [tokens, head_dim].

    "Rotate half" layout of Hugging Face checkpoints (GGUF weights are un-permuted into it at
    load time), computed in the model dtype as the reference implementation does.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.unsqueeze(1) + torch.cat((-x2, x1), dim=-1) * sin.unsqueeze(1)
