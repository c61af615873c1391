"""The batch service: an OpenAI-compatible HTTP server over the batch API (`batchprompt serve`).

The server is a client of the API (sessions, batches, the process's engine service) and of the
job reader's request rules; nothing under it knows about blocks or steps."""
from __future__ import annotations

__all__ = ["ServerConfig", "create_app"]


def __getattr__(name: str):
    # Lazy: `batchprompt`'s command line imports server.command for its parser, and should not
    # pay for FastAPI unless it serves.
    if name == "create_app":
        from .app import create_app
        return create_app
    if name == "ServerConfig":
        from .config import ServerConfig
        return ServerConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
