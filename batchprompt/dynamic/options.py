"""The batcher's options and a call's `timeout`, checked before anything is queued: a wrong one is
one error naming the option and the fix, never a worker thread that dies on it later."""
from __future__ import annotations

import math
import numbers
from typing import Any

from ..units import wait_seconds
from .lengths import bucket_function


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _need_int(name: str, x: Any, low: int, hint: str = "") -> None:
    if not is_int(x) or x < low:
        raise ValueError(f"{name} must be an int >= {low}{hint}, got {x!r}")


def _need_positive(name: str, x: Any, hint: str) -> None:
    if not _is_number(x) or not math.isfinite(x) or not x > 0:
        raise ValueError(f"{name} must be a finite number > 0 ({hint}), got {x!r}")


def _need_callable(name: str, x: Any, hint: str) -> None:
    if x is not None and not callable(x):
        raise TypeError(f"{name} must be a function of an item ({hint}), got {type(x).__name__} {x!r}")


def _need_bool(name: str, x: Any) -> None:
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be True or False, got {x!r}")


def check_options(*, batch_size, timeout_ms, small_batch_threshold, max_queue, block_when_full, cost,
                  max_batch_cost, split_on_error, target_latency_ms, min_batch_size, length, buckets,
                  tensors=False, pad_token=None) -> None:
    """A ValueError (TypeError for a wrong kind of value) naming the option and the fix."""
    _need_int("batch_size", batch_size, 1)
    if not _is_number(timeout_ms) or not math.isfinite(timeout_ms) or timeout_ms < 0:
        raise ValueError(f"timeout_ms must be a finite number >= 0 (a batch closes that many milliseconds after "
                         f"its first item arrived, or sooner when it is full), got {timeout_ms!r}")
    _need_int("small_batch_threshold", small_batch_threshold, 0,
              " (calls of at most that many items go ahead of larger ones; 0 turns it off)")
    if max_queue is not None:
        _need_int("max_queue", max_queue, 1, " or None (no bound)")
    _need_bool("block_when_full", block_when_full)
    _need_bool("split_on_error", split_on_error)
    _need_bool("tensors", tensors)
    if pad_token is not None and not isinstance(pad_token, dict):
        raise TypeError(f"pad_token must be a dict of the padding value per key, e.g. {{'input_ids': 0}}, "
                        f"got {pad_token!r}")
    _need_callable("cost", cost, "its cost within max_batch_cost, e.g. cost=len")
    _need_callable("length", length, "its length in tokens, e.g. length=len")
    if max_batch_cost is not None:
        _need_positive("max_batch_cost", max_batch_cost, "the most cost a batch holds")
    if cost is not None and max_batch_cost is None:
        raise ValueError("give cost= and max_batch_cost= together")
    if max_batch_cost is not None and cost is None and length is None:
        raise ValueError("give cost= and max_batch_cost= together (or length= with max_batch_cost=, for a "
                         "budget of padded tokens)")
    if cost is not None and length is not None:
        raise ValueError("give cost= or length=, not both: with length=, max_batch_cost counts padded tokens "
                         "(batch size x longest length)")
    if target_latency_ms is not None:
        _need_positive("target_latency_ms", target_latency_ms, "the time a batch should take")
    if not is_int(min_batch_size) or not 1 <= min_batch_size <= batch_size:
        raise ValueError(f"min_batch_size must be between 1 and batch_size={batch_size} (an int), "
                         f"got {min_batch_size!r}")
    if buckets is not None and length is None and not (tensors or pad_token is not None):
        raise ValueError("buckets= groups items by length: give length= too (a function of an item, e.g. "
                         "length=len), or use the tensor variant (pad_token= or tensors=True), whose items have "
                         "their own lengths")
    bucket_function(buckets)  # checks the boundaries


def call_timeout(timeout: Any) -> float | None:
    """A call's `timeout` in seconds, checked before its items are queued; infinity is no limit."""
    return wait_seconds(timeout)
