"""Build and load the C++ kernels with PyTorch's extension builder.

The sources are compiled once per CPU (`-march=native`: the kernels use the CPU's own
vector units) into PyTorch's extension cache, ~/.cache/torch_extensions, under a name that
holds the sources, flags, compiler and CPU (`extension_name`), and loaded from there
afterwards. `make install` builds them ahead of time (`python -m batchprompt.kernels`).
Where no compiler is found or the build fails, on a GPU, or with BATCHPROMPT_KERNELS=0, the
engine runs its pure-PyTorch attention and layer steps and says so once in the log; results
are the same, only slower.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

import torch

log = logging.getLogger("batchprompt")

_SOURCES = [Path(__file__).with_name(n) for n in ("bindings.cpp", "paged_decode.cpp", "fused_ops.cpp")]
_HEADERS = [Path(__file__).with_name("vec.h")]
_NAME = "batchprompt_kernels"
LOCK_SAID_AFTER_S = 3.0  # a wait for the build lock this long is said (a build, not the quick check)
# -fno-trapping-math: no kernel reads floating-point exception flags, and without it GCC keeps
# the branches of a clamp, which stops loops from vectorizing (exp_poly in vec.h).
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-trapping-math")
# The /proc/cpuinfo fields that identify what `-march=native` compiles for (x86, then ARM).
_CPU_FIELDS = {"vendor_id", "cpu family", "model", "model name", "flags",
               "CPU implementer", "CPU architecture", "CPU variant", "CPU part", "Features"}
_lock = threading.Lock()
_module = None
_failed: str | None = None
_said: set[str] = set()  # the fallback reasons already logged
_said_lock = threading.Lock()


def kernels_enabled() -> bool:
    return os.environ.get("BATCHPROMPT_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def extension_name(sources: bytes, cflags: Sequence[str], compiler: str, cpu: str,
                   torch_version: str = torch.__version__, torch_dir: str = os.path.dirname(torch.__file__)) -> str:
    """The build's name in PyTorch's extension cache, which is keyed by name alone. It holds
    everything that decides the library's machine code: the sources, the flags, the compiler
    and the CPU that `-march=native` compiled for. A home directory shared by machines with
    different CPUs then keeps one build per CPU instead of loading another CPU's build, which
    dies with an illegal instruction (SIGILL) on the first kernel call. And the PyTorch install
    it builds against: two virtual environments with the same version wrote their own include
    paths into one build folder, so each rebuilt it (minutes, silent) after the other had."""
    h = hashlib.sha256()
    for part in (sources, "\0".join(cflags).encode(), compiler.encode(), cpu.encode(), torch_version.encode(),
                 torch_dir.encode()):
        h.update(hashlib.sha256(part).digest())
    return f"{_NAME}_{h.hexdigest()[:16]}"


def cpu_identity(cpuinfo: str | None = None) -> str:
    """The CPU as `-march=native` sees it: its model and its instruction-set flags, from the
    first processor in /proc/cpuinfo (x86 `flags`, ARM `Features`). Fields that change while
    it runs (clock speed, bogomips) are left out, so they never force a rebuild."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:  # not Linux: what the platform module knows
            return f"{platform.machine()} {platform.processor()}"
    fields = []
    for line in cpuinfo.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        if key.strip() in _CPU_FIELDS:
            fields.append(f"{key.strip()}={' '.join(value.split())}")
    return f"{platform.machine()} " + "; ".join(fields)


def compiler_version(cxx: str) -> str:
    """The first line of `cxx --version` (the compiler PyTorch's builder will run), or a marker
    when there is none: that build fails anyway, and says why."""
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{cxx}: unavailable ({type(e).__name__})"
    return f"{cxx}: {(out.stdout.strip().splitlines() or [''])[0]}"


def _build():
    from torch.utils.cpp_extension import load

    # The extension builder runs `ninja` from PATH; in a virtual environment that was not
    # activated, the one pip installed sits beside the interpreter.
    bindir = str(Path(sys.executable).parent)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    sources = b"".join(p.read_bytes() for p in _SOURCES + _HEADERS)
    # PyTorch's builder runs $CXX, else c++ (torch.utils.cpp_extension.get_cxx_compiler).
    compiler = compiler_version(os.environ.get("CXX", "c++"))
    name = extension_name(sources, _CFLAGS, compiler, cpu_identity())
    with _one_builder(name):
        return load(name=name, sources=[str(p) for p in _SOURCES], extra_cflags=list(_CFLAGS),
                    verbose=os.environ.get("BATCHPROMPT_KERNELS_VERBOSE") == "1")


def _take_turn(handle, folder: Path) -> None:
    """The lock: another process's build is waited for (it ends or dies), said once the wait
    lasts (every start holds it a moment, for the check that finds the build up to date)."""
    import fcntl

    start, said = time.monotonic(), False
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if not said and time.monotonic() - start > LOCK_SAID_AFTER_S:
                log.warning("waiting for another process's build of the CPU kernels (in %s)", folder)
                said = True
            time.sleep(0.05)


@contextlib.contextmanager
def _one_builder(name: str):
    """PyTorch's builder marks a build in progress with a `lock` file in the build folder (also
    for the quick check that finds the build up to date, on every start). A process killed then
    (kill -9, a timeout, a test's teardown) leaves the file behind, and every later process
    waited for it forever. An OS lock, which the system releases however its holder dies,
    makes our builds take turns; its holder knows that a `lock` file there is stale."""
    try:
        import fcntl
        from torch.utils.cpp_extension import _get_build_directory

        folder = Path(_get_build_directory(name, verbose=False))
        handle = open(folder / "batchprompt.flock", "a+")
    except Exception:  # noqa: BLE001  (not POSIX, or PyTorch moved it: its own lock alone)
        yield
        return
    with handle:
        _take_turn(handle, folder)
        if not any(folder.glob(f"{name}*.so")):
            log.warning("compiling the CPU kernels for this machine and PyTorch install (once; a minute or two)")
        try:
            stale = folder / "lock"
            if stale.exists():
                log.warning("removing %s, left by a build that was killed (it would make every start wait "
                            "forever)", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _load():
    global _module, _failed
    with _lock:
        if _module is None and _failed is None:
            try:
                _module = _build()
            except Exception as e:  # no compiler, no ninja, a failed build: fall back, once
                _failed = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
                log.warning("CPU kernels could not be built (%s); running PyTorch's attention and "
                            "layer ops instead (same results, slower). They need a C++ compiler and ninja; "
                            "`python -m batchprompt.kernels` shows the build's output.", _failed)
    return _module


def _say_once(reason: str, message: str, *args) -> None:
    """Log why the PyTorch ops run, once per process and reason (one engine or a hundred)."""
    with _said_lock:
        if reason in _said:
            return
        _said.add(reason)
    log.info(message, *args)


def compiled_module(device: torch.device):
    """The compiled kernels for `device`, or None where the PyTorch paths must be used (a GPU,
    kernels turned off, or no build possible). Each of those says so once in the log: a
    failed build as a warning, a GPU or BATCHPROMPT_KERNELS=0 (choices, not faults) as info."""
    if device.type != "cpu":
        _say_once(f"device:{device.type}", "running on %s: the engine uses PyTorch's kernels there "
                  "(FlashAttention where it serves; the compiled kernels are for the CPU)", device.type)
        return None
    if not kernels_enabled():
        _say_once("disabled", "BATCHPROMPT_KERNELS=%s: the compiled CPU kernels are off; running PyTorch's "
                  "attention and layer ops instead (same results, slower)", os.environ.get("BATCHPROMPT_KERNELS"))
        return None
    return _load()
