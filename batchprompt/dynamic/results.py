"""An item's slot in a group's results: its value, or its error (`Failure`, or an exception the
function put in the slot itself)."""
from __future__ import annotations

from typing import Any


class Failure:
    """An item's error, in its result slot."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


def value(r: Any) -> Any:
    """One item's result, or its error raised."""
    if type(r) is Failure:
        raise r.error
    if isinstance(r, BaseException):  # the function put it in the item's slot
        raise r
    return r


def unwrap(results: list, start: int = 0, stop: int | None = None) -> list:
    """A caller's results; raises the first error among its items."""
    out = results[start:stop]
    for r in out:
        value(r)
    return out
