from .config import EngineConfig
from .engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams
from .stats import EngineStats

__all__ = ["EngineConfig", "EngineStats", "LLMEngine", "RequestOutput", "SamplingParams"]
