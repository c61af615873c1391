"""Shared by the benchmarks: the repository on sys.path (importing this module sets it, and
keeps the hub offline), results files, and the best-of-N comparison table."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def save_results(name: str, data: dict) -> Path:
    """Write benchmarks/results/NAME.json."""
    out = Path(__file__).resolve().parent / "results"
    out.mkdir(exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def rows_and_repeats(doc: str, rows: int = 1000, repeats: int = 2) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--rows", type=int, default=rows)
    ap.add_argument("--repeats", type=int, default=repeats)
    return ap.parse_args()


def overhead_table(times: dict[str, list[float]], labels: dict[str, str], n: int, unit: str) -> tuple[dict, float]:
    """Print the best time of each path as a markdown table; returns (best, overhead of the
    second path over the first)."""
    best = {k: min(v) for k, v in times.items()}
    first, second = list(labels)
    repeats = len(times[first])
    print(f"| path | best of {repeats} (s) | {unit}/s |\n|---|---|---|")
    for key, label in labels.items():
        print(f"| {label} | {best[key]:.1f} | {n / best[key]:.1f} |")
    return best, best[second] / best[first] - 1
