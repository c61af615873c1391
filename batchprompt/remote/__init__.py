"""A pool of remote OpenAI-compatible endpoints (vLLM, SGLang, `batchprompt serve`) run as one
model, behind the same API as the local engine: `bp.EndpointPool(...)`, then
`LanguageModel.create(model=pool)`, `batch_prompt(..., model=pool)`, `batchprompt run
--endpoints HOSTFILE`, or aurora_swarm's async methods and patterns (swarm.py)."""
from __future__ import annotations

from .backend import RemoteBackend
from .errors import EndpointError, PoolError
from .hostfile import EndpointSpec, HostfileError, parse_endpoint, parse_hostfile
from .pool import EndpointPool
from .swarm import Response, map_gather, scatter_gather, tree_reduce

__all__ = ["EndpointError", "EndpointPool", "EndpointSpec", "HostfileError", "PoolError", "RemoteBackend", "Response",
           "map_gather", "parse_endpoint", "parse_hostfile", "scatter_gather", "tree_reduce"]
