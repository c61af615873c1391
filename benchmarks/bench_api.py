"""The batch API's overhead over the engine driven directly, in one run (issue 3).

1,000 spam prompts (shared system prompt, greedy, 8 tokens, the default dtype) through
`LanguageModel.batch_prompt` and through `LLMEngine.generate` with the same token ids, on the
same engine. The two alternate (engine, API, engine, API) after a warm-up; the best of each is
compared. Prints a markdown table and writes benchmarks/results/api.json.
"""
from __future__ import annotations

import time

from common import overhead_table, rows_and_repeats, save_results

import batchprompt as bp
from batchprompt.data import SPAM_SYSTEM, read_sms


def main() -> None:
    args = rows_and_repeats(__doc__)

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
    best, overhead = overhead_table(times, {"engine": "LLMEngine.generate", "api": "LanguageModel.batch_prompt"},
                                    len(texts), "prompts")
    save_results("api", dict(rows=len(texts), times=times, best=best, overhead=overhead, same_text=same))
    print(f"\nbatch_prompt overhead: {overhead:+.1%} (target <= 5%); identical texts {same}/{len(texts)} "
          f"(in bfloat16 a different admission order may flip near-ties)")
    lm.destroy()


if __name__ == "__main__":
    main()
