"""SIGTERM (what schedulers and `docker stop` send) stops a job the way Ctrl-C does: the rows
finished so far are committed to the journal and the command says how to resume."""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator


class Terminated(KeyboardInterrupt):
    """Raised in the main thread on SIGTERM; caught wherever Ctrl-C is."""

    signum = signal.SIGTERM


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While inside, the first SIGTERM raises Terminated; later ones are ignored, so that the
    journal commit that follows the first is not cut short (SIGKILL still ends the process)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = False

    def handler(signum, frame):
        nonlocal fired
        if not fired:
            fired = True
            raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
