"""The peer: Hugging Face transformers `generate`, one prompt at a time and in left-padded
static batches, on the same (dequantized) weights as our engine."""
from __future__ import annotations

import sys
import time

import torch


def load_peer(source, dtype=torch.bfloat16):
    """A dense transformers Llama holding exactly the dequantized tensors our engine holds.
    (transformers 5 would run the GGUF with packed quantized kernels: not the same weights.)
    Any key the checkpoint lacks or the model does not know is an error, never a random
    weight, and every tensor is checked against the checkpoint's after loading."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from batchprompt.models import load_hf_weights
    from batchprompt.models.rotary import inverse_frequencies

    args, weights = load_hf_weights(source)
    if args.architecture != "llama" or args.qk_norm:
        raise ValueError(f"the transformers peer is a Llama; this model is {args.architecture!r}")
    cfg = LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                      intermediate_size=args.intermediate_size, num_hidden_layers=args.num_layers,
                      num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
                      head_dim=args.head_dim, max_position_embeddings=args.max_position,
                      rms_norm_eps=args.rms_eps, attention_bias=args.attention_bias,
                      rope_parameters={"rope_type": "default", **(args.rope_scaling or {}),
                                       "rope_theta": args.rope_theta},
                      tie_word_embeddings=args.tie_embeddings)
    # Built in `dtype` as from_pretrained does: the rotary frequencies stay float32 (a
    # model.to(bfloat16) afterwards would round them, which our engine does not do).
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    state = dict(weights)
    if args.tie_embeddings:
        # Our engine ignores a separate head when tied, so the peer must too.
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)  # raises on a missing or unexpected key
    for name, t in model.state_dict().items():
        if not torch.equal(t, state[name].to(dtype)):
            raise AssertionError(f"peer tensor {name} differs from the checkpoint's after loading")
    want = inverse_frequencies(args.head_dim, args.rope_theta, args.rope_scaling).float()
    if not torch.allclose(model.model.rotary_emb.inv_freq.float(), want, rtol=1e-6, atol=0):
        raise AssertionError("the peer's rotary frequencies differ from our engine's")
    return model.eval()


def until_eos(row: list[int], eos_ids) -> list[int]:
    """The tokens really generated: up to and including the first EOS (what follows in a
    padded batch is padding, not work done for this prompt)."""
    for i, t in enumerate(row):
        if t in eos_ids:
            return row[:i + 1]
    return row


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], max_new_tokens: int, batch_size: int,
                pad_id: int, eos_ids: list[int]) -> tuple[float, int, list[list[int]]]:
    """Greedy generation in static left-padded batches. Returns (seconds, generated tokens
    counted up to and including EOS, outputs)."""
    outputs: list[list[int]] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad_id, eos_token_id=eos_ids)
        outputs.extend(until_eos(row, eos_ids) for row in out[:, width:].tolist())
    return time.perf_counter() - t0, sum(map(len, outputs)), outputs


def warmed_generate(model, prompts, max_new_tokens: int, batch_size: int, pad_id: int, eos_ids: list[int],
                    warm_tokens: int = 8) -> tuple[float, int, list[list[int]]]:
    """hf_generate after one untimed batch of the same size, as our engine gets a warm-up
    generate before it is timed."""
    hf_generate(model, prompts[:batch_size], min(warm_tokens, max_new_tokens), batch_size, pad_id, eos_ids)
    return hf_generate(model, prompts, max_new_tokens, batch_size, pad_id, eos_ids)


def sweep(model, prompts, max_new_tokens: int, sizes: list[int], pad_id: int, eos_ids: list[int]) -> dict[int, dict]:
    """The peer at each batch size, each warmed first (1 is one at a time; sizes above the
    number of prompts would only repeat the largest batch, so they are left out):
    {size: {seconds, gen_tokens, outputs}}."""
    runs = {}
    for b in sorted(s for s in sizes if s <= len(prompts)) or [len(prompts)]:
        print(f"[peer] {len(prompts)} prompts, {max_new_tokens} tokens, batches of {b}", file=sys.stderr, flush=True)
        secs, gen, outs = warmed_generate(model, prompts, max_new_tokens, b, pad_id, eos_ids)
        runs[b] = dict(seconds=secs, gen_tokens=gen, outputs=outs)
    return runs


def agreement(ours: list[list[int]], peer: list[list[int]]) -> dict:
    """How far two greedy runs agree: the share of prompts whose generated ids are identical,
    and the share of positions holding the same token (over the longer of each pair)."""
    same_tokens = sum(sum(a == b for a, b in zip(x, y)) for x, y in zip(ours, peer, strict=True))
    positions = sum(max(len(x), len(y)) for x, y in zip(ours, peer))
    return dict(prompts=len(peer), same_prompts=sum(x == y for x, y in zip(ours, peer)) / len(peer),
                same_tokens=same_tokens / max(positions, 1))
