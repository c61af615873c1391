"""`make demo`: classify the first SMS messages with the embedded model; accuracy and speed."""
from __future__ import annotations

import argparse
import logging
import time

import batchprompt as bp

from .data import DEFAULT_SMS, SPAM_SYSTEM, predicted_label, read_sms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=500, help="how many SMS to classify (default 500)")
    ap.add_argument("--data", default=str(DEFAULT_SMS), help="path of sms_spam.tsv")
    ap.add_argument("--model", default=None, help="model: .gguf, HF directory or hub id (default: embedded)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    rows = read_sms(args.data, args.rows)
    t0 = time.perf_counter()
    lm = bp.LanguageModel.create(system=SPAM_SYSTEM, model=args.model, max_tokens=8)
    print(f"loaded {args.model or 'the embedded SmolLM2-135M-Instruct'} and its system prompt "
          f"({lm.pinned_tokens} tokens pinned) in {time.perf_counter() - t0:.1f}s")
    t0 = time.perf_counter()
    results = lm.batch_prompt([text for _, text in rows], progress=True)
    elapsed = time.perf_counter() - t0

    for (label, text), r in list(zip(rows, results))[:5]:
        print(f"  [{label:4}] {text[:60]!r:64} -> {r.text.strip()!r}")
    failed = [r for r in results if not r.ok]
    correct = sum(predicted_label(r.text) == label for (label, _), r in zip(rows, results))
    exact = sum(r.text.strip().strip(".").lower() in ("spam", "ham") for r in results)
    tokens = sum(r.usage.completion_tokens for r in results)
    print(f"\n{len(rows)} messages in {elapsed:.1f}s: {len(rows) / elapsed:.1f} prompts/s, "
          f"{tokens / elapsed:.0f} generated tokens/s; {len(failed)} failed")
    print(f"accuracy {correct / len(rows):.1%} (an answer that says 'spam' counts as spam, any other as ham); "
          f"{exact} of {len(rows)} answers are exactly one label word")
    ham = sum(label == "ham" for label, _ in rows)
    print(f"(answering 'ham' to everything would score {ham / len(rows):.1%}: this small model often "
          f"writes a reply instead of a label)")
    print(f"engine: {lm.engine.stats.summary()}")
    lm.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
