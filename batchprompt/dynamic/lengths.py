"""Length-aware batching: items of similar length go into the same batch, so that padding them to
the longest costs little.

`buckets=[32, 64, 128]` puts lengths up to 32 in one bucket, 33 to 64 in the next, and so on
(beyond the last boundary: one more bucket). `buckets="auto"`: boundaries that grow by a factor of
√2, so that the longest item of a batch is at most 1.41 times its shortest (plus one).
"""
from __future__ import annotations

import bisect
import functools
import math
import numbers
from typing import Any, Callable, Sequence


def bucket_function(buckets: Sequence[float] | str | None) -> Callable[[float], int]:
    """The bucket number of a length; checks `buckets` and raises a ValueError naming the fix."""
    if buckets is None:
        return _one_bucket
    if isinstance(buckets, str):
        if buckets != "auto":
            raise ValueError(f"buckets={buckets!r}: give 'auto' or a list of increasing lengths, e.g. [32, 64, 128]")
        return _auto_bucket
    bounds = list(buckets)
    positive = all(not isinstance(b, bool) and isinstance(b, numbers.Real) and 0 < b < math.inf for b in bounds)
    if not bounds or not positive or bounds != sorted(set(bounds)):
        raise ValueError(f"buckets={buckets!r}: give 'auto' or a list of increasing positive lengths, "
                         f"e.g. [32, 64, 128]")
    return functools.partial(bisect.bisect_left, bounds)


def _one_bucket(length: float) -> int:
    return 0


def _auto_bucket(length: float) -> int:
    return 0 if length <= 1 else math.ceil(2 * math.log2(length))


def checked_length(length: Callable[[Any], float], name: str = "length",
                   meaning: str = "the item's length in tokens") -> Callable[[Any], float]:
    """`length` (or `cost`), with a clear error for a result that is not a finite number >= 0."""
    def measure(item: Any) -> float:
        n = length(item)
        if isinstance(n, bool) or not isinstance(n, numbers.Real) or not 0 <= n < math.inf:  # NaN fails too
            raise ValueError(f"{name}(item) returned {n!r} for {_short(item)}: it must be a finite number >= 0 "
                             f"({meaning})")
        return n
    return measure


def _short(item: Any) -> str:
    text = repr(item)
    return text if len(text) <= 60 else text[:57] + "..."


class BucketTally:
    """The count and longest length of the items queued in one bucket. Lengths are counted, so
    that taking a batch out finds the new longest without a scan of the queue."""

    __slots__ = ("count", "lengths", "longest")

    def __init__(self):
        self.count = 0
        self.lengths: dict[float, int] = {}
        self.longest = 0.0

    def add(self, length: float) -> None:
        self.count += 1
        self.lengths[length] = self.lengths.get(length, 0) + 1
        if length > self.longest:
            self.longest = length

    def remove(self, length: float) -> None:
        self.count -= 1
        left = self.lengths[length] - 1
        if left:
            self.lengths[length] = left
            return
        del self.lengths[length]
        if length == self.longest:
            self.longest = max(self.lengths, default=0.0)

    def full(self, batch_size: int, max_batch_cost: float | None) -> bool:
        """Whether it holds a batch: batch_size items, or max_batch_cost padded tokens."""
        return self.count >= batch_size or (max_batch_cost is not None and self.count * self.longest >= max_batch_cost)
