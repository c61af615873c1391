"""What can go wrong talking to an endpoint, sorted by whose fault it is.

The kind decides what the pool does: the endpoint's faults (it is down, or a gateway in front
of it says its server is (502/504), it is slow, overloaded, refuses our key, does not serve the
model) move the work to another endpoint; the request's
faults (a 4xx naming a prompt, a 5xx, an answer that does not parse) split the sub-batch so
that one bad prompt fails alone."""
from __future__ import annotations

#: Kinds that say something about the endpoint, not the prompts: the work goes elsewhere.
ENDPOINT_KINDS = ("connection", "gateway", "timeout", "overloaded", "auth", "model")
#: Kinds that may be one prompt's fault: the sub-batch is split and retried.
REQUEST_KINDS = ("request", "server")


class PoolError(RuntimeError):
    """The pool cannot start or go on (no endpoint answers, a model nobody serves)."""


class EndpointError(Exception):
    def __init__(self, kind: str, message: str, status: int | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.kind, self.message, self.status, self.retry_after = kind, message, status, retry_after

    @property
    def endpoint_fault(self) -> bool:
        return self.kind in ENDPOINT_KINDS

    def __str__(self) -> str:
        return self.message
