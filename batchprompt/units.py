"""Memory sizes as people write them: 4GiB, 512MB, 1.5G, plain bytes, or a share of free memory;
and a wait's timeout in seconds."""
from __future__ import annotations

import math
import numbers
import re
import threading
from decimal import Decimal
from typing import Any

# K, M, G, T alone are binary, as in `free -g`, Docker and Java's -Xmx; KB, MB, GB, TB are
# decimal (SI); KiB, Ki and the like are binary (IEC, Kubernetes).
_UNITS = {"b": 1}
for _power, _letter in enumerate("kmgt", start=1):
    _UNITS.update({_letter: 1024 ** _power, _letter + "i": 1024 ** _power, _letter + "ib": 1024 ** _power,
                   _letter + "b": 1000 ** _power})

_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*|%)")

FORMS = ("bytes with a unit (4GiB, 512MB, 1.5G), plain bytes (4294967296), or a share of free "
         "memory (0.3 or 30%)")


def parse_memory(text: str, max_fraction: float = 1.0) -> tuple[int | None, float | None]:
    """(bytes, None) or (None, fraction of free memory). A number up to 1, or a percentage, is a
    fraction (at most `max_fraction`); a number with a unit, or a whole number above 1, is bytes.
    Raises ValueError naming `text` and what to give instead."""
    m = _SIZE.fullmatch(text.strip().lower())
    if m is None:
        raise ValueError(f"{text!r} is not a memory size; give {FORMS}")
    number, unit = Decimal(m.group(1)), m.group(2)
    if unit == "%" or (unit == "" and number <= 1):
        fraction = number / 100 if unit == "%" else number
        if not 0 < fraction <= Decimal(str(max_fraction)):
            raise ValueError(f"{text!r} reads as a share of free memory (a number up to 1, or a "
                             f"percentage), which must be above 0 and at most {max_fraction:.0%}; "
                             f"for bytes give a unit, as in 512MB")
        return None, float(fraction)
    if unit == "" and number != number.to_integral_value():
        raise ValueError(f"{text!r}: plain bytes are a whole number; for a share of free memory give "
                         f"a number up to 1 or a percentage (0.3 or 30%)")
    if unit and unit not in _UNITS:
        raise ValueError(f"{text!r}: unknown unit {unit!r}; give {FORMS}")
    size = int(number * _UNITS.get(unit, 1))
    if size < 1:
        raise ValueError(f"{text!r} is less than one byte; give a positive size, as in 512MB")
    return size, None


def format_bytes(n: int) -> str:
    """`n` bytes for a person: 512 B, 64 MiB, 1.5 GiB."""
    if n < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.1f}".removesuffix(".0") + f" {unit}"
        value /= 1024
    return f"{value:,.1f}".removesuffix(".0") + " TiB"


def wait_seconds(timeout: Any) -> float | None:
    """A wait's `timeout` in seconds, checked before anything waits (None: no limit). Infinity,
    or more than a lock can wait, is no limit (it raised OverflowError from inside the wait)."""
    if timeout is None:
        return None
    if not isinstance(timeout, numbers.Real) or isinstance(timeout, bool) or math.isnan(timeout) or timeout < 0:
        raise ValueError(f"timeout must be a number of seconds >= 0, or None for no limit; got {timeout!r}")
    return None if timeout > threading.TIMEOUT_MAX else float(timeout)
