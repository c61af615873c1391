"""Statistics of a dynamic batcher: queue, batch sizes, waits, latencies, throughput, padding."""
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
    batch_size: int = 0  # the size batches are cut at now (moves with target_latency_ms and out-of-memory errors)
    p50_batch_ms: float = 0.0  # the function's time per batch
    p99_batch_ms: float = 0.0
    padding_efficiency: float | None = None  # real / padded tokens, when items have a length
    out_of_memory: int = 0  # batches that ran out of memory and were split
    workers_replaced: int = 0  # workers that died and were replaced
    withdrawn: int = 0  # items taken off the queue unrun: their caller stopped waiting (an imap left early)

    def __str__(self) -> str:
        text = (f"{self.items} items in {self.batches} batches (mean {self.mean_batch_size:.1f}, size now "
                f"{self.batch_size}), queue {self.queue_size}, wait {self.mean_wait_ms:.2f} ms, latency p50 "
                f"{self.p50_latency_ms:.2f} / p99 {self.p99_latency_ms:.2f} ms, batch p50 {self.p50_batch_ms:.2f} / "
                f"p99 {self.p99_batch_ms:.2f} ms, {self.items_per_s:,.0f} items/s, {self.errors} errors")
        if self.padding_efficiency is not None:
            text += f", padding efficiency {self.padding_efficiency:.0%}"
        if self.out_of_memory:
            text += f", {self.out_of_memory} out-of-memory splits"
        if self.workers_replaced:
            text += f", {self.workers_replaced} workers replaced"
        if self.withdrawn:
            text += f", {self.withdrawn} withdrawn unrun"
        return text


def _percentile(values, p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))] * 1e3 if ordered else 0.0


class StatsRecorder:
    """Counters updated by the worker threads; latencies kept for the last `window` items."""

    def __init__(self, window: int = 10_000):
        self.started = time.monotonic()
        self.batches = self.items = self.errors = self.replaced = self.withdrawn = 0
        self.wait_total = 0.0
        self.latencies: deque[float] = deque(maxlen=window)
        self.batch_times: deque[float] = deque(maxlen=1000)
        self.real_tokens = self.padded_tokens = 0.0

    def batch(self, size: int, wait_total: float) -> None:
        self.batches += 1
        self.items += size
        self.wait_total += wait_total

    def padding(self, lengths: list) -> None:
        """A batch of items of these lengths, padded to the longest."""
        self.real_tokens += sum(lengths)
        self.padded_tokens += len(lengths) * max(lengths)

    def snapshot(self, queue_size: int, batch_size: int, out_of_memory: int) -> BatchStats:
        elapsed = time.monotonic() - self.started
        lat, times = list(self.latencies), list(self.batch_times)
        return BatchStats(
            queue_size=queue_size, batches=self.batches, items=self.items,
            mean_batch_size=self.items / self.batches if self.batches else 0.0,
            mean_wait_ms=self.wait_total / self.items * 1e3 if self.items else 0.0,
            p50_latency_ms=_percentile(lat, 0.50), p99_latency_ms=_percentile(lat, 0.99),
            items_per_s=self.items / elapsed if elapsed > 0 else 0.0, errors=self.errors,
            batch_size=batch_size, p50_batch_ms=_percentile(times, 0.50), p99_batch_ms=_percentile(times, 0.99),
            padding_efficiency=self.real_tokens / self.padded_tokens if self.padded_tokens else None,
            out_of_memory=out_of_memory, workers_replaced=self.replaced, withdrawn=self.withdrawn)
