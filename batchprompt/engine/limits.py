"""StepLimits: how many sequences and tokens one step may take, lowered after a step ran out of
device memory and raised back gradually."""
from __future__ import annotations

from .config import EngineConfig


class StepLimits:
    """The configured `max_num_seqs` and `max_num_batched_tokens` are ceilings. A step that runs
    out of memory halves both (below what that step held, so a retry is always smaller); after
    `recover_after` steps in a row succeed, each doubles back, up to its ceiling. Memory that ran
    short once (another process, fragmentation, long prompts together) is likely short again, so
    the engine does not return at once to the batch that failed."""

    recover_after = 16

    def __init__(self, config: EngineConfig):
        self.max_seqs_ceiling = config.max_num_seqs
        self.max_tokens_ceiling = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.num_shrinks = 0
        self._good_steps = 0

    @property
    def lowered(self) -> bool:
        return (self.max_num_seqs < self.max_seqs_ceiling
                or self.max_num_batched_tokens < self.max_tokens_ceiling)

    def shrink(self, num_seqs: int, num_tokens: int) -> bool:
        """A step of `num_seqs` sequences and `num_tokens` tokens ran out of memory: lower the
        limits below it. False when it was one token of one sequence: nothing smaller exists."""
        if num_seqs <= 1 and num_tokens <= 1:
            return False
        self.max_num_seqs = max(1, min(self.max_num_seqs, num_seqs) // 2)
        self.max_num_batched_tokens = max(1, min(self.max_num_batched_tokens, num_tokens) // 2)
        self.num_shrinks += 1
        self._good_steps = 0
        return True

    def step_succeeded(self) -> None:
        if not self.lowered:
            return
        self._good_steps += 1
        if self._good_steps >= self.recover_after:
            self._good_steps = 0
            self.max_num_seqs = min(2 * self.max_num_seqs, self.max_seqs_ceiling)
            self.max_num_batched_tokens = min(2 * self.max_num_batched_tokens, self.max_tokens_ceiling)
