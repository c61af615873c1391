"""`python -m batchprompt.kernels`: build the CPU kernels now (make install does)."""
import logging
import os
import sys
import time

import torch

from .build import compiled_module

os.environ.setdefault("BATCHPROMPT_KERNELS_VERBOSE", "1" if "-v" in sys.argv else "0")
logging.basicConfig(level=logging.WARNING, format="batchprompt: %(levelname)s: %(message)s")
t0 = time.perf_counter()
if compiled_module(torch.device("cpu")) is None:
    print("batchprompt: CPU kernels not built; the engine will use PyTorch's ops (add -v to see the build)")
    sys.exit(0)
print(f"batchprompt: CPU kernels ready ({time.perf_counter() - t0:.0f} s)")
