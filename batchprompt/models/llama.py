"""The Llama family (Llama, SmolLM, Mistral, Qwen2, Qwen3) over a flat batch of tokens."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, LayerCache, paged_attention
from .config import ModelArgs
from .rotary import apply_rotary, rotary_table


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalized in float32 and scaled in the model dtype, as the reference implementation does."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


class Dense(nn.Module):
    """A linear layer whose weight is stored [in, out]: oneDNN's bfloat16 GEMM runs 5-25%
    faster on that layout than on nn.Linear's [out, in] at the batch sizes the engine uses."""

    def __init__(self, d_in: int, d_out: int, bias: bool = False):
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(d_in, d_out))
        self.bias = nn.Parameter(torch.empty(d_out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.a = a
        self.qkv = Dense(a.hidden_size, a.q_size + 2 * a.kv_size, bias=a.attention_bias)
        self.o = Dense(a.q_size, a.hidden_size)
        if a.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(a.head_dim))
            self.k_norm = nn.Parameter(torch.ones(a.head_dim))

    def forward(self, x, cos, sin, cache: LayerCache, meta: AttentionMetadata):
        a = self.a
        qkv = self.qkv(x).view(-1, a.num_heads + 2 * a.num_kv_heads, a.head_dim)
        qk, v = qkv.split([a.num_heads + a.num_kv_heads, a.num_kv_heads], dim=1)
        if a.qk_norm:
            q, k = qk.split([a.num_heads, a.num_kv_heads], dim=1)
            qk = torch.cat([rms_norm(q, self.q_norm, a.rms_eps), rms_norm(k, self.k_norm, a.rms_eps)], dim=1)
        qk = apply_rotary(qk, cos, sin)  # q and k rotated in one pass
        q, k = qk.split([a.num_heads, a.num_kv_heads], dim=1)
        return self.o(paged_attention(q, k, v, cache, meta))


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.eps = a.rms_eps
        self.attn_norm = nn.Parameter(torch.ones(a.hidden_size))
        self.attn = Attention(a)
        self.mlp_norm = nn.Parameter(torch.ones(a.hidden_size))
        self.gate_up = Dense(a.hidden_size, 2 * a.intermediate_size)
        self.down = Dense(a.intermediate_size, a.hidden_size)

    def forward(self, x, cos, sin, cache: LayerCache, meta: AttentionMetadata):
        x = x + self.attn(rms_norm(x, self.attn_norm, self.eps), cos, sin, cache, meta)
        return x + self.down(swiglu(self.gate_up(rms_norm(x, self.mlp_norm, self.eps))))


class LlamaModel(nn.Module):
    """`forward` maps a flat token batch to hidden states; `logits` applies the output head."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.num_layers))
        self.norm = nn.Parameter(torch.ones(args.hidden_size))
        self.lm_head = None if args.tie_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.reset_rotary()

    def reset_rotary(self, device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        """(Re)compute the rotary table: a derived buffer, never part of a checkpoint. It is
        kept in the model dtype, in which rotary is applied, so no step has to cast it."""
        a = self.args
        cos, sin = rotary_table(a.head_dim, a.max_position, a.rope_theta, a.rope_scaling)
        self.register_buffer("cos", cos.to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("sin", sin.to(device=device, dtype=dtype), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                caches: list[LayerCache], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed(input_ids)
        cos, sin = self.cos[positions], self.sin[positions]
        for layer, cache in zip(self.layers, caches):
            x = layer(x, cos, sin, cache, meta)
        return rms_norm(x, self.norm, self.args.rms_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()
