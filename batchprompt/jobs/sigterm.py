"""SIGTERM (what schedulers and `docker stop` send) stops a job the way Ctrl-C does: the rows
finished so far are committed to the journal and the command says how to resume. Only the
first of them counts: more, while the job stops, are ignored."""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator


class Terminated(KeyboardInterrupt):
    """Raised in the main thread on SIGTERM; caught wherever Ctrl-C is."""

    signum = signal.SIGTERM


@contextmanager
def sigterm_as_interrupt(hold_after: bool = False) -> Iterator[None]:
    """While inside, the first SIGTERM raises Terminated and the first Ctrl-C KeyboardInterrupt, as
    always; any later one of either is ignored, so that the journal commit and the summary that
    follow the first are not cut short (SIGKILL still ends the process). A second Ctrl-C pressed
    at once (as an impatient user does) escaped the job's cleanup: "interrupted before any row
    ran", no summary, where 14 rows were kept in the journal. `hold_after`: once one came, they stay
    ignored after the block too (a command that then prints its summary and exits: the handlers
    put back, a second Ctrl-C 0.3 s after the first ended it by the signal)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = False

    def handler(signum, frame):
        nonlocal fired
        if not fired:
            fired = True
            raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()

    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, handler)}
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where SIGINT is ignored (nohup, &)
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        for signum, before in previous.items():
            signal.signal(signum, signal.SIG_IGN if fired and hold_after else before)
