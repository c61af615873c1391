"""Statistics of a dynamic batcher: queue, batch sizes, waits, latencies, throughput."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchStats:
    queue_size: int
    batches: int
    items: int
    mean_batch_size: float
    mean_wait_ms: float  # enqueue to the start of its batch
    p50_latency_ms: float  # enqueue to result
    p99_latency_ms: float
    items_per_s: float
    errors: int

    def __str__(self) -> str:
        return (f"{self.items} items in {self.batches} batches (mean {self.mean_batch_size:.1f}), queue "
                f"{self.queue_size}, wait {self.mean_wait_ms:.2f} ms, latency p50 {self.p50_latency_ms:.2f} / "
                f"p99 {self.p99_latency_ms:.2f} ms, {self.items_per_s:,.0f} items/s, {self.errors} errors")


class StatsRecorder:
    """Counters updated by the worker thread; latencies kept for the last `window` items."""

    def __init__(self, window: int = 10_000):
        self.started = time.monotonic()
        self.batches = self.items = self.errors = 0
        self.wait_total = 0.0
        self.latencies: deque[float] = deque(maxlen=window)

    def batch(self, size: int, wait_total: float) -> None:
        self.batches += 1
        self.items += size
        self.wait_total += wait_total

    def snapshot(self, queue_size: int) -> BatchStats:
        lat = sorted(self.latencies)

        def pct(p: float) -> float:
            return lat[min(len(lat) - 1, int(p * len(lat)))] * 1e3 if lat else 0.0

        elapsed = time.monotonic() - self.started
        return BatchStats(
            queue_size=queue_size, batches=self.batches, items=self.items,
            mean_batch_size=self.items / self.batches if self.batches else 0.0,
            mean_wait_ms=self.wait_total / self.items * 1e3 if self.items else 0.0,
            p50_latency_ms=pct(0.50), p99_latency_ms=pct(0.99),
            items_per_s=self.items / elapsed if elapsed > 0 else 0.0, errors=self.errors)
