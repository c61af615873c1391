"""The batch API on the embedded model in float32, where batching changes no greedy token."""
from __future__ import annotations

import itertools
import threading
import time

import pytest

import batchprompt as bp

from ..conftest import SPAM_SYSTEM, sms_rows


@pytest.fixture()
def lm(engine32):
    session = bp.LanguageModel.create(system=SPAM_SYSTEM, model=engine32, max_tokens=6)
    yield session
    session.destroy()


@pytest.fixture(scope="session")
def messages():
    return [text for _, text in sms_rows(24)]


class EngineSpy:
    """What a real engine did for a service: the requests it was given and every output, each
    marked with whether the service had already run a cancel by then.

    `hold_at_step`: that step (1-based) waits, before it runs, until a cancel is asked for
    (at most 10 s, so that a build that never cancels fails instead of hanging), after calling
    `on_hold`. Nothing finishes while it waits, so what the cancel stops does not depend on
    timing."""

    def __init__(self, service, engine, monkeypatch, hold_at_step: int | None = None, on_hold=None):
        self.service, self.engine = service, engine
        self.hold_at_step, self.on_hold = hold_at_step, on_hold
        self.cancel_asked = threading.Event()  # a waiter's cancel reached the service
        self.cancel_ran = threading.Event()  # ... and ran on the engine thread
        self.held = threading.Event()
        self.added: list[tuple[str, bool]] = []  # (request id, added after the cancel ran)
        self.outputs: list[tuple[str, bool]] = []  # (finish reason, its step began after the cancel ran)
        self._steps = itertools.count(1)
        real_cancel, real_add, real_step = service.cancel, engine.add_request, engine.step

        def cancel(*args, **kwargs):
            self.cancel_asked.set()
            fut = real_cancel(*args, **kwargs)
            service.call(self.cancel_ran.set)  # commands run in order: right after the cancel
            return fut

        def add_request(prompt, params=None, request_id=None, **kwargs):
            self.added.append((request_id, self.cancel_ran.is_set()))
            return real_add(prompt, params, request_id, **kwargs)

        def step(pause=None):
            if next(self._steps) == self.hold_at_step:
                self.held.set()
                if self.on_hold is not None:
                    self.on_hold()
                self.cancel_asked.wait(10)
            after = self.cancel_ran.is_set()
            outs = real_step(pause)
            self.outputs += [(o.finish_reason, after) for o in outs]
            return outs

        monkeypatch.setattr(service, "cancel", cancel)
        monkeypatch.setattr(engine, "add_request", add_request)
        monkeypatch.setattr(engine, "step", step)

    def drain(self, timeout: float = 120) -> None:
        """Wait (bounded) until the engine holds no request."""
        deadline = time.monotonic() + timeout
        while self.service.call(self.engine.has_unfinished).result(timeout):
            assert time.monotonic() < deadline, "the engine still holds requests"
            time.sleep(0.05)

    def ran_to_the_end(self) -> int:
        return sum(reason in ("stop", "length") for reason, _ in self.outputs)

    def aborted(self) -> int:
        return sum(reason == "abort" for reason, _ in self.outputs)

    def assert_cancel_reached_the_engine(self, total: int) -> None:
        """The waiter's cancel reached the engine: nothing was fed after it, every request
        stepped after it was aborted, and every request fed came back (ran or aborted)."""
        assert self.cancel_asked.is_set(), "cancelling the waiter did not cancel the batch"
        self.drain()
        assert self.cancel_ran.is_set()
        assert not [rid for rid, after in self.added if after], "requests were fed after the cancel"
        assert all(reason == "abort" for reason, after in self.outputs if after)
        assert self.ran_to_the_end() + self.aborted() == len(self.added) <= total
