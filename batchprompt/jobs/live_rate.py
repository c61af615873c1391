"""The generated-token rate a job's progress bar shows, read from its backend's counters as the
tokens are made, not as rows finish: with every row in flight at once, rows finish near the end,
and a rate of finished rows read 1 tok/s for most of a job that took a minute."""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor


class LiveRate:
    """`rate()`: tokens generated per second since this was made, from the backend's stats
    (EngineStats.decode_tokens), taken at most every `every_s` seconds on a thread of its own (a
    snapshot waits for the engine's step to end); None until two snapshots are in."""

    def __init__(self, backend, every_s: float = 1.0):
        self._backend, self._every_s = backend, every_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="batchprompt-rate")
        self._base: tuple[float, int] | None = None
        self._rate: float | None = None
        self._asked = time.monotonic()
        self._pending: Future | None = self._pool.submit(self._snapshot)

    def _snapshot(self) -> tuple[float, int]:
        return time.monotonic(), self._backend.stats(timeout=60).decode_tokens

    def rate(self) -> float | None:
        fut = self._pending
        if fut is not None and fut.done():
            self._pending = None
            try:
                t, tokens = fut.result()
            except Exception:  # noqa: BLE001  (a stopped engine, a timeout: the rate stays as it was)
                t = None
            if t is not None:
                if self._base is None:
                    self._base = (t, tokens)
                elif t > self._base[0]:
                    self._rate = (tokens - self._base[1]) / (t - self._base[0])
        now = time.monotonic()
        if self._pending is None and now - self._asked >= self._every_s:
            self._asked = now
            try:
                self._pending = self._pool.submit(self._snapshot)
            except RuntimeError:  # closed
                pass
        return self._rate

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
