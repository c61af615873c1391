"""StepCost: how long a step takes for how many tokens, fitted from the steps that ran.

A step costs about `fixed + per_token * tokens`: the fixed part is reading the weights,
launching the work and the bookkeeping, the same for one token as for a hundred; the rest grows
with the tokens. Their ratio is the device's: on a CPU a step of one token costs about what 50
to 100 tokens do, on a GPU about what thousands do. The scheduler uses the fit to decide how
many lower-priority tokens a step may carry beside higher-priority requests
(EngineConfig.priority_slowdown), so the same setting fits every device.
"""
from __future__ import annotations


class StepCost:
    """Weighted least squares over the steps seen, each older step weighing `decay` times less
    (about the last 50 steps count). A fit needs the steps' token counts to vary (a step of a
    decode beside one of a batch's prefill does); until then, and while they stop varying, the
    last fit stands."""

    min_spread = 0.25  # the token counts' standard deviation, relative to their mean, a fit needs

    def __init__(self, decay: float = 0.98):
        self.decay = decay
        self._w = self._n = self._t = self._nn = self._nt = 0.0
        self.fixed_s: float | None = None
        self.per_token_s: float | None = None

    def observe(self, tokens: int, seconds: float) -> None:
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

    def extra_tokens(self, factor: float, tokens: int) -> int | None:
        """How many tokens a step of `tokens` may take on top and still last at most `factor`
        times as long as it would alone; None until a fit exists."""
        if self.per_token_s is None:
            return None
        alone = self.fixed_s + self.per_token_s * tokens
        return int((factor - 1.0) * alone / self.per_token_s)
