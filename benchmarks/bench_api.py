"""The batch API's overhead over the engine driven directly, in one run (issue 3).

1,000 spam prompts (shared system prompt, greedy, 8 tokens, bfloat16) through
`LanguageModel.batch_prompt` and through `LLMEngine.generate` with the same token ids, on the
same engine. The two alternate (engine, API, engine, API) after a warm-up; the best of each is
compared. Prints a markdown table and writes benchmarks/results/api.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import batchprompt as bp  # noqa: E402
from batchprompt.data import SPAM_SYSTEM, read_sms  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    texts = [t for _, t in read_sms(limit=args.rows)]
    engine = bp.LLMEngine.from_pretrained()
    lm = bp.LanguageModel.create(system=SPAM_SYSTEM, model=engine, max_tokens=8, temperature=0.0)
    ids = [engine.tokenizer.encode_prompt(t, system=SPAM_SYSTEM) for t in texts]
    params = bp.SamplingParams(max_tokens=8, temperature=0.0)
    lm.batch_prompt(texts[:64])  # warm-up

    times: dict[str, list[float]] = {"engine": [], "api": []}
    texts_engine = texts_api = None
    for _ in range(args.repeats):
        # the engine runs on the service's thread: drive it there, so both use the same engine
        t0 = time.perf_counter()
        outs = lm._service.call(lambda: engine.generate(ids, params)).result()
        times["engine"].append(time.perf_counter() - t0)
        texts_engine = [o.text for o in outs]
        t0 = time.perf_counter()
        results = lm.batch_prompt(texts)  # includes rendering and tokenizing every prompt
        times["api"].append(time.perf_counter() - t0)
        texts_api = [r.text for r in results]

    same = sum(a == b for a, b in zip(texts_engine, texts_api))
    best = {k: min(v) for k, v in times.items()}
    overhead = best["api"] / best["engine"] - 1
    res = dict(rows=len(texts), times=times, best=best, overhead=overhead, same_text=same)
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "api.json").write_text(json.dumps(res, indent=2))
    print(f"| path | best of {args.repeats} (s) | prompts/s |\n|---|---|---|")
    for k in ("engine", "api"):
        print(f"| {'LLMEngine.generate' if k == 'engine' else 'LanguageModel.batch_prompt'} | "
              f"{best[k]:.1f} | {len(texts) / best[k]:.1f} |")
    print(f"\nbatch_prompt overhead: {overhead:+.1%} (target <= 5%); identical texts {same}/{len(texts)} "
          f"(bfloat16: a different admission order may flip near-ties)")
    lm.destroy()


if __name__ == "__main__":
    main()
