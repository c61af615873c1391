"""StepCost: how long a step takes for how many tokens, learned from the steps that ran.

A step's time grows with its tokens, but not in a straight line: on a CPU a step of one token
costs about 30 ms here, one of 64 about 170 ms and one of 2,048 about 3 s, so a line fitted
through all of them puts the one-token step at twice its time. The scheduler asks what a step of
a few chat tokens costs alone, and how many batch tokens it may add and stay within
`EngineConfig.priority_slowdown` times that; both answers come from the measured steps of each
size class (powers of two), interpolated between the classes. A class that was never measured
(or not for a minute) is measured: the scheduler runs one step of the chat's tokens alone.
Beyond the largest class measured, a least-squares line over recent steps gives the time per
token. So the same setting fits every device.
"""
from __future__ import annotations

import bisect
import time


class StepCost:
    """Per size class (tokens.bit_length()), a running mean of the steps' tokens and seconds;
    and weighted least squares over all steps, each older step weighing `decay` times less
    (about the last 50 steps count), for the time per token beyond the classes measured."""

    min_spread = 0.25  # the token counts' standard deviation, relative to their mean, a fit needs
    point_weight = 0.3  # a new step's weight in its class's means
    stale_s = 60.0  # a class not measured for this long is measured again when asked for

    def __init__(self, decay: float = 0.98, clock=time.monotonic):
        self.decay = decay
        self.clock = clock
        self._w = self._n = self._t = self._nn = self._nt = 0.0
        self.fixed_s: float | None = None
        self.per_token_s: float | None = None
        self._classes: dict[int, list[float]] = {}  # class -> [mean tokens, mean seconds, last seen]

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0:
            return
        point = self._classes.get(tokens.bit_length())
        if point is None:
            self._classes[tokens.bit_length()] = [float(tokens), seconds, self.clock()]
        else:
            w = self.point_weight
            point[0] += w * (tokens - point[0])
            point[1] += w * (seconds - point[1])
            point[2] = self.clock()
        self._fit(tokens, seconds)

    def _fit(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self._w = d * self._w + 1.0
        self._n = d * self._n + tokens
        self._t = d * self._t + seconds
        self._nn = d * self._nn + tokens * tokens
        self._nt = d * self._nt + tokens * seconds
        mean_n, mean_t = self._n / self._w, self._t / self._w
        var = self._nn / self._w - mean_n * mean_n
        if var <= (self.min_spread * mean_n) ** 2:
            return
        per_token = (self._nt / self._w - mean_n * mean_t) / var
        if per_token <= 0:  # noise: time that does not grow with the tokens
            return
        self.per_token_s = per_token
        self.fixed_s = max(mean_t - per_token * mean_n, 0.0)

    def needs_measuring(self, tokens: int) -> bool:
        """Whether no step of `tokens`' size class ran (in the last `stale_s` seconds)."""
        point = self._classes.get(max(tokens, 1).bit_length())
        return point is None or self.clock() - point[2] > self.stale_s

    def _points(self) -> tuple[list[float], list[float]]:
        """The classes' (tokens, seconds), by tokens, the seconds made non-decreasing."""
        pts = sorted((p[0], p[1]) for p in self._classes.values())
        ns, ts = [p[0] for p in pts], [p[1] for p in pts]
        for i in range(1, len(ts)):
            ts[i] = max(ts[i], ts[i - 1])
        return ns, ts

    def seconds(self, tokens: int) -> float | None:
        """A step of `tokens`' predicted time; None before any step ran."""
        ns, ts = self._points()
        if not ns:
            return None
        return _interpolate(ns, ts, tokens, self.per_token_s)

    def extra_tokens(self, factor: float, tokens: int, measure: bool = True) -> int | None:
        """How many tokens a step of `tokens` may take on top and still last at most `factor`
        times as long as it would alone. 0 when `tokens`' class needs measuring and `measure`
        is set (the step then runs them alone); None before any step ran."""
        if measure and self.needs_measuring(tokens):
            return 0
        ns, ts = self._points()
        if not ns:
            return None
        target = factor * _interpolate(ns, ts, tokens, self.per_token_s)
        fits = lambda n: _interpolate(ns, ts, n, self.per_token_s) <= target  # noqa: E731
        lo, hi = tokens, tokens + 1
        while fits(hi):  # grow until a step is too long (the time rises past the last class)
            lo, hi = hi, 2 * hi
            if hi > 1 << 24:
                return lo - tokens
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo - tokens


def _interpolate(ns: list[float], ts: list[float], n: float, per_token: float | None) -> float:
    """Seconds at `n` on the line through the points (ns, ts); past the last point the slope is
    `per_token` (else the last segment's), below the first the first segment's."""
    if len(ns) == 1:
        slope = per_token or 0.0
        return max(ts[0] + slope * (n - ns[0]), 0.0)
    if n >= ns[-1]:
        last = (ts[-1] - ts[-2]) / (ns[-1] - ns[-2])
        return ts[-1] + (per_token if per_token is not None else last) * (n - ns[-1])
    i = max(bisect.bisect_right(ns, n), 1)
    n0, n1, t0, t1 = ns[i - 1], ns[i], ts[i - 1], ts[i]
    return max(t0 + (t1 - t0) * (n - n0) / (n1 - n0), 0.0)
