"""Structured output's cost and what it buys, in one run (issue 6).

The spam workload (shared system prompt, greedy, the default dtype: bfloat16 where the CPU has it) over the first --rows SMS:
- free: no constraint, max_tokens 8 (issue 2's workload); the answer's label is read off its
  text (an answer that says "spam" counts as spam, any other as ham),
- decode: choices=["spam", "ham"] by constrained decoding (a token mask at every step),
- score: the same choices by log-likelihood (one prefill; the labels share the prompt's KV),
- free-2: no constraint, max_tokens 2: as many generated tokens as `decode`, so the difference
  is the mask's cost per token.
The paths alternate round by round after a warm-up; the best time of each is compared.
Accuracy against the labels for each path, and again with four labelled examples in the
shared prompt (as `make demo`). Writes benchmarks/results/structured.json.
"""
from __future__ import annotations

import time

from common import rows_and_repeats, save_results

import batchprompt as bp
from batchprompt.data import SPAM_EXAMPLES, SPAM_SYSTEM, example_turns, label_scores, predicted_label, read_sms

LABELS = ["spam", "ham"]
PATHS = {
    "free": dict(max_tokens=8),
    "decode": dict(choices=LABELS, choice_mode="decode"),
    "score": dict(choices=LABELS, choice_mode="score"),
    "free-2": dict(max_tokens=2),
}


def accuracy(rows, results, exact: bool) -> dict:
    pred = [r.text if exact else predicted_label(r.text) for r in results]
    scores = label_scores([lab for lab, _ in rows], pred, LABELS)
    return {**scores, "exact_labels": sum(r.text in LABELS for r in results)}


def main() -> None:
    args = rows_and_repeats(__doc__, rows=1000, repeats=2)
    examples = {t for _, t in SPAM_EXAMPLES}
    rows = [r for r in read_sms(limit=args.rows) if r[1] not in examples]
    texts = [t for _, t in rows]
    engine = bp.LLMEngine.from_pretrained()
    lm = bp.LanguageModel.create(system=SPAM_SYSTEM, model=engine, temperature=0.0)
    for opts in PATHS.values():  # warm-up, grammar compiled once
        lm.batch_prompt(texts[:32], **opts)

    times: dict[str, list[float]] = {k: [] for k in PATHS}
    tokens: dict[str, int] = {}
    quality: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name, opts in PATHS.items():
            t0 = time.perf_counter()
            results = lm.batch_prompt(texts, **opts)
            times[name].append(time.perf_counter() - t0)
            assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
            tokens[name] = sum(r.usage.completion_tokens for r in results)
            quality[name] = accuracy(rows, results, exact=name in ("decode", "score"))
    lm.destroy()

    shots = {}
    with bp.LanguageModel.create(system=SPAM_SYSTEM, initial_prompts=example_turns(), model=engine) as fs:
        for name in ("decode", "score"):
            shots[name] = accuracy(rows, fs.batch_prompt(texts, **PATHS[name]), exact=True)
        shots["free"] = accuracy(rows, fs.batch_prompt(texts, max_tokens=8), exact=False)

    best = {k: min(v) for k, v in times.items()}
    n = len(texts)
    from batchprompt.device import resolve_device, resolve_dtype

    dtype = str(resolve_dtype("auto", resolve_device("auto"))).removeprefix("torch.")
    print(f"{n} SMS, best of {args.repeats}, {dtype}\n")
    print("| path | time (s) | prompts/s | generated tokens | vs free | accuracy | exact labels |")
    print("|---|---|---|---|---|---|---|")
    for name in PATHS:
        q = quality[name]
        print(f"| {name} | {best[name]:.1f} | {n / best[name]:.1f} | {tokens[name]:,} | "
              f"{best[name] / best['free'] - 1:+.0%} | {q['accuracy']:.1%} | {q['exact_labels']}/{n} |")
    mask_cost = best["decode"] / best["free-2"] - 1
    print(f"\nconstrained decoding vs free (8 tokens): {best['decode'] / best['free'] - 1:+.1%} time "
          f"(target <= +15%); vs free with as many tokens (2): {mask_cost:+.1%}")
    print("\nwith four labelled examples in the shared prompt (accuracy; spam recall, ham recall):")
    for name, q in shots.items():
        print(f"  {name:6} {q['accuracy']:.1%}  ({q['spam_recall']:.0%}, {q['ham_recall']:.0%})")
    ham = sum(lab == "ham" for lab, _ in rows) / n
    print(f"  (all 'ham' scores {ham:.1%})")
    save_results("structured", dict(rows=n, times=times, best=best, tokens=tokens, quality=quality,
                                    few_shot=shots, all_ham=ham))


if __name__ == "__main__":
    main()
