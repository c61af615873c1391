"""Attention on CUDA: FlashAttention's variable-length kernel (one call per layer for the whole
step) against the padded SDPA groups that serve other devices, in one run on the same engine.

Spam classification (one shared system prompt, greedy, 8 tokens) over `--rows` SMS, each form
warmed first; then, with `--max-batched-tokens`, the varlen form with another step budget.
Prints a markdown table (prompts/s, accuracy, greedy agreement between the forms) and, with
`--profile`, the top CUDA kernels and CPU operations of one varlen run; writes
benchmarks/results/cuda_attention.json. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
from common import save_results

from batchprompt import EngineConfig, LLMEngine, SamplingParams
from batchprompt.data import SPAM_SYSTEM, predicted_label, read_sms
from batchprompt.models.flash_attention import varlen_op


def timed(engine: LLMEngine, prompts, sp) -> tuple[float, list]:
    engine.generate(prompts[:64], sp)  # warm-up at this form
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, sp)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=2000, help="SMS rows (default 2,000)")
    ap.add_argument("--max-batched-tokens", type=int, default=2048,
                    help="another step budget tried with the varlen form (default 2,048, the CPU's; 0: skip)")
    ap.add_argument("--profile", type=int, default=0, help="profile one varlen run over this many rows")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_cuda_attention needs a CUDA GPU")
    rows = read_sms(limit=args.rows)
    engine = LLMEngine.from_pretrained(device="cuda")
    tok, runner = engine.tokenizer, engine.runner
    a = engine.model.args
    flash = varlen_op(runner.device, runner.dtype, a.num_heads, a.num_kv_heads, a.head_dim)
    if flash is None:
        sys.exit("FlashAttention's variable-length kernel does not serve here (see the log)")
    prompts = [tok.encode_prompt(text, system=SPAM_SYSTEM) for _, text in rows]
    sp = SamplingParams(max_tokens=8, temperature=0.0)
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": len(rows),
                 "dtype": str(runner.dtype).removeprefix("torch.")}
    outs = {}
    forms = [("sdpa groups", engine, None), ("flash varlen", engine, flash)]
    if args.max_batched_tokens:
        big = LLMEngine.from_model(engine.model, tok, EngineConfig(max_num_batched_tokens=args.max_batched_tokens))
        forms.append((f"flash varlen, {args.max_batched_tokens} tokens a step", big, flash))
    for name, eng, op in forms:
        eng.runner.varlen_op = op
        secs, outs[name] = timed(eng, prompts, sp)
        acc = sum(predicted_label(o.text) == lab for (lab, _), o in zip(rows, outs[name])) / len(rows)
        res[name] = dict(seconds=secs, prompts_per_s=len(prompts) / secs, accuracy=acc,
                         budget=eng.config.max_num_batched_tokens, hit_rate=eng.stats.prefix_cache_hit_rate)
        print(f"{name}: {len(prompts) / secs:.1f} prompts/s, accuracy {acc:.1%}", file=sys.stderr, flush=True)
    base = outs["sdpa groups"]
    for name in outs:
        same = sum(x.output_token_ids == y.output_token_ids for x, y in zip(outs[name], base))
        res[name]["same_tokens_as_sdpa"] = same / len(base)
    save_results("cuda_attention", res)
    print(f"device: {res['device']}, torch {res['torch']}, {res['dtype']}, {len(rows)} SMS\n")
    print("| attention | step budget (tokens) | prompts/s | ratio | accuracy | same greedy tokens as SDPA |")
    print("|---|---|---|---|---|---|")
    b = res["sdpa groups"]["prompts_per_s"]
    for name in outs:
        r = res[name]
        print(f"| {name} | {r['budget']} | {r['prompts_per_s']:.1f} | {r['prompts_per_s'] / b:.2f}x | "
              f"{r['accuracy']:.1%} | {r['same_tokens_as_sdpa']:.1%} |")
    if args.profile:
        print(flush=True)
        runner.varlen_op = flash
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts[:args.profile], sp)
        ka = prof.key_averages()
        print(ka.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
        print(ka.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
