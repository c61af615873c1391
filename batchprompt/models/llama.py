"""The Llama family (Llama, SmolLM, Mistral, Qwen2, Qwen3) over a flat batch of tokens."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, LayerCache, paged_attention
from .config import ModelArgs
from .ops import TORCH_OPS, TorchOps
from .rotary import rotary_table

def _pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] in oneDNN's blocked layout (a CPU-only copy)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 64)


def gemm_rows(m: int) -> int:
    """The rows a GEMM of `m` rows runs with where oneDNN keeps what it builds for each row
    count (the packed weights' GEMMs, and the CPU's bfloat16 and float16 GEMMs without them):
    `m` up to 8, then a multiple of 8 up to 128, then one of 8 counts for each doubling (144,
    160, ..., 256, 288, ..., 512, ..., 2,048): at most 12% more rows. oneDNN compiles and keeps
    a kernel for every row count it meets, about 0.6 MiB each up to 128 rows and several MiB
    beyond: run as given, 128 row counts times 5 weight shapes kept about 375 MiB once a server
    had met them all, a server meeting step sizes from 129 to 2,048 tokens grew by about 100 KiB
    a request (1.9 GiB after 5,000 requests, and rising), and a loop over 1,000 row counts by
    4 GiB. These counts keep it bounded (about 80 MiB up to 128 rows, 130 MiB more up to 2,048);
    the padded rows cost little (a GEMM of 64 rows takes about 5% longer than one of 57)."""
    if m <= 8:
        return m
    if m <= 128:
        return -(-m // 8) * 8
    step = 1 << ((m - 1).bit_length() - 4)
    return -(-m // step) * step


def _padded(x: torch.Tensor) -> torch.Tensor:
    """x padded with zero rows to gemm_rows(len(x)) (rows are independent: the caller drops the
    extra ones)."""
    m = x.shape[0]
    rows = gemm_rows(m)
    return F.pad(x, (0, 0, 0, rows - m)) if rows != m else x


def _onednn_plain(t: torch.Tensor) -> bool:
    """Whether a GEMM of plain weights on `t`'s device and dtype goes to oneDNN (the CPU's
    bfloat16 and float16); float32 goes to MKL, which keeps nothing per shape."""
    return t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16)


def _plain_padded(x: torch.Tensor) -> torch.Tensor:
    """x padded as `_padded` where oneDNN runs a GEMM of the plain weights (_onednn_plain);
    elsewhere as given."""
    return _padded(x) if _onednn_plain(x) else x


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(_padded(x), packed, bias, "none", [], "")[:x.shape[0]]


class Dense(nn.Module):
    """A linear layer whose weight is stored [in, out]: oneDNN's bfloat16 GEMM runs 5-25%
    faster on that layout than on nn.Linear's [out, in] at the batch sizes the engine uses.
    `packed` (see LlamaModel.pack_weights), where present, serves every step."""

    def __init__(self, d_in: int, d_out: int, bias: bool = False):
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(d_in, d_out))
        self.bias = nn.Parameter(torch.empty(d_out)) if bias else None
        self.packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return _packed_linear(x, self.packed, self.bias)
        m, x = x.shape[0], _plain_padded(x)
        if self.bias is None:
            return torch.mm(x, self.weight_t)[:m]
        return torch.addmm(self.bias, x, self.weight_t)[:m]


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.a = a
        self.qkv = Dense(a.hidden_size, a.q_size + 2 * a.kv_size, bias=a.attention_bias)
        self.o = Dense(a.q_size, a.hidden_size, bias=a.o_bias)
        if a.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(a.head_dim))
            self.k_norm = nn.Parameter(torch.ones(a.head_dim))

    def forward(self, x, cos, sin, cache: LayerCache, meta: AttentionMetadata, ops: TorchOps):
        a = self.a
        # x may carry zero rows past the step's tokens (LlamaModel.forward): the GEMMs run on
        # them, attention and the cache see the tokens only, and the output keeps x's rows.
        qkv = self.qkv(x)[:meta.num_tokens].view(-1, a.num_heads + 2 * a.num_kv_heads, a.head_dim)
        if a.qk_norm:  # Qwen3: each head of q and k normalized before the rotation
            q, k = qkv[:, :a.num_heads], qkv[:, a.num_heads:a.num_heads + a.num_kv_heads]
            qkv = torch.cat([ops.rms_norm(q.reshape(-1, a.head_dim), self.q_norm, a.rms_eps).view_as(q),
                             ops.rms_norm(k.reshape(-1, a.head_dim), self.k_norm, a.rms_eps).view_as(k),
                             qkv[:, a.num_heads + a.num_kv_heads:]], dim=1)
        q = ops.rotary_to_cache(qkv, a.num_heads, a.num_kv_heads, cos, sin, cache.k, cache.v, meta.slot_mapping)
        return self.o(paged_attention(q, cache, meta, rows=x.shape[0]))


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.eps = a.rms_eps
        self.attn_norm = nn.Parameter(torch.ones(a.hidden_size))
        self.attn = Attention(a)
        self.mlp_norm = nn.Parameter(torch.ones(a.hidden_size))
        self.gate_up = Dense(a.hidden_size, 2 * a.intermediate_size)
        self.down = Dense(a.intermediate_size, a.hidden_size)

    def forward(self, x, h, next_norm, cos, sin, cache: LayerCache, meta: AttentionMetadata, ops: TorchOps):
        """x: the residual stream, updated in place; h: x normalized by attn_norm. Returns the
        new x normalized by `next_norm` (the next layer's attn_norm, or the final norm)."""
        h = ops.add_rms_norm(x, self.attn(h, cos, sin, cache, meta, ops), self.mlp_norm, self.eps)
        return ops.add_rms_norm(x, self.down(ops.silu_mul(self.gate_up(h))), next_norm, self.eps)


class LlamaModel(nn.Module):
    """`forward` maps a flat token batch to hidden states; `logits` applies the output head."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.num_layers))
        self.norm = nn.Parameter(torch.ones(args.hidden_size))
        self.lm_head = None if args.tie_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.head_packed: torch.Tensor | None = None
        self.reset_rotary()

    @property
    def head_weight(self) -> torch.Tensor:
        """The output head's weight [vocab, hidden]: the embedding's where they are tied."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def pack_weights(self) -> bool:
        """On the CPU: keep a second copy of every weight matrix in oneDNN's packed layout, which
        every step's GEMMs then use. Measured on an AMD EPYC (Zen 5, 2 cores), the layers' GEMMs
        of a step run 15-20% faster in bfloat16 (2.1x at 1 row) and 2.3x faster in float32 (where
        the plain weights go to MKL) at every row count from 64 to 2,048; the output head 40-45%
        faster at decoding's few rows. Returns False (and packs nothing) where this PyTorch build
        cannot pack: the plain weights serve then."""
        try:
            for m in self.modules():
                if isinstance(m, Dense) and m.packed is None:
                    m.packed = _pack(m.weight_t.t())
            if self.head_packed is None:
                self.head_packed = _pack(self.head_weight)
        except (RuntimeError, AttributeError):  # no oneDNN: plain weights only
            for m in self.modules():
                if isinstance(m, Dense):
                    m.packed = None
            self.head_packed = None
            return False
        return True

    def reset_rotary(self, device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        """(Re)compute the rotary table: a derived buffer, never part of a checkpoint. It is
        kept in the model dtype, in which rotary is applied, so no step has to cast it."""
        a = self.args
        cos, sin = rotary_table(a.head_dim, a.max_position, a.rope_theta, a.rope_scaling)
        self.register_buffer("cos", cos.to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("sin", sin.to(device=device, dtype=dtype), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[LayerCache],
                meta: AttentionMetadata, ops: TorchOps | None = None,
                pause: Callable[[], None] | None = None) -> torch.Tensor:
        """`ops`: the layers' elementwise steps (default: PyTorch's; the runner passes the
        compiled ones on the CPU). `pause`, if given, is called after every layer but the last
        (the engine runs urgent steps there, see LLMEngine.step)."""
        num_tokens = input_ids.shape[0]
        cos, sin = self.cos[positions], self.sin[positions]
        # The residual stream runs with the rows its GEMMs run with (gemm_rows): the padding
        # rows are made once here, not copied in before every GEMM; rows are independent
        # outside attention, which reads only the step's tokens.
        rows = self.step_rows(num_tokens)
        if rows != num_tokens:
            input_ids = F.pad(input_ids, (0, rows - num_tokens))
        x = self.embed(input_ids)  # the residual stream: a new tensor, updated in place below
        ops, eps = ops or TORCH_OPS, self.args.rms_eps
        h = ops.rms_norm(x, self.layers[0].attn_norm, eps)
        norms = [layer.attn_norm for layer in self.layers[1:]] + [self.norm]
        last = len(self.layers) - 1
        for i, (layer, cache, next_norm) in enumerate(zip(self.layers, caches, norms)):
            h = layer(x, h, next_norm, cos, sin, cache, meta, ops)
            if pause is not None and i < last:
                pause()
        return h[:num_tokens]

    def step_rows(self, num_tokens: int) -> int:
        """The rows a step of `num_tokens` tokens runs its layers with: gemm_rows where the
        layers' GEMMs go to oneDNN (the packed weights, or _onednn_plain), so
        that no GEMM has to pad its input with a copy; else `num_tokens`."""
        w = self.layers[0].gate_up
        return gemm_rows(num_tokens) if w.packed is not None or _onednn_plain(w.weight_t) else num_tokens

    def token_logits(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """float32 logits of `tokens` [R] (one a row of `hidden` [R, H]), each a dot product in
        float32 over the head's row of that token. `logits()` in bfloat16 rounds a logit of 30
        to a multiple of 0.125, and the labels' probabilities that scoring gives fell on a few
        values (a difference of 0.25 between two labels is 6 points of probability near 50%)."""
        rows = self.head_weight.index_select(0, tokens).float()
        return (hidden.float() * rows).sum(-1)

    def logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """The output head's logits, in float32 or (float32=False) as computed, in the model's
        dtype (greedy decoding needs no conversion: the largest value is the same)."""
        if self.head_packed is not None:
            out = _packed_linear(hidden, self.head_packed, None)
        else:
            out = F.linear(_plain_padded(hidden), self.head_weight)[:hidden.shape[0]]
        return out.float() if float32 else out
