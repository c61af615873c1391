"""Hand-written CPU kernels, compiled on first use for the machine that runs them."""
from .build import compiled_module, kernels_enabled
from .ops import CompiledOps

__all__ = ["CompiledOps", "compiled_module", "kernels_enabled"]
