"""The peer: Hugging Face transformers `generate`, one prompt at a time and in left-padded
static batches, on the same (dequantized) weights as our engine."""
from __future__ import annotations

import time

import torch


def load_peer(source, dtype=torch.bfloat16):
    """A dense transformers Llama holding the same dequantized tensors as our engine.
    (transformers 5 would run the GGUF with packed quantized kernels: not the same weights.)"""
    from transformers import LlamaConfig, LlamaForCausalLM

    from batchprompt.models import load_hf_weights

    args, weights = load_hf_weights(source)
    cfg = LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                      intermediate_size=args.intermediate_size, num_hidden_layers=args.num_layers,
                      num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
                      head_dim=args.head_dim, max_position_embeddings=args.max_position,
                      rms_norm_eps=args.rms_eps, rope_theta=args.rope_theta,
                      tie_word_embeddings=args.tie_embeddings)
    model = LlamaForCausalLM(cfg)
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    return model.to(dtype).eval()


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], max_new_tokens: int, batch_size: int,
                pad_id: int, eos_ids: list[int]) -> tuple[float, int, list[list[int]]]:
    """Greedy generation in static left-padded batches. Returns (seconds, generated tokens, outputs)."""
    outputs: list[list[int]] = []
    generated = 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad_id, eos_token_id=eos_ids)
        for row in out[:, width:].tolist():
            toks = []
            for t in row:
                toks.append(t)
                if t in eos_ids:
                    break
            generated += len(toks)
            outputs.append(toks)
    return time.perf_counter() - t0, generated, outputs
