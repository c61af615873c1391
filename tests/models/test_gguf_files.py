"""GGUF files as llama.cpp's converter writes them, read against transformers on the same weights."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from batchprompt.models import ModelNotFoundError, build_model, load_hf_weights, resolve_model

from ..conftest import full_logits, tiny_hf_config

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (rotate-half halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_factors(head_dim: int, theta: float, s: dict) -> np.ndarray:
    """The `rope_freqs` tensor that convert_hf_to_gguf writes for a `llama3` RoPE scaling."""
    factors = []
    for freq in 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)):
        wavelen = 2 * math.pi / freq
        low, high, old = s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"]
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(s["factor"])
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def _write_gguf(path, hf, *, vocab_size_key: bool = True, rope_freqs: np.ndarray | None = None,
                extra: dict[str, np.ndarray] | None = None):
    import gguf

    c = hf.config
    head_dim = c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(head_dim)
    if vocab_size_key:
        w.add_vocab_size(c.vocab_size)
    sd = {k: v.float().numpy() for k, v in hf.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(b + "attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads))
        w.add_tensor(b + "attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads))
        for ours, theirs in (("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                             ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")):
            w.add_tensor(f"{b}{ours}.weight", sd[f"{p}{theirs}.weight"])
        if c.attention_bias:  # llama.cpp permutes q's and k's biases as their rows
            w.add_tensor(b + "attn_q.bias", _permute(sd[p + "self_attn.q_proj.bias"], c.num_attention_heads))
            w.add_tensor(b + "attn_k.bias", _permute(sd[p + "self_attn.k_proj.bias"], c.num_key_value_heads))
            w.add_tensor(b + "attn_v.bias", sd[p + "self_attn.v_proj.bias"])
            w.add_tensor(b + "attn_output.bias", sd[p + "self_attn.o_proj.bias"])
    for name, value in (extra or {}).items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _hf(**overrides):
    from transformers import LlamaForCausalLM

    torch.manual_seed(5)
    return LlamaForCausalLM(tiny_hf_config(**overrides)).eval()


def _logits(hf, ids):
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def test_a_llama31_gguf_runs_its_rope_freqs_scaling(tmp_path):
    """A Llama 3.1/3.2 GGUF carries its `llama3` RoPE scaling as a `rope_freqs` tensor, with no
    rope.scaling key: it was skipped as an unknown tensor, and the model ran unscaled (every
    token different from transformers' on the same weights past a few positions)."""
    hf = _hf(rope_scaling=LLAMA3)
    path = _write_gguf(tmp_path / "l31.gguf", hf, rope_freqs=_llama3_factors(16, 10000.0, LLAMA3))
    args, weights = load_hf_weights(resolve_model(path))
    assert args.rope_scaling["rope_type"] == "freq_factors"
    ours = build_model(args, weights, torch.float32, torch.device("cpu"))
    ids = torch.randint(0, 97, (150,)).tolist()
    torch.testing.assert_close(full_logits(ours, ids), _logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_a_llama_gguf_with_attention_biases_matches_transformers(tmp_path):
    """llama.cpp permutes q's and k's biases as it permutes their rows: the biases were read
    as written (and o's was dropped), so such a file answered wrong."""
    hf = _hf(attention_bias=True)
    with torch.no_grad():  # random init leaves biases at zero; make them count
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                         layer.self_attn.o_proj):
                proj.bias.normal_()
    args, weights = load_hf_weights(resolve_model(_write_gguf(tmp_path / "b.gguf", hf)))
    assert args.attention_bias and args.o_bias
    ours = build_model(args, weights, torch.float32, torch.device("cpu"))
    ids = torch.randint(0, 97, (40,)).tolist()
    torch.testing.assert_close(full_logits(ours, ids), _logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_rope_freqs_of_the_wrong_length_are_refused_naming_the_file(tmp_path):
    path = _write_gguf(tmp_path / "w.gguf", _hf(), rope_freqs=np.ones(5, np.float32))
    with pytest.raises(ModelNotFoundError, match=r"w\.gguf: this GGUF file's rope_freqs holds 5 factors; heads of 16 "
                                                 r"dimensions take 8"):
        load_hf_weights(resolve_model(path))


def test_a_gguf_without_a_vocab_size_key_takes_the_embeddings_rows(tmp_path):
    """llama.cpp writes `{arch}.vocab_size` for Llama only (a Qwen2 file has none): such a file was refused."""
    hf = _hf()
    args, weights = load_hf_weights(resolve_model(_write_gguf(tmp_path / "m.gguf", hf, vocab_size_key=False)))
    assert args.vocab_size == hf.config.vocab_size
    ours = build_model(args, weights, torch.float32, torch.device("cpu"))
    ids = torch.randint(0, 97, (30,)).tolist()
    torch.testing.assert_close(full_logits(ours, ids), _logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_a_gguf_tensor_this_code_does_not_compute_is_refused_naming_it(tmp_path):
    """An unknown tensor was skipped: the model ran without it, and answered wrong."""
    hf = _hf()
    path = _write_gguf(tmp_path / "m.gguf", hf, extra={"blk.0.ffn_up.bias": np.ones(96, np.float32),
                                                       "blk.0.attn_post_norm.weight": np.ones(64, np.float32)})
    with pytest.raises(ModelNotFoundError, match=r"m\.gguf: .*blk\.0\.attn_post_norm\.weight.*answers would be "
                                                 r"wrong") as e:
        load_hf_weights(resolve_model(path))
    assert "Is it complete" not in str(e.value)
    path = _write_gguf(tmp_path / "b.gguf", hf, extra={"blk.0.ffn_up.bias": np.ones(96, np.float32)})
    with pytest.raises(ModelNotFoundError, match=r"model\.layers\.0\.mlp\.up_proj\.bias"):
        load_hf_weights(resolve_model(path))
