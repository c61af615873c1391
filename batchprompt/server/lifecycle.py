"""The uvicorn server, stopped the way a service should be: a signal is how it is asked to
stop, not a failure, so the process exits 0 (uvicorn re-raises the signal after its shutdown,
which makes the exit status 130 or 143), and requests in flight are cancelled at once rather
than waited for (a long generation would otherwise hold the shutdown). Whatever else holds
it, the process is gone SHUTDOWN_LIMIT_S after the signal: a stuck stop must not need kill -9."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading

import uvicorn

from .state import ServerState
from .transfers import GRACE_S

SIGNALS = (signal.SIGINT, signal.SIGTERM)

#: After a stop signal, the longest the process lives. Each step of a stop is bounded on its own
#: (the requests' cancel, the batches' commit, the engine thread); this is the last resort.
SHUTDOWN_LIMIT_S = 90.0

log = logging.getLogger("batchprompt")


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self.hurried = False  # a second Ctrl-C came: nothing waits for the engine any more

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets=None) -> None:
        aborter = asyncio.ensure_future(self._abort_unflushed())
        try:
            await super().shutdown(sockets)
        finally:
            aborter.cancel()

    async def _abort_unflushed(self) -> None:
        """A connection whose answer the shutdown cut (transfers.py) is closed by uvicorn, and a
        close waits for its unsent bytes: a client that does not read held the exit for uvicorn's
        graceful timeout (30 s). Such connections, closing already, are aborted."""
        await asyncio.sleep(GRACE_S * 2)
        while True:
            for connection in list(self.server_state.connections):
                transport = getattr(connection, "transport", None)
                if transport is not None and transport.is_closing():
                    transport.abort()
            await asyncio.sleep(GRACE_S / 2)

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            if self.hurried:  # a third: uvicorn's force quit (a request still waiting gets no answer)
                self.force_exit = True
            else:
                # A second: every request still waiting answers 503 now, without waiting for the
                # engine's step, and the app's shutdown still runs (uvicorn's force quit, which
                # this was, skipped it and cut the requests in flight off with a 500).
                self.hurried = True
                log.warning("second Ctrl-C: requests in flight are answered now, without waiting for the engine "
                            "(Ctrl-C again to quit at once)")
                self.state.abandon_threadsafe()
        if not self.should_exit:
            threading.Thread(target=_exit_after, args=(SHUTDOWN_LIMIT_S,), name="batchprompt-stop-limit",
                             daemon=True).start()
        self.should_exit = True
        self.state.begin_shutdown_threadsafe()


def _exit_after(seconds: float) -> None:
    threading.Event().wait(seconds)
    log.error("the server did not stop within %.0fs of the signal: exiting now (finished work is "
              "journaled; unfinished batches resume at the next start)", seconds)
    logging.shutdown()
    os._exit(1)
