"""openmp_spin: GOMP_SPINCOUNT set before PyTorch loads libgomp, and only then, and never over
the user's own choice."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchprompt.openmp_spin import SPIN_COUNT, bound_spin, libgomp_loaded

ROOT = Path(__file__).resolve().parents[1]


def test_set_where_it_still_takes_effect_and_nobody_chose():
    env: dict[str, str] = {}
    assert bound_spin(env, "linux", loaded=False)
    assert env == {"GOMP_SPINCOUNT": str(SPIN_COUNT)}


@pytest.mark.parametrize("env, platform, loaded", [
    ({"OMP_WAIT_POLICY": "PASSIVE"}, "linux", False),
    ({"GOMP_SPINCOUNT": "0"}, "linux", False),
    ({}, "linux", True),  # libgomp read its settings already: setting it now would claim what is not so
    ({}, "darwin", False),  # no libgomp there
], ids=["OMP_WAIT_POLICY set", "GOMP_SPINCOUNT set", "libgomp loaded", "not Linux"])
def test_left_alone(env, platform, loaded):
    before = dict(env)
    assert not bound_spin(env, platform, loaded=loaded)
    assert env == before


def test_libgomp_loaded_reads_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/libc.so.6\n")
    assert not libgomp_loaded(str(maps))
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /venv/lib/torch/lib/libgomp.so.1\n")
    assert libgomp_loaded(str(maps))
    assert libgomp_loaded(str(tmp_path / "missing"))  # cannot tell: as if loaded


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp: Linux")
@pytest.mark.parametrize("first, expected", [("batchprompt", str(SPIN_COUNT)), ("torch", None)],
                         ids=["batchprompt imported first", "torch imported first"])
def test_in_a_fresh_interpreter(first, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = f"import os, {first}, batchprompt; print(os.environ.get('GOMP_SPINCOUNT'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(expected)
