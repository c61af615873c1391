"""ASGI middleware: request metrics, the API key, the body size limit. Plain ASGI (not
BaseHTTPMiddleware), so that streamed responses pass through untouched and a client's
disconnect still reaches the route."""
from __future__ import annotations

import hmac
import json
import time
import uuid

from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import ApiError, error_body
from .metrics import Metrics


async def _send_error(send: Send, status: int, message: str, code: str, headers: list | None = None) -> None:
    body = json.dumps(error_body(status, message, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class RecordMetrics:
    """Count each request by route (the route's path template, not the URL: ids do not become
    labels), method and status, and time it to its last byte (a stream's too). A request
    answered before it reached its route (a 401, a 413) counts under the route its path
    matches; "unmatched" is left for paths no route serves. Every answer carries an
    `X-Request-Id` header, as OpenAI's and vLLM's do: the client's own, else a new one."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: list | None = None):
        self.app, self.metrics, self.routes = app, metrics, routes or []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # if the app fails before it answers
        t0 = time.perf_counter()
        given = client_request_id(dict(scope["headers"]).get(b"x-request-id"))  # the last, if sent twice
        scope.setdefault("state", {})["client_request_id"] = given  # the answer's id takes it (request.state)
        request_id = given.encode() if given is not None else uuid.uuid4().hex.encode()

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", None) or self._route_of(scope) or "unmatched"
            self.metrics.observe(route, scope["method"], status, time.perf_counter() - t0)

    def _route_of(self, scope: Scope) -> str | None:
        for route in self.routes:
            match, _ = route.matches(scope)
            if match != Match.NONE and getattr(route, "path", None):
                return route.path
        return None


def client_request_id(given: bytes | str | None) -> str | None:
    """A request id a client gave (the X-Request-Id header, vLLM's body field request_id) when
    it is a short printable token (1 to 128 of ASCII's 33 to 126), else None."""
    raw = given.encode("utf-8", "replace") if isinstance(given, str) else given
    if isinstance(raw, bytes) and raw and len(raw) <= 128 and all(33 <= c < 127 for c in raw):
        return raw.decode()
    return None


class RequireApiKey:
    """Every /v1 route needs `Authorization: Bearer KEY`; /health, /ready and /metrics do not."""

    def __init__(self, app: ASGIApp, api_key: str | None):
        self.app = app
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key is None or scope["type"] != "http" or not _is_api(scope["path"]):
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            await self.app(scope, receive, send)
            return
        if not given:
            message = "missing API key: send the header Authorization: Bearer <key> (the server's --api-key)"
        elif scheme.lower() != b"bearer" or not token.strip():  # a bare key, or Basic: the key was not judged
            message = "the Authorization header must read Bearer <key> (the server's --api-key)"
        else:
            message = "incorrect API key (the server's --api-key or $BATCHPROMPT_API_KEY)"
        await _send_error(send, 401, message, "invalid_api_key", [(b"www-authenticate", b"Bearer")])


def _is_api(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


UPLOAD_FRAMING_BYTES = 64 * 1024  # room for an upload's multipart framing beside the file


class LimitBody:
    """Refuse bodies above `limit` bytes with 413: at once from Content-Length, or while the
    body is read (a chunked upload), from the route's read of it. `uploads`: paths that take
    POSTed files, with the largest file each takes (the route checks the file itself)."""

    def __init__(self, app: ASGIApp, limit: int, uploads: dict[str, int] | None = None):
        self.app, self.limit, self.uploads = app, limit, uploads or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        file_limit = self.uploads.get(scope["path"]) if scope["method"] == "POST" else None
        limit = self.limit if file_limit is None else file_limit + UPLOAD_FRAMING_BYTES
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _send_error(send, 413, self._message(int(declared), limit), "request_too_large")
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise ApiError(413, self._message(seen, limit, more=True), "request_too_large")
            return message

        await self.app(scope, counted, send)

    def _message(self, size: int, limit: int, more: bool = False) -> str:
        if limit != self.limit:
            return (f"the upload is {'more than ' if more else ''}{size:,} bytes; this server takes files of at most "
                    f"{limit - UPLOAD_FRAMING_BYTES:,} bytes (its --max-file-bytes): split the requests into "
                    f"several batches")
        return (f"the body is {'more than ' if more else ''}{size:,} bytes; this server takes at most "
                f"{limit:,} (its --max-body-bytes): send a shorter request (fewer or shorter prompts or "
                f"messages), or use the Batch API's file upload for many")
