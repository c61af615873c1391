"""Jump-forward on JSON extraction, in one run: examples/extract_fields.py's workload (200 SMS
into a pydantic model, the default dtype, greedy) on an engine with jump_forward on and one with it
off, alternating, best of --repeats. Writes benchmarks/results/jump_forward.json."""
from __future__ import annotations

import sys
import time

from common import ROOT, rows_and_repeats, save_results

import batchprompt as bp
from batchprompt.data import read_sms

sys.path.insert(0, str(ROOT / "examples"))
from extract_fields import EXAMPLE, SYSTEM, SmsFields  # noqa: E402


def main() -> None:
    args = rows_and_repeats(__doc__, rows=200, repeats=2)
    texts = [t for _, t in read_sms(limit=args.rows)]
    sessions = {}
    for jf in (False, True):
        engine = bp.LLMEngine.from_pretrained(jump_forward=jf)
        sessions[jf] = bp.LanguageModel.create(system=SYSTEM, initial_prompts=EXAMPLE, model=engine,
                                               json_schema=SmsFields, max_tokens=48)
        sessions[jf].batch_prompt(texts[:16])  # warm-up
    times = {False: [], True: []}
    for _ in range(args.repeats):
        for jf, lm in sessions.items():
            before = lm.engine.stats.decode_tokens
            t0 = time.perf_counter()
            results = lm.batch_prompt(texts)
            times[jf].append(time.perf_counter() - t0)
            sampled = lm.engine.stats.decode_tokens - before
            valid = sum(r.ok and isinstance(r.parsed, SmsFields) for r in results)
            print(f"jump_forward={jf}: {times[jf][-1]:.1f}s, {sampled} sampled tokens, "
                  f"{sum(r.usage.completion_tokens for r in results)} output tokens, {valid}/{len(texts)} valid")
    best = {jf: min(v) for jf, v in times.items()}
    print(f"\n| jump-forward | best of {args.repeats} (s) | messages/s |\n|---|---|---|")
    for jf in (False, True):
        print(f"| {'on' if jf else 'off'} | {best[jf]:.1f} | {len(texts) / best[jf]:.1f} |")
    print(f"\nspeed-up {best[False] / best[True]:.2f}x")
    save_results("jump_forward", dict(rows=len(texts), times={str(k): v for k, v in times.items()}))


if __name__ == "__main__":
    main()
