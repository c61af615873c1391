"""batchprompt: run a language model over many independent prompts, fast and safely."""
from .engine import EngineConfig, EngineStats, LLMEngine, RequestOutput, SamplingParams
from .models import ModelNotFoundError

__version__ = "0.1.0"
__all__ = ["EngineConfig", "EngineStats", "LLMEngine", "ModelNotFoundError", "RequestOutput",
           "SamplingParams"]
