"""batchprompt: run a language model over many independent prompts, fast and safely."""
from . import openmp_spin  # noqa: F401  (first: it sets libgomp's spin before torch loads it)
from .api import (Batch, BatchError, EngineStoppedError, LanguageModel, Progress, Result,
                  SessionDestroyedError, Usage, abatch_prompt, batch_prompt, shutdown)
from .dynamic import BatchSizeMismatch, BatchStats, DeadlineExceeded, QueueFull, WorkerDied, dynamically
from .engine import EngineConfig, EngineStats, LLMEngine, RequestOutput, SamplingParams
from .models import ModelNotFoundError

__version__ = "0.1.0"
__all__ = ["Batch", "BatchError", "BatchSizeMismatch", "BatchStats", "DeadlineExceeded", "EngineConfig", "EngineStats",
           "EngineStoppedError", "LLMEngine", "LanguageModel", "ModelNotFoundError", "Progress", "QueueFull",
           "RequestOutput", "Result", "SamplingParams", "SessionDestroyedError", "Usage", "WorkerDied",
           "abatch_prompt", "batch_prompt", "dynamically", "shutdown"]

# Exported lazily: `import batchprompt` imports none of these optional parts (nor Ray).
_LAZY = {"RayCluster": "batchprompt.ray.cluster", "EndpointPool": "batchprompt.remote.pool"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'batchprompt' has no attribute {name!r}")
