"""Batched functions that call each other from inside their batches: which batcher's worker
waits on which, so that a call that would close a circle (a -> b -> a) is an error at once
instead of two batchers waiting on each other for ever (each dead from then on)."""
from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager
from typing import Any, Iterator

_lock = threading.Lock()
_waits: dict[Any, Counter] = {}  # a processor -> the processors its workers now wait on (counted)


def _reaches(start: Any, goal: Any) -> bool:
    """Whether `start`'s workers wait, directly or through others, on `goal`."""
    seen, todo = set(), [start]
    while todo:
        p = todo.pop()
        if p is goal:
            return True
        if id(p) not in seen:
            seen.add(id(p))
            todo.extend(_waits.get(p, ()))
    return False


def check(caller: Any, callee: Any, fn_name: str) -> None:
    """RuntimeError if `caller`'s worker may not wait on `callee`: `callee` is `caller`, or
    waits on it already."""
    with _lock:
        _check(caller, callee, fn_name)


def _check(caller: Any, callee: Any, fn_name: str) -> None:
    if callee is caller:
        raise RuntimeError(f"{callee.name} was called from inside its own batch: that call would wait for "
                           f"a batch that cannot start until this one ends. Inside it, call the function itself "
                           f"on a list ({fn_name}.__wrapped__(items)), or another batched function")
    if _reaches(callee, caller):
        raise RuntimeError(f"{callee.name} was called from inside {caller.name}'s batch, while {callee.name}'s "
                           f"own batch waits (directly or through other batched functions) on {caller.name}: "
                           f"each would wait for the other for ever. Call the function itself on a list "
                           f"({fn_name}.__wrapped__(items)) on one side of the circle")


@contextmanager
def waiting(caller: Any, callee: Any, fn_name: str) -> Iterator[None]:
    """`caller`'s worker waits on `callee` within the block (after `check`)."""
    with _lock:
        _check(caller, callee, fn_name)
        _waits.setdefault(caller, Counter())[callee] += 1
    try:
        yield
    finally:
        with _lock:
            counts = _waits[caller]
            counts[callee] -= 1
            if counts[callee] <= 0:
                del counts[callee]
            if not counts:
                del _waits[caller]
