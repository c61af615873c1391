"""`make demo`: classify the first SMS messages with the embedded model; accuracy and speed."""
from __future__ import annotations

import argparse
import logging
import time

from . import LLMEngine, SamplingParams
from .data import DEFAULT_SMS, SPAM_SYSTEM, predicted_label, read_sms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=200, help="how many SMS to classify (default 200)")
    ap.add_argument("--data", default=str(DEFAULT_SMS), help="path of sms_spam.tsv")
    ap.add_argument("--model", default=None, help="model: .gguf, HF directory or hub id (default: embedded)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    rows = read_sms(args.data, args.rows)
    t0 = time.perf_counter()
    engine = LLMEngine.from_pretrained(args.model)
    print(f"loaded {args.model or 'the embedded SmolLM2-135M-Instruct'} in {time.perf_counter() - t0:.1f}s")
    prompts = [engine.tokenizer.encode_prompt(text, system=SPAM_SYSTEM) for _, text in rows]
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0), progress=True)
    elapsed = time.perf_counter() - t0

    for (label, text), o in list(zip(rows, outs))[:5]:
        print(f"  [{label:4}] {text[:60]!r:64} -> {o.text.strip()!r}")
    correct = sum(predicted_label(o.text) == label for (label, _), o in zip(rows, outs))
    exact = sum(o.text.strip().strip(".").lower() in ("spam", "ham") for o in outs)
    print(f"\n{len(rows)} messages in {elapsed:.1f}s: {len(rows) / elapsed:.1f} prompts/s")
    print(f"accuracy {correct / len(rows):.1%} (an answer that says 'spam' counts as spam, any other as ham); "
          f"{exact} of {len(rows)} answers are exactly one label word")
    ham = sum(label == "ham" for label, _ in rows)
    print(f"(answering 'ham' to everything would score {ham / len(rows):.1%}: this small model often "
          f"writes a reply instead of a label)")
    print(f"engine: {engine.stats.summary()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
