"""Build and load the C++ kernels with PyTorch's extension builder.

The sources are compiled once per machine (`-march=native`: the kernels use the CPU's own
vector units) into PyTorch's extension cache, ~/.cache/torch_extensions, and loaded from
there afterwards. `make install` builds them ahead of time (`python -m batchprompt.kernels`).
Where no compiler is found or the build fails, the engine runs its pure-PyTorch attention
and layer steps and says so once in the log; results are the same, only slower. Set
BATCHPROMPT_KERNELS=0 to run without them.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
from pathlib import Path

import torch

log = logging.getLogger("batchprompt")

_SOURCES = [Path(__file__).with_name(n) for n in ("bindings.cpp", "paged_decode.cpp", "fused_ops.cpp")]
_HEADERS = [Path(__file__).with_name("vec.h")]
_NAME = "batchprompt_kernels"
_lock = threading.Lock()
_module = None
_failed: str | None = None


def kernels_enabled() -> bool:
    return os.environ.get("BATCHPROMPT_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def _build():
    from torch.utils.cpp_extension import load

    # The extension builder runs `ninja` from PATH; in a virtual environment that was not
    # activated, the one pip installed sits beside the interpreter.
    bindir = str(Path(sys.executable).parent)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    # Sources are part of the name, so an edited kernel is never confused with an old build.
    digest = hashlib.sha1(b"".join(p.read_bytes() for p in _SOURCES + _HEADERS)).hexdigest()[:10]
    return load(name=f"{_NAME}_{digest}", sources=[str(p) for p in _SOURCES],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                verbose=os.environ.get("BATCHPROMPT_KERNELS_VERBOSE") == "1")


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


def compiled_module(device: torch.device):
    """The compiled kernels for `device`, or None where the PyTorch paths must be used (a GPU,
    kernels turned off, or no build possible)."""
    if device.type != "cpu" or not kernels_enabled():
        return None
    return _load()
