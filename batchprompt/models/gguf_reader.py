"""Read a GGUF file into ModelArgs and a dense Hugging Face-named state dict (via `gguf`)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from .config import ModelArgs, Unsupported

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if unknown."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    m = re.fullmatch(r"(\w+)\.(weight|bias)", gguf_name)
    if m and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs -> rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: str | Path) -> tuple[ModelArgs, dict[str, torch.Tensor], dict[str, object]]:
    """ModelArgs, dense float32 HF-named tensors, and the raw metadata of a GGUF file."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta = {k: _field_value(f) for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        if key in reader.fields:
            meta[key] = _field_value(reader.fields[key])
    shapes = {t.name: [int(d) for d in reversed(t.shape.tolist())] for t in reader.tensors}
    args = _args_from_metadata(meta, shapes, _rope_freqs(reader))
    unknown = [t.name for t in reader.tensors if hf_name(t.name) is None and t.name != "rope_freqs.weight"]
    if unknown:
        raise Unsupported(f"this GGUF file holds tensors that this code does not compute ({', '.join(unknown[:3])}"
                          f"{', ...' if len(unknown) > 3 else ''}): a model of another kind, whose answers would be "
                          f"wrong here")
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape(shapes[t.name])
        # llama.cpp permutes a Llama's q and k rows, their biases too (attention_bias)
        if args.architecture == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight", "attn_q.bias",
                                                             "attn_k.bias")):
            w = unpermute_rotary(w, args.num_heads if "attn_q" in t.name else args.num_kv_heads)
        state[name] = torch.from_numpy(np.array(w, dtype=np.float32))  # writable copy
    return args, state, meta


def _field_value(field) -> object:
    try:
        return field.contents()
    except Exception:  # fields the reader cannot decode are not needed here
        return None


def _rope_freqs(reader) -> tuple[float, ...] | None:
    """The factors that llama.cpp's converter writes as the `rope_freqs` tensor (a Llama 3.1's
    `llama3` RoPE scaling: each frequency is divided by its factor), or None."""
    import gguf

    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            return tuple(float(x) for x in gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1))
    return None


def _args_from_metadata(meta: dict[str, object], shapes: dict[str, list[int]],
                        rope_freqs: tuple[float, ...] | None = None) -> ModelArgs:
    arch = str(meta.get("general.architecture", "llama"))
    tensor_names = set(shapes)

    def get(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    scaling = None
    if get("rope.scaling.type") not in (None, "none"):
        scaling = {"rope_type": get("rope.scaling.type"), "factor": get("rope.scaling.factor", 1.0)}
    if rope_freqs is not None:
        dims = int(get("attention.key_length", 0) or hidden // heads)
        if len(rope_freqs) != dims // 2:
            raise Unsupported(f"this GGUF file's rope_freqs holds {len(rope_freqs)} factors; heads of {dims} "
                              f"dimensions take {dims // 2}")
        if scaling is not None:
            raise Unsupported(f"this GGUF file gives both rope_freqs factors and a {scaling['rope_type']!r} RoPE "
                              f"scaling; one is expected")
        scaling = {"rope_type": "freq_factors", "factors": rope_freqs}
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelArgs(
        vocab_size=_vocab_size(meta, arch, shapes),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", 0) or hidden // heads),
        max_position=int(get("context_length", 8192)),
        rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        tie_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        architecture=arch,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


def _vocab_size(meta: dict[str, object], arch: str, shapes: dict[str, list[int]]) -> int:
    """The metadata's vocab_size, or the token embedding's rows (llama.cpp's converter writes
    the key for Llama only: a Qwen2 file has none)."""
    size = meta.get(f"{arch}.vocab_size") or shapes.get("token_embd.weight", [0])[0]
    if not size:
        raise ValueError("this GGUF file has neither a vocab_size in its metadata nor a token_embd tensor; it "
                         "is not a supported model file")
    return int(size)
