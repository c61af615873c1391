from .config import ModelArgs
from .llama import LlamaModel
from .loader import (ModelNotFoundError, ModelSource, build_model, check_tokenizer_files, load_hf_weights,
                     resolve_model)
from .tokenizer import Tokenizer

__all__ = ["ModelArgs", "LlamaModel", "ModelNotFoundError", "ModelSource", "Tokenizer",
           "build_model", "check_tokenizer_files", "load_hf_weights", "resolve_model"]
