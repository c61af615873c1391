"""Transfers that a shutdown ends: a request whose body is still arriving (a slow upload), or an
answer still being sent (a big file to a slow reader).

The shutdown cancels what waits on the engine at once (state.py); these wait on a client. They
held the exit for uvicorn's graceful timeout (30 s), then got a bare text 500 and a traceback
in the log. Now, once the shutdown begins, a body still arriving after GRACE_S, an answer still
being sent after LATE_S, or either blocked on its client for GRACE_S, is cut: a request whose
answer has not begun gets the 503 `shutting_down` in OpenAI's shape, an answer under way ends
where it is (its client sees the connection close)."""
from __future__ import annotations

import asyncio
import json
import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_body

#: How long a transfer may stay blocked on its client once the shutdown has begun, and how long
#: a body may go on arriving (a steady slow upload is never blocked for long).
GRACE_S = 1.0
#: How long an answer may go on being sent after the shutdown began (a slow steady reader): more
#: than the 5 s the shutdown gives a request's cancel in the engine, whose 503 or error event
#: must get out.
LATE_S = 8.0


class Transfer:
    __slots__ = ("task", "blocked_since", "body_done", "started", "finished", "cut")

    def __init__(self, task: asyncio.Task | None):
        self.task = task
        self.blocked_since: float | None = None  # waiting on the client: its body, or room to send
        self.body_done = False  # the request's body is whole: later receives watch for a disconnect
        self.started = False  # the answer's start was sent
        self.finished = False  # and its last byte
        self.cut = False  # cancelled by the shutdown (not by its client or the server's own stop)


class Transfers:
    """The open transfers, and their cut once the shutdown begins (`cut_blocked`)."""

    def __init__(self) -> None:
        self.open: set[Transfer] = set()
        self._cutting: asyncio.Task | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        """uvicorn's "ASGI callable returned without completing response" for an answer the
        shutdown cut on purpose: left out of the log (an error line that was only noise)."""
        return not (self._cutting is not None and record.getMessage().startswith("ASGI callable returned without"))

    def cut_blocked(self) -> None:
        """On the event loop, at the shutdown: cut each transfer that stays blocked on its client
        for GRACE_S, until none is open."""
        if self._cutting is None and self.open:
            self._cutting = asyncio.ensure_future(self._cut_loop())

    async def _cut_loop(self) -> None:
        began = time.monotonic()
        while self.open:
            await asyncio.sleep(GRACE_S / 4)
            now = time.monotonic()
            for t in list(self.open):
                if t.cut or t.task is None or t.finished:
                    continue
                stalled = t.blocked_since is not None and now - t.blocked_since >= GRACE_S
                receiving = not t.body_done and now - began >= GRACE_S
                sending = t.started and now - began >= LATE_S
                if stalled or receiving or sending:
                    t.cut = True
                    t.task.cancel()


class EndOnShutdown:
    """ASGI middleware that registers each request's transfers in `transfers` (see module)."""

    def __init__(self, app: ASGIApp, transfers: Transfers, message: str):
        self.app, self.transfers, self.message = app, transfers, message
        logging.getLogger("uvicorn.error").addFilter(transfers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t = Transfer(asyncio.current_task())
        headers = dict(scope["headers"])
        t.body_done = headers.get(b"content-length", b"0") == b"0" and b"transfer-encoding" not in headers

        async def receive_body() -> Message:
            if t.body_done:  # a watch for the client's disconnect: not a transfer
                return await receive()
            t.blocked_since = time.monotonic()
            try:
                message = await receive()
            finally:
                t.blocked_since = None
            if message["type"] != "http.request" or not message.get("more_body", False):
                t.body_done = True
            return message

        async def send_answer(message: Message) -> None:
            if message["type"] == "http.response.start":
                t.started = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                t.finished = True
            t.blocked_since = time.monotonic()
            try:
                await send(message)
            finally:
                t.blocked_since = None

        self.transfers.open.add(t)
        try:
            await self.app(scope, receive_body, send_answer)
        except asyncio.CancelledError:
            if not t.cut:
                raise
            uncancel = getattr(t.task, "uncancel", None)  # Python 3.11+: the cancel is handled here
            if uncancel is not None:
                uncancel()
            if not t.started:
                body = json.dumps(error_body(503, self.message, "shutting_down")).encode()
                await send({"type": "http.response.start", "status": 503,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
                await send({"type": "http.response.body", "body": body})
        finally:
            self.transfers.open.discard(t)
