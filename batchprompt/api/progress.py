"""Progress: how far a batch has come, and how long the rest should take."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    """`done` counts every prompt answered: finished, failed or cancelled. `failed` counts
    those that ended with an error, `cancelled` those a cancel stopped (not failures, as in
    `BatchFailed`). `completion_tokens` counts the tokens made so far, those of prompts still
    running included where the backend can tell (the local engine, counted about every
    second; a pool of endpoints or Ray replicas report a prompt's tokens as it finishes)."""
    done: int
    total: int
    failed: int
    completion_tokens: int
    elapsed_s: float
    cancelled: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the rate so far; None before the first result."""
        if not self.done:
            return None
        return self.elapsed_s / self.done * (self.total - self.done)

    def __str__(self) -> str:
        eta = "?" if self.eta_s is None else f"{self.eta_s:.0f}s"
        cancelled = f", {self.cancelled} cancelled" if self.cancelled else ""
        return (f"{self.done}/{self.total} done ({self.failed} failed{cancelled}), "
                f"{self.tokens_per_s:,.0f} tok/s, ETA {eta}")
