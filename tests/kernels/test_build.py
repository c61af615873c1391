"""Which build is loaded, and what the log says when none is."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from batchprompt.kernels import build

CPUINFO = """processor	: 0
vendor_id	: GenuineIntel
model name	: Intel(R) Xeon(R) Platinum 8480+
cpu MHz		: {mhz}
flags		: fpu sse sse2 avx avx2 {extra}
bogomips	: {bogomips}

processor	: 1
vendor_id	: GenuineIntel
model name	: Intel(R) Xeon(R) Platinum 8480+
flags		: fpu sse sse2 avx avx2 something_else_entirely
"""
CFLAGS = ("-O3", "-march=native", "-fopenmp")
GCC = "c++: c++ (Debian 12.2.0-14) 12.2.0"


def cpu(extra="avx512f avx512_bf16", mhz="2600.0", bogomips="5200.00"):
    return build.cpu_identity(CPUINFO.format(extra=extra, mhz=mhz, bogomips=bogomips))


def test_cache_key_follows_the_cpu_the_flags_and_the_compiler():
    """A home shared by machines with different CPUs must not load another CPU's build."""
    key = build.extension_name(b"src", CFLAGS, GCC, cpu())
    assert key == build.extension_name(b"src", CFLAGS, GCC, cpu())  # stable: built once per CPU
    assert key.isidentifier()  # it becomes the Python module's name
    others = [
        build.extension_name(b"src", CFLAGS, GCC, cpu(extra="avx512f")),  # a CPU without bf16
        build.extension_name(b"src", ("-O2", "-march=native", "-fopenmp"), GCC, cpu()),
        build.extension_name(b"src", CFLAGS, "c++: c++ (Debian 13.1.0) 13.1.0", cpu()),
        build.extension_name(b"src2", CFLAGS, GCC, cpu()),
        build.extension_name(b"src", CFLAGS, GCC, cpu(), torch_version="0.0.1"),
        # another virtual environment's PyTorch of the same version: each rebuilt after the other
        build.extension_name(b"src", CFLAGS, GCC, cpu(), torch_dir="/elsewhere/.venv/lib/site-packages/torch"),
    ]
    assert len({key, *others}) == len(others) + 1


def test_cpu_identity_reads_model_and_flags_but_not_the_clock():
    assert "avx512_bf16" in cpu() and "Platinum 8480+" in cpu()
    assert cpu(mhz="3100.5", bogomips="6000.01") == cpu()  # changes while it runs: no rebuild
    assert "something_else_entirely" not in cpu()  # the first processor describes the CPU
    arm = build.cpu_identity("processor : 0\nCPU implementer : 0x41\nCPU part : 0xd40\nFeatures : fp asimd sve\n")
    assert "sve" in arm and "0xd40" in arm


def test_the_running_machine_has_an_identity():
    assert build.cpu_identity().strip()
    assert build.compiler_version("no-such-compiler-here").endswith("unavailable (FileNotFoundError)")


@pytest.fixture
def fresh_log(monkeypatch, caplog):
    """A process that has logged no fallback yet."""
    monkeypatch.setattr(build, "_said", set(), raising=False)
    caplog.set_level(logging.INFO, logger="batchprompt")
    return caplog


def _lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "batchprompt"]


def test_kernels_turned_off_say_so_once(monkeypatch, fresh_log):
    monkeypatch.setenv("BATCHPROMPT_KERNELS", "0")
    for _ in range(3):  # three engines in one process: one line
        assert build.compiled_module(torch.device("cpu")) is None
    lines = _lines(fresh_log)
    assert len(lines) == 1 and "BATCHPROMPT_KERNELS=0" in lines[0] and "PyTorch" in lines[0]


def test_a_gpu_device_says_so_once(fresh_log):
    """The decision needs only the device's type, so a CUDA device is simulated without a GPU."""
    for _ in range(3):
        assert build.compiled_module(torch.device("cuda")) is None
    lines = _lines(fresh_log)
    assert len(lines) == 1 and "cuda" in lines[0] and "PyTorch" in lines[0]


def test_a_failed_build_says_so_once_as_a_warning(monkeypatch, fresh_log):
    def no_compiler():
        raise RuntimeError("error: c++: command not found")

    monkeypatch.setenv("BATCHPROMPT_KERNELS", "1")
    monkeypatch.setattr(build, "_module", None)
    monkeypatch.setattr(build, "_failed", None)
    monkeypatch.setattr(build, "_build", no_compiler)
    for _ in range(3):
        assert build.compiled_module(torch.device("cpu")) is None
    records = [r for r in fresh_log.records if r.name == "batchprompt"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert "command not found" in records[0].getMessage()


@pytest.mark.slow
def test_a_lock_left_by_a_killed_build_does_not_stop_the_next_start(tmp_path):
    """PyTorch's builder leaves a `lock` file in the build folder when its process is killed at
    that moment (on every start it takes the lock to check the build): every later start then
    waited for it forever, the engine thread stuck in FileBaton.wait."""
    import os
    import shutil
    import subprocess
    import sys

    from torch.utils.cpp_extension import _get_build_directory

    name = build.extension_name(b"".join(p.read_bytes() for p in build._SOURCES + build._HEADERS), build._CFLAGS,
                                build.compiler_version(os.environ.get("CXX", "c++")), build.cpu_identity())
    built = Path(_get_build_directory(name, verbose=False))  # this machine's build (make install made it)
    ours = tmp_path / "py_cpu"
    if (built / f"{name}.so").exists():
        shutil.copytree(built, ours / name, ignore=shutil.ignore_patterns("lock", "*.flock"))
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ours)}
    code = "import sys; from batchprompt.kernels import build; sys.exit(build._load() is None)"
    subprocess.run([sys.executable, "-c", code], env=env, timeout=600, check=True)  # built (or found) here
    (ours / name / "lock").touch()  # what a build killed mid-way leaves
    done = subprocess.run([sys.executable, "-c", code], env=env, timeout=180, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert not (ours / name / "lock").exists()


def test_a_wait_for_the_build_lock_is_said_only_once_it_lasts(tmp_path, monkeypatch, caplog):
    """Every start holds the lock a moment (the check that finds the build up to date): starts
    that overlapped said "waiting for another process's build" where nothing was being built."""
    import fcntl
    import threading

    monkeypatch.setattr(build, "LOCK_SAID_AFTER_S", 0.3)
    lock = tmp_path / "batchprompt.flock"
    with caplog.at_level("WARNING", logger="batchprompt"):
        with open(lock, "a+") as mine, open(lock, "a+") as theirs:
            fcntl.flock(theirs, fcntl.LOCK_EX)
            threading.Timer(0.1, fcntl.flock, (theirs, fcntl.LOCK_UN)).start()  # a quick check's hold
            build._take_turn(mine, tmp_path)
            fcntl.flock(mine, fcntl.LOCK_UN)
        assert not [m for m in caplog.messages if "waiting for another process" in m], caplog.messages
        with open(lock, "a+") as mine, open(lock, "a+") as theirs:
            fcntl.flock(theirs, fcntl.LOCK_EX)
            threading.Timer(1.0, fcntl.flock, (theirs, fcntl.LOCK_UN)).start()  # a build's
            build._take_turn(mine, tmp_path)
    assert sum("waiting for another process's build of the CPU kernels" in m for m in caplog.messages) == 1
