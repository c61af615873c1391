"""Pick a device and dtype: CUDA when present, bfloat16 where the hardware supports it; set up
the thread that steps an engine."""
from __future__ import annotations

import ctypes
import os
import sys
import threading

import torch

from .openmp_spin import WAIT_POLICY_VARIABLES

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
           "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "float": torch.float32}  # vLLM's names too


# PyTorch's own words are "Cannot re-initialize CUDA in forked subprocess", raised from the
# first step, which ran only after the model had loaded.
FORKED_CUDA = ("this process was forked from one that used CUDA, and CUDA cannot run in a forked child: start "
               "the child with multiprocessing's 'spawn' (multiprocessing.get_context('spawn')), or give "
               "device='cpu' in the child")


def check_not_forked_from_cuda(device: torch.device) -> None:
    """RuntimeError (FORKED_CUDA) where `device` is CUDA and this is a forked child of a CUDA process."""
    if device.type == "cuda" and torch.cuda._is_in_bad_fork():
        raise RuntimeError(FORKED_CUDA)


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        check_not_forked_from_cuda(dev)  # not CPU in its stead: the child would run many times slower, unsaid
        return dev
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {device!r}; use 'auto', 'cpu', 'cuda' or 'cuda:N'") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {str(device)!r} is not supported; use 'auto', 'cpu', 'cuda' or 'cuda:N'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} asked for, but no CUDA GPU is visible; use device='cpu'")
    check_not_forked_from_cuda(dev)
    return dev


def bf16_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    check_dtype(dtype)
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if bf16_supported(device) else torch.float32
    return _DTYPES[dtype]


def check_dtype(dtype: str | torch.dtype) -> None:
    """A dtype the engine can compute in, before any weights are read."""
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype {dtype} is not a floating-point type; use one of: auto, "
                             f"{', '.join(sorted(_DTYPES))}")
    elif dtype != "auto" and dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of: auto, {', '.join(sorted(_DTYPES))}")


def available_memory(device: torch.device) -> int:
    """Bytes free now on the device (host RAM for the CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


# ---- the thread that steps an engine ------------------------------------------------------------
# How the engine's OpenMP threads wait. PyTorch's CPU ops run on libgomp, where every thread
# that enters a parallel region owns a team of its own (the intra-op count less one worker
# threads) until that thread ends. A thread that waits (a worker between regions, or one at a
# region's closing barrier) spins for GOMP_SPINCOUNT iterations before it sleeps (about 300,000,
# milliseconds, unless set), but for only about 100 while the process's OpenMP threads outnumber
# the CPUs. A step is hundreds of regions with Python between them, so which of the two applies
# decides how fast an engine runs (see openmp_spin.py for the figures):
# - where batchprompt was imported before torch, openmp_spin set a spin of 1,000, fast when the
#   machine is the engine's and safe when it is not. The engine is built and stepped on its own
#   thread (EngineService), so its team is the process's only one and gets that spin, unless
#   other threads run parallel ops too (then every team gets the short spin, as below).
# - where torch came first and the user chose nothing, the long spin is in force: an engine
#   whose team is the process's only one ran 7 to 30 times slower on a busy 2-core machine (its
#   workers spin, and each region waits at its end for a thread the OS put off in favour of a
#   spinning one). An idle team held for the life of the process makes the short wait the rule
#   there.
# - where the user set OMP_WAIT_POLICY or GOMP_SPINCOUNT, their choice stands: no idle team.
# Setting the environment from here would not do: libgomp reads it once, when `import torch`
# loads it, which happened before this module (it imports torch).
IDLE_TEAM_THREAD_NAME = "bp-omp-idle"  # the OS name of the idle team's threads (15 bytes at most)
ENGINE_THREAD_NAME = "bp-engine"  # ... and of the engine thread and its OpenMP workers
_idle_team: threading.Thread | None = None
_idle_team_lock = threading.Lock()


def prepare_engine_thread() -> None:
    """Call first on a thread that will step an engine (the service's engine thread), before
    it runs any op. Names the thread (its OpenMP workers inherit the name: `top -H` and py-spy
    show the engine's threads as bp-engine) and, where libgomp's long spin is in force, makes
    sure that an idle OpenMP team is held for the life of the process, so that the engine's
    threads wait briefly (see the note above). Never raises."""
    set_os_thread_name(ENGINE_THREAD_NAME)
    hold_idle_openmp_team()


def hold_idle_openmp_team(timeout: float = 10.0) -> bool:
    """Start, once per process, a thread that opens one parallel region and then waits for
    ever, so its team (as many threads as the intra-op count, all asleep) stays. Returns
    whether one is held. None is made with one intra-op thread (no team, nothing waits), where
    the user set OMP_WAIT_POLICY or GOMP_SPINCOUNT (their choice of waiting stands), or where
    openmp_spin set GOMP_SPINCOUNT (a bounded spin, which the engine's team is to keep)."""
    global _idle_team
    with _idle_team_lock:
        if _idle_team is None or not _idle_team.is_alive():  # not alive: the process forked
            if torch.get_num_threads() < 2 or any(os.environ.get(v) for v in WAIT_POLICY_VARIABLES):
                return False
            ready = threading.Event()
            _idle_team = threading.Thread(target=_hold_team, args=(ready,), name="batchprompt-openmp-idle",
                                          daemon=True)
            _idle_team.start()
            ready.wait(timeout)  # bounded: the engine thread never hangs on this
    return True


def _hold_team(ready: threading.Event) -> None:
    set_os_thread_name(IDLE_TEAM_THREAD_NAME)
    try:
        # Over ATen's grain of 32,768 elements, so the fill runs as one parallel region.
        torch.zeros(1 << 16)
    finally:
        ready.set()
    threading.Event().wait()  # never set: the team lives as long as the process


def set_os_thread_name(name: str) -> None:
    """Give the calling thread an OS-level name (Linux only, 15 bytes at most); threads it
    starts from now on, OpenMP workers among them, inherit it."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME
    except (OSError, AttributeError):  # no prctl in this C library: the name is only a help
        pass
