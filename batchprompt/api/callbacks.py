"""CallbackThread: runs the batches' user callbacks one after another, off the engine thread.

Waiters rely on it: a batch is finished once a marker queued behind its callbacks has run. So
the thread survives any callback (even one that raises SystemExit), and once it is closed a
callback runs at once on the caller's thread instead of waiting in a queue nobody reads.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

log = logging.getLogger("batchprompt")

_local = threading.local()


def on_callback_thread() -> bool:
    """True inside a user callback: waiting there for other callbacks would wait for itself."""
    return getattr(_local, "active", False)


class CallbackThread:
    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._dropping = False
        self.dropped = 0  # callbacks on cut results not run since drop_cut()
        self.ran = 0  # callbacks run by the thread
        self.running = False  # a callback is running now
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def dispatch(self, fn: Callable, *args, cut: bool = False) -> None:
        """Run `fn(*args)` on the thread, after everything dispatched before it. `cut`: a callback
        on results that a stop cut short (cancelled), which after drop_cut() is counted, not run."""
        with self._lock:
            if self._dropping and cut:
                self.dropped += 1
                return
            if not self._closed:
                self._queue.put((fn, args))
                return
        _run(fn, args)

    def after_fork(self) -> None:
        """In a forked child, whose copy of this thread is not running: callbacks run inline."""
        self._lock = threading.Lock()
        self._closed = True

    def drop_cut(self) -> None:
        """From now on, callbacks on cut results are not run (at interpreter exit: the prompts the
        exit cancelled; those of results that came, before or during the exit, still run)."""
        with self._lock:
            self._dropping = True

    def close(self) -> None:
        """End the thread once it has run what was dispatched before this call."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put(None)

    def drain(self, stall_s: float) -> int:
        """Wait for the thread to run what was dispatched before close(), for as long as its
        callbacks go on finishing (a wait of `stall_s` with none finished ends it). Returns how
        many were left unrun (0 once the thread has ended). At exit: a fixed deadline dropped the
        callbacks of results that had come, after about 10 s of slow ones, without a word."""
        while self.thread.is_alive():
            before = self.ran
            self.thread.join(stall_s)
            if self.ran == before:
                break
        if not self.thread.is_alive():
            return 0
        return max(self._queue.qsize() - (1 if self._closed else 0), 0) + (1 if self.running else 0)

    def _loop(self) -> None:
        _local.active = True
        while True:
            job = self._queue.get()
            if job is None:
                return
            self.running = True
            _run(*job)
            self.running = False
            self.ran += 1


#: How often each callback (by its code) has raised: its first error is logged with the
#: traceback, later ones only as a count at 10, 100, 1000... (an on_tokens that raised on every
#: token of a job wrote a traceback each time, thousands of them).
_raised: dict = {}


def _run(fn: Callable, args: tuple) -> None:
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001  (even SystemExit: the thread serves every batch's waiters)
        # Per callback and kind of error: a callback's SystemExit after its ValueError went unsaid.
        key = (getattr(fn, "__code__", None) or type(fn), type(e))
        count = _raised[key] = _raised.get(key, 0) + 1
        name = getattr(fn, "__qualname__", None) or repr(fn)
        kind = type(e).__name__
        if count == 1:
            log.exception("a batch callback (%s) raised %s; the batch goes on (its further %s errors are counted, "
                          "not printed)", name, kind, kind)
        elif _is_power_of_ten(count):
            log.error("a batch callback (%s) has raised %s %d times; the last: %s", name, kind, count, e)


def _is_power_of_ten(n: int) -> bool:
    while n % 10 == 0:
        n //= 10
    return n == 1
