"""Engine throughput against transformers `generate` on the same weights, in one run.

Workloads (issue 2): `spam` classifies SMS with one shared system prompt, greedy, 8 tokens;
`reply` writes a short reply to 64 SMS, 128 tokens. The peer is swept over batch sizes and
warmed at each as ours is; ratios are against its best size, generated tokens are counted up
to and including EOS, and its greedy tokens are compared with ours. Prints one markdown table
and writes benchmarks/results/engine.json (`--quick` or BENCH_QUICK=1: reduced sizes, to
check the script end to end, into engine_quick.json).
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import torch
from common import save_results
from peers import agreement, load_peer, sweep, until_eos

from batchprompt import LLMEngine, SamplingParams
from batchprompt.data import SPAM_SYSTEM, predicted_label, read_sms
from batchprompt.device import resolve_device
from batchprompt.models import resolve_model


def gemm_rate(device: torch.device) -> float:
    """The device's bfloat16 matmul rate (FLOP/s) on a model-shaped GEMM."""
    a = torch.randn(2048, 576, dtype=torch.bfloat16, device=device)
    b = torch.randn(576, 3072, dtype=torch.bfloat16, device=device)
    torch.mm(a, b)
    sync(device)
    t0, n = time.perf_counter(), 30 if device.type == "cpu" else 3000
    for _ in range(n):
        torch.mm(a, b)
    sync(device)
    return 2 * 2048 * 576 * 3072 * n / (time.perf_counter() - t0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def peak_gpu_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def note(what: str) -> None:
    """Progress on stderr: a full run takes many minutes, most of them in the peer."""
    print(f"[bench_engine {time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def run_ours(engine: LLMEngine, prompts, max_tokens: int):
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return time.perf_counter() - t0, outs


QUICK = dict(spam_rows=64, peer_rows=64, single_rows=2, reply_rows=16, reply_tokens=16)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--spam-rows", type=int, default=None, help="SMS rows for our engine (default: all 5,574)")
    ap.add_argument("--peer-rows", type=int, default=512, help="SMS rows for the padded peer")
    ap.add_argument("--single-rows", type=int, default=24, help="SMS rows for the one-at-a-time peer")
    ap.add_argument("--reply-rows", type=int, default=64, help="SMS rows for the reply workload")
    ap.add_argument("--reply-tokens", type=int, default=128, help="max_tokens of the reply workload")
    ap.add_argument("--peer-batch-sizes", default="8,16,32,64",
                    help="padded peer batch sizes to sweep; the best one is the ratios' base")
    ap.add_argument("--device", default="auto",
                    help="auto (a CUDA GPU when one is visible), cpu or cuda[:N]: ours and the peer run there; "
                         "results go to engine.json on the CPU, engine_cuda.json on a GPU")
    ap.add_argument("--quick", action="store_true", default=os.environ.get("BENCH_QUICK") == "1",
                    help=f"reduced sizes to check the script end to end, figures meaningless "
                         f"(also BENCH_QUICK=1): {QUICK}")
    args = ap.parse_args()
    if args.quick:
        vars(args).update(QUICK)
    args.sizes = [int(b) for b in args.peer_batch_sizes.split(",")]
    return args


def main() -> None:
    args = parse_args()
    device = resolve_device(args.device)
    flops_peak = gemm_rate(device)
    rows = read_sms(limit=args.spam_rows)
    engine = LLMEngine.from_pretrained(device=str(device))
    tok = engine.tokenizer
    spam = [tok.encode_prompt(text, system=SPAM_SYSTEM) for _, text in rows]
    reply_rows = read_sms(limit=args.reply_rows)
    reply = [tok.encode_prompt(f"Write a short reply to this text message: {text}") for _, text in reply_rows]
    eos = sorted(engine.eos_token_ids)
    a = engine.model.args
    res: dict = {"gemm_tflops": flops_peak / 1e12, "rows": len(rows), "quick": args.quick,
                 "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "dtype": str(engine.runner.dtype).removeprefix("torch.")}

    # --- ours: spam over the whole set
    note(f"ours: spam ({len(spam)} prompts), then reply ({len(reply)})")
    engine.generate(spam[:32], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
    warm = engine.stats
    hit0, pt0 = warm.cached_prompt_tokens, warm.prompt_tokens
    secs, outs = run_ours(engine, spam, 8)
    s = engine.stats
    ours_spam = [until_eos(o.output_token_ids, eos) for o in outs]
    computed = sum(len(p) for p in spam) - (s.cached_prompt_tokens - hit0) + sum(map(len, ours_spam))
    res["ours_spam"] = dict(
        prompts=len(spam), seconds=secs, prompts_per_s=len(spam) / secs, gen_tokens=sum(map(len, ours_spam)),
        hit_rate=(s.cached_prompt_tokens - hit0) / (s.prompt_tokens - pt0),
        accuracy=sum(predicted_label(o.text) == lab for (lab, _), o in zip(rows, outs)) / len(rows),
        mfu=computed * a.flops_per_token(context=64, with_head=False) / secs / flops_peak,
        peak_rss_gb=peak_rss_gb(), peak_gpu_gb=peak_gpu_gb(device))
    secs, outs = run_ours(engine, reply, args.reply_tokens)
    ours_reply = [until_eos(o.output_token_ids, eos) for o in outs]
    gen = sum(map(len, ours_reply))
    res["ours_reply"] = dict(prompts=len(reply), seconds=secs, gen_tokens=gen, gen_tok_per_s=gen / secs,
                             mfu=(gen + sum(map(len, reply))) * a.flops_per_token(context=128) / secs / flops_peak)
    engine_dtype = engine.runner.dtype
    del engine

    # --- peer: transformers generate, same weights, bfloat16, warmed at each shape as ours is
    note("peer: loading, then the batch-size sweeps")
    # On a GPU the peer computes in our dtype; on the CPU in bfloat16, as it always has here
    peer = load_peer(resolve_model(None), dtype=engine_dtype if device.type == "cuda" else torch.bfloat16).to(device)
    pad = tok.hf.pad_token_id if tok.hf.pad_token_id is not None else eos[0]
    n = min(args.peer_rows, len(spam))
    res["hf_padded_spam"] = peer_runs(sweep(peer, spam[:n], 8, args.sizes, pad, eos), ours_spam, "prompts_per_s")
    n1 = min(args.single_rows, len(spam))
    res["hf_single_spam"] = peer_runs(sweep(peer, spam[:n1], 8, [1], pad, eos), ours_spam, "prompts_per_s")
    res["hf_padded_reply"] = peer_runs(sweep(peer, reply, args.reply_tokens, args.sizes, pad, eos),
                                       ours_reply, "gen_tok_per_s")
    res["hf_single_reply"] = peer_runs(sweep(peer, reply[:4], args.reply_tokens, [1], pad, eos),
                                       ours_reply, "gen_tok_per_s")

    name = "engine" + ("_cuda" if device.type == "cuda" else "") + ("_quick" if args.quick else "")
    save_results(name, res)
    print(table(res))


def peer_runs(runs: dict[int, dict], ours: list[list[int]], figure: str) -> dict:
    """Figures and agreement with ours for each batch size, and the best size's, flattened."""
    by_size = {}
    for b, r in runs.items():
        outs = r.pop("outputs")
        n = len(outs)
        by_size[b] = dict(r, prompts=n, prompts_per_s=n / r["seconds"], gen_tok_per_s=r["gen_tokens"] / r["seconds"],
                          agreement=agreement(ours[:n], outs))
    best = max(by_size, key=lambda b: by_size[b][figure])
    return dict(by_size[best], batch_size=best, by_size=by_size)


def table(r: dict) -> str:
    o, p, p1 = r["ours_spam"], r["hf_padded_spam"], r["hf_single_spam"]
    orp, prp, p1r = r["ours_reply"], r["hf_padded_reply"], r["hf_single_reply"]
    padded = "transformers, padded batches of {} (best size)"
    lines = [
        *(["QUICK RUN: reduced sizes, a format check only; the figures mean nothing", ""] if r.get("quick") else []),
        f"device: {r.get('device', 'cpu')}, model dtype {r.get('dtype', 'bfloat16')}; "
        f"bfloat16 GEMM rate measured: {r['gemm_tflops']:.2f} TFLOP/s",
        "",
        "| workload | system | prompts | figure | ratio to padded peer |",
        "|---|---|---|---|---|",
        f"| spam | batchprompt engine | {o['prompts']} | {o['prompts_per_s']:.1f} prompts/s | {o['prompts_per_s'] / p['prompts_per_s']:.2f}x |",
        f"| spam | {padded.format(p['batch_size'])} | {p['prompts']} | {p['prompts_per_s']:.1f} prompts/s | 1.00x |",
        f"| spam | transformers, one at a time | {p1['prompts']} | {p1['prompts_per_s']:.1f} prompts/s | {p1['prompts_per_s'] / p['prompts_per_s']:.2f}x |",
        f"| reply | batchprompt engine | {orp['prompts']} | {orp['gen_tok_per_s']:.0f} generated tok/s | {orp['gen_tok_per_s'] / prp['gen_tok_per_s']:.2f}x |",
        f"| reply | {padded.format(prp['batch_size'])} | {prp['prompts']} | {prp['gen_tok_per_s']:.0f} generated tok/s | 1.00x |",
        f"| reply | transformers, one at a time | {p1r['prompts']} | {p1r['gen_tok_per_s']:.0f} generated tok/s | {p1r['gen_tok_per_s'] / prp['gen_tok_per_s']:.2f}x |",
        "",
        f"spam (ours): prefix-cache hit {o['hit_rate']:.1%} of prompt tokens, peak RSS {o['peak_rss_gb']:.2f} GB"
        + (f", peak GPU memory {o['peak_gpu_gb']:.2f} GB, " if o.get("peak_gpu_gb") is not None else ", ") +
        f"{o['mfu']:.0%} of the measured GEMM rate, accuracy {o['accuracy']:.1%}; "
        f"reply (ours): {orp['mfu']:.0%} of the GEMM rate",
        sweep_line("spam", p, "prompts_per_s", "prompts/s", ".1f"),
        sweep_line("reply", prp, "gen_tok_per_s", "generated tok/s", ".0f"),
        "agreement with ours, greedy token ids (bf16 near-ties explain small differences): "
        + "; ".join(agreement_part(name, run) for name, run in
                    (("spam, padded", p), ("spam, one at a time", p1), ("reply, padded", prp), ("reply, one at a time", p1r))),
        "(generated tokens are counted up to and including EOS on both sides; every peer batch size "
        "gets one untimed batch first, as our engine gets a warm-up generate)",
    ]
    return "\n".join(lines)


def sweep_line(workload: str, run: dict, key: str, unit: str, fmt: str) -> str:
    sizes = ", ".join(f"{b}: {v[key]:{fmt}}" for b, v in run["by_size"].items())
    return f"peer batch-size sweep, {workload} ({run['prompts']} prompts): {sizes} {unit}; best {run['batch_size']}"


def agreement_part(name: str, run: dict) -> str:
    g = run["agreement"]
    size = f" {run['batch_size']}" if name.endswith("padded") else ""
    return (f"{name}{size}: {g['same_prompts']:.1%} of {g['prompts']} prompts identical, "
            f"{g['same_tokens']:.1%} of tokens")


if __name__ == "__main__":
    main()
