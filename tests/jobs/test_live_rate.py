"""The progress bar's token rate comes from the backend's counters as tokens are made: a rate of
finished rows read 1 tok/s while every row was in flight."""
from __future__ import annotations

import time

from batchprompt.engine import EngineStats
from batchprompt.jobs.live_rate import LiveRate


class Counting:
    """A backend's stats: 1,000 tokens a second, none of its rows finished."""

    def __init__(self):
        self.t0 = time.monotonic()

    def stats(self, timeout=None):
        return EngineStats(decode_tokens=int(1000 * (time.monotonic() - self.t0)))


class Stopped:
    def stats(self, timeout=None):
        raise RuntimeError("the engine stopped")


def _poll(live: LiveRate, seconds: float):
    end, rate = time.monotonic() + seconds, None
    while time.monotonic() < end:
        rate = live.rate()
        time.sleep(0.01)
    return rate


def test_the_rate_counts_tokens_before_any_row_finishes():
    live = LiveRate(Counting(), every_s=0.05)
    try:
        rate = _poll(live, 0.5)
    finally:
        live.close()
    assert rate is not None and 500 < rate < 1500, rate


def test_a_backend_that_cannot_say_leaves_no_rate_and_raises_nothing():
    live = LiveRate(Stopped(), every_s=0.05)
    try:
        assert _poll(live, 0.3) is None
    finally:
        live.close()
    assert live.rate() is None  # after close: nothing raised
