"""Engine statistics: throughput, queue sizes, prefix-cache hit rate, KV use."""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class EngineStats:
    started: float = field(default_factory=time.monotonic)
    steps: int = 0
    inside_steps: int = 0  # of which run inside a longer step, for requests that outrank it
    prefill_tokens: int = 0  # prompt tokens computed (cache hits excluded)
    decode_tokens: int = 0  # tokens generated
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    cached_prompt_tokens: int = 0  # of which served by the prefix cache
    preemptions: int = 0
    finished: int = 0
    failed: int = 0
    busy_seconds: float = 0.0  # time spent inside step()
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_bytes: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.busy_seconds if self.busy_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.busy_seconds if self.busy_seconds else 0.0

    def summary(self) -> str:
        return (f"{self.finished} done ({self.failed} failed), {self.running} running, "
                f"{self.waiting} waiting | prefill {self.prefill_tokens_per_s:,.0f} tok/s, "
                f"decode {self.decode_tokens_per_s:,.0f} tok/s | prefix-cache hit "
                f"{self.prefix_cache_hit_rate:.0%} | KV {self.kv_blocks_used}/{self.kv_blocks_total} blocks "
                f"({self.kv_bytes / 2**20:,.0f} MiB), {self.preemptions} preemptions")
