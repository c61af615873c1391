"""Engine throughput against transformers `generate` on the same weights, in one run.

Workloads (issue 2): `spam` classifies SMS with one shared system prompt, greedy, 8 tokens;
`reply` writes a short reply to 64 SMS, 128 tokens. Prints one markdown table and writes
benchmarks/results/engine.json.
"""
from __future__ import annotations

import argparse
import resource
import time

import torch
from common import save_results
from peers import hf_generate, load_peer

from batchprompt import LLMEngine, SamplingParams
from batchprompt.data import SPAM_SYSTEM, predicted_label, read_sms
from batchprompt.models import resolve_model


def gemm_rate() -> float:
    """The machine's bfloat16 matmul rate (FLOP/s) on a model-shaped GEMM."""
    a = torch.randn(2048, 576, dtype=torch.bfloat16)
    b = torch.randn(576, 3072, dtype=torch.bfloat16)
    torch.mm(a, b)
    t0, n = time.perf_counter(), 30
    for _ in range(n):
        torch.mm(a, b)
    return 2 * 2048 * 576 * 3072 * n / (time.perf_counter() - t0)


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_ours(engine: LLMEngine, prompts, max_tokens: int):
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return time.perf_counter() - t0, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--spam-rows", type=int, default=None, help="SMS rows for our engine (default: all 5,574)")
    ap.add_argument("--peer-rows", type=int, default=512, help="SMS rows for the padded peer")
    ap.add_argument("--single-rows", type=int, default=24, help="SMS rows for the one-at-a-time peer")
    args = ap.parse_args()

    flops_peak = gemm_rate()
    rows = read_sms(limit=args.spam_rows)
    engine = LLMEngine.from_pretrained()
    tok = engine.tokenizer
    spam = [tok.encode_prompt(text, system=SPAM_SYSTEM) for _, text in rows]
    reply_rows = read_sms(limit=64)
    reply = [tok.encode_prompt(f"Write a short reply to this text message: {text}") for _, text in reply_rows]
    a = engine.model.args
    res: dict = {"gemm_tflops": flops_peak / 1e12, "rows": len(rows)}

    # --- ours: spam over the whole set
    engine.generate(spam[:32], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
    warm = engine.stats
    hit0, pt0 = warm.cached_prompt_tokens, warm.prompt_tokens
    secs, outs = run_ours(engine, spam, 8)
    s = engine.stats
    computed = sum(len(p) for p in spam) - (s.cached_prompt_tokens - hit0) + sum(len(o.output_token_ids) for o in outs)
    res["ours_spam"] = dict(
        prompts=len(spam), seconds=secs, prompts_per_s=len(spam) / secs,
        hit_rate=(s.cached_prompt_tokens - hit0) / (s.prompt_tokens - pt0),
        accuracy=sum(predicted_label(o.text) == lab for (lab, _), o in zip(rows, outs)) / len(rows),
        mfu=computed * a.flops_per_token(context=64, with_head=False) / secs / flops_peak,
        peak_rss_gb=peak_rss_gb())
    secs, outs = run_ours(engine, reply, 128)
    gen = sum(len(o.output_token_ids) for o in outs)
    res["ours_reply"] = dict(prompts=len(reply), seconds=secs, gen_tokens=gen, gen_tok_per_s=gen / secs,
                             mfu=(gen + sum(map(len, reply))) * a.flops_per_token(context=128) / secs / flops_peak)
    del engine

    # --- peer: transformers generate, same weights, bfloat16
    peer = load_peer(resolve_model(None))
    eos = sorted(tok.eos_token_ids)
    pad = tok.hf.pad_token_id if tok.hf.pad_token_id is not None else eos[0]
    hf_generate(peer, spam[:8], 8, 8, pad, eos)  # warm-up
    n = min(args.peer_rows, len(spam))
    secs, _, _ = hf_generate(peer, spam[:n], 8, 32, pad, eos)
    res["hf_padded_spam"] = dict(prompts=n, seconds=secs, prompts_per_s=n / secs)
    n1 = min(args.single_rows, len(spam))
    secs, _, _ = hf_generate(peer, spam[:n1], 8, 1, pad, eos)
    res["hf_single_spam"] = dict(prompts=n1, seconds=secs, prompts_per_s=n1 / secs)
    secs, gen, _ = hf_generate(peer, reply, 128, 32, pad, eos)
    res["hf_padded_reply"] = dict(prompts=len(reply), seconds=secs, gen_tokens=gen, gen_tok_per_s=gen / secs)
    secs, gen, _ = hf_generate(peer, reply[:4], 128, 1, pad, eos)
    res["hf_single_reply"] = dict(prompts=4, seconds=secs, gen_tokens=gen, gen_tok_per_s=gen / secs)

    save_results("engine", res)
    print(table(res))


def table(r: dict) -> str:
    o, p, p1 = r["ours_spam"], r["hf_padded_spam"], r["hf_single_spam"]
    orp, prp, p1r = r["ours_reply"], r["hf_padded_reply"], r["hf_single_reply"]
    lines = [
        f"bfloat16 GEMM rate measured: {r['gemm_tflops']:.2f} TFLOP/s",
        "",
        "| workload | system | prompts | figure | ratio to padded peer |",
        "|---|---|---|---|---|",
        f"| spam | batchprompt engine | {o['prompts']} | {o['prompts_per_s']:.1f} prompts/s | {o['prompts_per_s'] / p['prompts_per_s']:.2f}x |",
        f"| spam | transformers, padded batches of 32 | {p['prompts']} | {p['prompts_per_s']:.1f} prompts/s | 1.00x |",
        f"| spam | transformers, one at a time | {p1['prompts']} | {p1['prompts_per_s']:.1f} prompts/s | {p1['prompts_per_s'] / p['prompts_per_s']:.2f}x |",
        f"| reply | batchprompt engine | {orp['prompts']} | {orp['gen_tok_per_s']:.0f} generated tok/s | {orp['gen_tok_per_s'] / prp['gen_tok_per_s']:.2f}x |",
        f"| reply | transformers, padded batches of 32 | {prp['prompts']} | {prp['gen_tok_per_s']:.0f} generated tok/s | 1.00x |",
        f"| reply | transformers, one at a time | {p1r['prompts']} | {p1r['gen_tok_per_s']:.0f} generated tok/s | {p1r['gen_tok_per_s'] / prp['gen_tok_per_s']:.2f}x |",
        "",
        f"spam (ours): prefix-cache hit {o['hit_rate']:.1%} of prompt tokens, peak RSS {o['peak_rss_gb']:.2f} GB, "
        f"{o['mfu']:.0%} of the measured GEMM rate, accuracy {o['accuracy']:.1%}; "
        f"reply (ours): {orp['mfu']:.0%} of the GEMM rate",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
