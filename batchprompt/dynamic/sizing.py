"""The batch size the worker cuts at: fixed, or following a latency target, and lowered after
an out-of-memory error.

- `target_latency_ms`: the size grows while the smoothed latency of full batches, scaled to the
  next size, stays under the target, and shrinks in proportion when it is over (by at most half a
  step). Sizes stay within [min_batch_size, batch_size].
- Out of memory: the batch that failed is run in halves (and their halves...); the size is then
  capped at the largest part that ran, or the largest batch that ran since the last such error,
  if smaller than the one that failed (else half of it). After `OOM_RECOVERY_BATCHES` batches at
  the cap pass, the cap rises by an eighth (at least one), until it reaches batch_size again; a
  rise that runs out of memory falls back to the size that ran before it.

The worker calls `observe` after each batch, under the processor's lock, and then sets the
processor's `batch_size` to `limit`: the callers' hot path reads that one attribute.
"""
from __future__ import annotations

import sys

# Weight of a new batch's latency in the smoothed latency: a few batches decide, not one.
SMOOTHING = 0.3
# A lowered cap rises again after this many batches at the cap ran without running out of memory.
OOM_RECOVERY_BATCHES = 16


def is_out_of_memory(error: BaseException) -> bool:
    """MemoryError, or any OutOfMemoryError (torch's, on any device), found without importing torch."""
    return isinstance(error, MemoryError) or any(c.__name__ == "OutOfMemoryError" for c in type(error).__mro__)


def release_cached_memory() -> None:
    """After an out-of-memory error on CUDA: hand the allocator's cached blocks back before the retry."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class BatchSizer:
    def __init__(self, max_size: int, min_size: int, target_s: float | None):
        self.max_size, self.min_size, self.target = max_size, min_size, target_s
        # With a target, start small and grow: a first batch of max_size could take far longer.
        self.size = min_size if target_s is not None else max_size
        self.cap: int | None = None  # after an out-of-memory error
        self.smoothed: float | None = None  # latency of full batches at the current size
        self.at_cap = 0  # batches at the cap that ran since it was last moved
        self.largest_ok = 0  # the largest batch that ran since the last out-of-memory error
        self.ooms = 0

    @property
    def active(self) -> bool:
        """Whether batches need to be observed at all (else the worker skips the lock)."""
        return self.target is not None or self.cap is not None

    @property
    def limit(self) -> int:
        return self.size if self.cap is None else min(self.size, self.cap)

    def out_of_memory(self, count: int, fitted: int) -> None:
        """A batch of `count` items ran out of memory; its parts of up to `fitted` items ran."""
        self.ooms += 1
        known = self.largest_ok if self.largest_ok < count else 0
        self.cap = max(1, min(self.cap or count, max(fitted, known) or count // 2))
        self.at_cap = self.largest_ok = 0

    def observe(self, count: int, seconds: float) -> None:
        """A batch of `count` items ran in `seconds`."""
        if self.cap is not None:
            self.largest_ok = max(self.largest_ok, count)
        if self.cap is not None and count >= self.cap:
            self.at_cap += 1
            if self.at_cap >= OOM_RECOVERY_BATCHES:
                self.at_cap = 0
                self.cap += max(1, self.cap // 8)
                if self.cap >= self.max_size:
                    self.cap = None
        if self.target is not None:
            self._follow_target(count, seconds, count >= self.size)  # never full while capped below size

    def _follow_target(self, count: int, seconds: float, full: bool) -> None:
        if not full:  # a partial batch says little about the current size, unless it is already too slow
            if seconds > self.target and count > self.min_size:
                self._resize(max(self.min_size, min(self.size, int(count * self.target / seconds))))
            return
        s = seconds if self.smoothed is None else self.smoothed + SMOOTHING * (seconds - self.smoothed)
        self.smoothed = s
        if s > self.target:
            self._resize(max(self.min_size, int(self.size * max(0.5, self.target / s))))
        elif self.size < self.max_size:
            grown = min(self.max_size, self.size + max(1, self.size // 10))
            if s * grown / self.size <= self.target:  # latency grows with size: stop short of the target
                self._resize(grown)

    def _resize(self, size: int) -> None:
        if size != self.size and self.smoothed is not None:
            self.smoothed *= size / self.size  # keep the smoothed latency in step with the new size
        self.size = size
