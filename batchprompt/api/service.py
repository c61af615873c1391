"""EngineService: one engine per model in a process, stepped on a background thread.

Every caller (threads, asyncio tasks, sessions) hands its prompts to the service as a
`Source`, a queue of items. The engine thread feeds the engine from the sources round-robin,
keeping a window of requests in the engine that follows the measured completion rate: enough
that every step is full, few enough that cancelling is cheap and that one huge batch does not
hold back a single prompt from another caller. How many of the fed requests run at once is
the scheduler's call and follows free KV memory.

Callbacks given with items run on the engine thread and must be quick; user callbacks go
through `dispatch`, a second thread, so a slow callback never stalls the engine.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from ..engine import LLMEngine, RequestOutput, SamplingParams

log = logging.getLogger("batchprompt")


@dataclass(eq=False)
class Item:
    """One prompt on its way to the engine. `on_done` runs on the engine thread."""

    token_ids: list[int]
    params: SamplingParams
    on_done: Callable[[RequestOutput], None]
    request_id: str | None = None


@dataclass(eq=False)
class Source:
    """A caller's pending items, handed to the engine in this order."""

    items: deque[Item] = field(default_factory=deque)
    in_engine: dict[str, Item] = field(default_factory=dict)
    cancelled: bool = False


class EngineService:
    def __init__(self, engine: LLMEngine, name: str = "model", lookahead_s: float = 2.0):
        self.engine, self.name = engine, name
        self.lookahead_s = lookahead_s
        self._cond = threading.Condition()
        self._sources: deque[Source] = deque()
        self._commands: list[tuple[Callable[[], Any], Future]] = []
        self._in_engine: dict[str, tuple[Source, Item]] = {}
        self._ids = itertools.count()
        self._rate = 0.0  # requests finished per second, smoothed
        self._callbacks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"batchprompt-engine-{name}", daemon=True)
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name=f"batchprompt-callbacks-{name}",
                                            daemon=True)
        self._thread.start()
        self._dispatcher.start()

    # ---- callers' side (any thread) --------------------------------------------------------
    def submit(self, source: Source) -> None:
        with self._cond:
            self._sources.append(source)
            self._cond.notify()

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the engine thread, between steps; its result comes back in the future."""
        fut: Future = Future()
        with self._cond:
            self._commands.append((fn, fut))
            self._cond.notify()
        return fut

    def cancel(self, source: Source, on_pending: Callable[[Item], None]) -> Future:
        """Drop `source`'s items not yet in the engine (each goes to `on_pending`) and abort
        those in it (their outputs come back through `on_done`, finish_reason 'abort')."""
        def run() -> None:
            source.cancelled = True
            while source.items:
                on_pending(source.items.popleft())
            for rid in list(source.in_engine):
                self.engine.abort(rid)
        return self.call(run)

    def dispatch(self, fn: Callable, *args) -> None:
        """Run a user callback on the callback thread, in the order dispatched."""
        self._callbacks.put((fn, args))

    @property
    def in_flight(self) -> int:
        return len(self._in_engine)

    # ---- engine thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._commands or self._sources or self.engine.has_unfinished()):
                    self._cond.wait()
                commands, self._commands = self._commands, []
            for fn, fut in commands:
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001  (handed to the caller)
                    fut.set_exception(e)
            self._feed()
            if self.engine.has_unfinished():
                self._step()

    def _window(self) -> int:
        cfg = self.engine.config
        return cfg.max_num_seqs + max(64, int(self._rate * self.lookahead_s))

    def _feed(self) -> None:
        room = self._window() - len(self._in_engine)
        with self._cond:
            while room > 0 and self._sources:
                source = self._sources[0]
                if source.cancelled or not source.items:
                    self._sources.popleft()
                    continue
                item = source.items.popleft()
                self._sources.rotate(-1)
                item.request_id = f"{self.name}-{next(self._ids)}"
                source.in_engine[item.request_id] = item
                self._in_engine[item.request_id] = (source, item)
                self.engine.add_request(item.token_ids, item.params, item.request_id)
                room -= 1

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:  # a bug in the engine: fail what is in it, keep the thread alive
            log.exception("engine step failed")
            outputs = []
            for rid, (_, item) in list(self._in_engine.items()):
                try:
                    self.engine.abort(rid)
                except Exception:  # noqa: BLE001
                    pass
                outputs.append(RequestOutput(rid, item.token_ids, [], "", "error",
                                             error=f"the engine failed: {type(e).__name__}: {e}"))
        dt = max(time.perf_counter() - t0, 1e-6)
        self._rate = 0.9 * self._rate + 0.1 * (len(outputs) / dt)
        for out in outputs:
            entry = self._in_engine.pop(out.request_id, None)
            if entry is None:  # already answered (after an engine failure)
                continue
            source, item = entry
            source.in_engine.pop(out.request_id, None)
            try:
                item.on_done(out)
            except Exception:  # noqa: BLE001
                log.exception("a result handler failed")

    def _dispatch_loop(self) -> None:
        while True:
            fn, args = self._callbacks.get()
            try:
                fn(*args)
            except Exception:  # noqa: BLE001  (a user's callback must not stop the others)
                log.exception("a batch callback raised")


# ---- one service per model in a process ---------------------------------------------------------
_services: dict[tuple, EngineService] = {}
_services_lock = threading.Lock()


def get_service(model: str | LLMEngine | None = None, *, device: str = "auto", dtype: str = "auto",
                engine_options: dict | None = None) -> EngineService:
    """The process's service for `model` (an id, a path, None for the embedded model, or an
    engine built by hand), created on first use. `engine_options` (EngineConfig fields) apply
    when the engine is created; later callers share it as it is."""
    if isinstance(model, LLMEngine):
        key: tuple = ("engine", id(model))
    else:
        from ..models import resolve_model
        source = resolve_model(model)  # fails fast, with the user's spelling, on an unknown model
        key = (str(source.path), device, str(dtype))
    with _services_lock:
        service = _services.get(key)
        if service is None:
            if isinstance(model, LLMEngine):
                engine, name = model, "engine"
            else:
                engine = LLMEngine.from_pretrained(str(source.path), device=device, dtype=dtype,
                                                   **(engine_options or {}))
                name = source.name
            service = _services[key] = EngineService(engine, name=f"{name}-{len(_services)}")
        return service
