"""Backends: what runs the prompts behind the batch API, the job runner and the server.

`get_backend` picks one: the process's local engine for a model id/path (the default), a
backend object as it is, or whatever a provider builds (an `EndpointPool`, a `RayCluster`:
any object with `as_backend(model, device=, dtype=, engine_options=)`).
"""
from __future__ import annotations

from typing import Any

from .base import BULK, INTERACTIVE, Backend, Item, Source

__all__ = ["BULK", "INTERACTIVE", "Backend", "Item", "Source", "get_backend"]


def get_backend(model: Any = None, *, cluster: Any = None, device: str = "auto", dtype: str = "auto",
                engine_options: dict | None = None) -> Backend:
    """The backend for `model` (None: the embedded model; an id or path; an LLMEngine; a
    backend; or a provider such as an EndpointPool), run on `cluster` when one is given
    (e.g. a RayCluster: replicas of `model`)."""
    local = dict(device=device, dtype=dtype, engine_options=engine_options)
    if cluster is not None:
        if not hasattr(cluster, "as_backend"):
            raise TypeError(f"cluster must be a cluster object such as bp.RayCluster(...), got "
                            f"{type(cluster).__name__}")
        return cluster.as_backend(model, **local)
    if hasattr(model, "as_backend"):
        return model.as_backend(None, **local)
    if isinstance(model, Backend) and not isinstance(model, (str, bytes)):
        return model
    from ..api.service import get_service
    return get_service(model, **local)
