"""How long PyTorch's OpenMP threads spin before they sleep: set here, before PyTorch loads
libgomp, which reads it once.

An engine step on the CPU is some 400 parallel regions with a few microseconds of Python between
them. A libgomp worker that sleeps between two regions costs about 40 microseconds to wake on a
virtual machine, about 15 ms a step; one that spins through the gap costs nothing. libgomp's
own choice is all or nothing: about 300,000 spins (milliseconds) while its threads do not
outnumber the CPUs, which is fast on a machine left to the engine and many times slower as soon
as another process wants a CPU (the spinning worker keeps it from the thread everyone waits
for), and 100 spins (about a microsecond, every gap ends in a sleep) once they do.

GOMP_SPINCOUNT=1000 is between the two, measured on a 2-core machine with 64 prompts in flight:
about as fast as the long spin when the machine is the engine's (61 against 62 prompts/s; 52
with 100 spins), and 10% slower than 100 spins when another process keeps one core busy, where
the long spin is 45% slower (29, 32 and 18 prompts/s). See device.py for how the engine keeps
its threads within the CPUs, where this count applies.

It is set only where libgomp is not loaded yet (batchprompt imported before torch), on Linux,
and where the user set neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT: their choice stands.
Processes started from this one inherit it. This module imports nothing heavy.
"""
from __future__ import annotations

import os
import sys
from typing import MutableMapping

SPIN_COUNT = 1000
WAIT_POLICY_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def libgomp_loaded(maps_path: str = "/proc/self/maps") -> bool:
    """Whether libgomp is mapped into this process already (then it has read its settings).
    True where that cannot be told."""
    try:
        with open(maps_path, encoding="utf-8", errors="replace") as f:
            return any("libgomp" in line for line in f)
    except OSError:
        return True


def bound_spin(environ: MutableMapping[str, str] = os.environ, platform: str = sys.platform,
               loaded: bool | None = None) -> bool:
    """Set GOMP_SPINCOUNT=SPIN_COUNT in `environ` where it still takes effect and the user chose
    nothing; returns whether it did."""
    if not platform.startswith("linux") or any(environ.get(v) for v in WAIT_POLICY_VARIABLES):
        return False
    if libgomp_loaded() if loaded is None else loaded:
        return False
    environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    return True


bound_spin()
