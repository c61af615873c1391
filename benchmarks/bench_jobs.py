"""`batchprompt run` against `batch_prompt` on the same prompts, in one run (issue 4).

1,000 spam rows as OpenAI batch JSONL (system + user message, greedy, 8 tokens) through the
job runner behind `batchprompt run` (reading, journaling in SQLite, writing OpenAI output
lines), and the same prompts through `LanguageModel.batch_prompt`, on the same engine,
alternating after a warm-up, best of two each. Prints a markdown table and writes
benchmarks/results/jobs.json.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from common import overhead_table, rows_and_repeats, save_results

import batchprompt as bp
from batchprompt.data import SPAM_SYSTEM, read_sms
from batchprompt.jobs import JobOptions, run_job


def main() -> None:
    args = rows_and_repeats(__doc__)
    texts = [t for _, t in read_sms(limit=args.rows)]
    tmp = Path(tempfile.mkdtemp(prefix="bench-jobs-"))
    inp = tmp / "in.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                       "body": {"model": "smollm2", "max_tokens": 8, "temperature": 0,
                                                "messages": [{"role": "system", "content": SPAM_SYSTEM},
                                                             {"role": "user", "content": t}]}}) + "\n"
                       for i, t in enumerate(texts)))
    lm = bp.LanguageModel.create(system=SPAM_SYSTEM, max_tokens=8)
    lm.batch_prompt(texts[:64])  # warm-up (loads the shared engine)

    times: dict[str, list[float]] = {"batch_prompt": [], "run": []}
    for k in range(args.repeats):
        t0 = time.perf_counter()
        lm.batch_prompt(texts)
        times["batch_prompt"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        s = run_job(JobOptions(str(inp), str(tmp / f"out{k}.jsonl"), progress=False), out=open(os.devnull, "w"))
        times["run"].append(time.perf_counter() - t0)
        assert s.ok == len(texts), s
    best, overhead = overhead_table(
        times, {"batch_prompt": "LanguageModel.batch_prompt", "run": "batchprompt run (job runner)"},
        len(texts), "rows")
    save_results("jobs", dict(rows=len(texts), times=times, best=best, overhead=overhead))
    print(f"\nbatchprompt run overhead: {overhead:+.1%} (target <= 5%)")
    lm.destroy()


if __name__ == "__main__":
    main()
