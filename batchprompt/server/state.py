"""ServerState: the model the server runs, whether it is ready, and the work in flight.

The engine is the process's one EngineService for the model (`get_service`, the same one that
`bp.LanguageModel.create(model=...)` and `batchprompt run` use), so HTTP requests and in-process
callers are batched together. It is loaded before the server listens; /ready says 503 once the
server is shutting down or the engine has stopped."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import Counter
from contextlib import contextmanager
from typing import Iterator

from ..api.batch import Batch
from ..api.result import EngineStoppedError
from ..api.service import EngineService, get_service
from ..engine import EngineStats
from ..models import resolve_model
from ..models.loader import EMBEDDED_NAMES
from .batch_api import BatchApi
from .batches import STOP_TIMEOUT_S, BatchStore, Webhooks
from .config import ServerConfig
from .errors import ApiError
from .transfers import Transfers

log = logging.getLogger("batchprompt")

#: At shutdown, how long the requests in flight wait for the engine to cancel them (it does so
#: between two steps, in milliseconds). A step stuck longer than this (a kernel that hangs) is
#: not waited for: the requests are answered 503 without it, so the server can still exit.
CANCEL_GRACE_S = 5.0

SHUTTING_DOWN = "the server is shutting down; the request was cancelled (send it to another server or retry later)"


class ServerState:
    def __init__(self, config: ServerConfig):
        self.config = config
        source = resolve_model(config.model)  # an unknown model fails here, before the server starts
        self.model_id = source.name  # what /v1/models lists
        self.model_key = str(source.path)  # what get_service is called with (a hub id is not looked up again)
        # Names a request's "model" may give: the listed id, what --model said, the embedded aliases.
        self.model_names = {source.name, str(config.model)} if config.model else {source.name}
        if source.name == "smollm2-135m":
            self.model_names |= set(EMBEDDED_NAMES)
        if config.served_model_names:  # as vLLM: these names only, the first listed and answered
            self.model_id, self.model_names = config.served_model_names[0], set(config.served_model_names)
        self.created = int(time.time())
        self.loop: asyncio.AbstractEventLoop | None = None
        self._cancelling: asyncio.Future | None = None  # the shutdown's cancel of requests in flight
        self._watch: asyncio.Future | None = None  # sets `abandoned` if that cancel takes too long
        self.cancelled: Counter[str] = Counter()  # requests cancelled, by reason (metrics)
        self.abandoned = asyncio.Event()  # set when a shutdown's cancel is not done in CANCEL_GRACE_S
        self.stopping = asyncio.Event()  # set when the shutdown begins (shutting_down)
        self.transfers = Transfers()  # requests blocked on their client, cut by the shutdown
        self._service: EngineService | None = None
        self._lock = threading.Lock()
        self._active: set[Batch] = set()  # batches of requests being answered (not async batches)
        self.batches = BatchStore(config.batch_retention_s, config.max_batches)
        self.webhooks = Webhooks(config.webhook_attempts, config.webhook_backoff_s, config.webhook_timeout_s)
        # Last: it locks --data-dir (a second server on it stops here, before loading the model).
        self.batch_api = BatchApi(config, self)

    # ---- the model ---------------------------------------------------------------------------
    def load(self) -> None:
        """Load the model and start its engine (built on the engine's own thread, see
        EngineService); the calling thread waits for it."""
        if self._service is not None:
            return
        t0 = time.perf_counter()
        c = self.config
        self._service = get_service(self.model_key, device=c.device, dtype=c.dtype, engine_options=c.engine_options)
        log.info("model %s ready in %.1fs", self.model_id, time.perf_counter() - t0)

    @property
    def ready(self) -> bool:
        service = self._service
        return service is not None and not service.stopped and not self.shutting_down

    @property
    def max_model_len(self) -> int | None:
        """The engine's context length (None until the model is loaded)."""
        service = self._service
        return None if service is None else service.max_model_len

    def service(self) -> EngineService:
        """The engine service, or a 503 that says why there is none now."""
        if self.shutting_down:
            raise ApiError(503, "the server is shutting down", "shutting_down")
        service = self._service
        if service is None:
            raise ApiError(503, f"the model {self.model_id} is not loaded yet; GET /ready says when it is",
                           "model_not_ready")
        if service.stopped:  # its thread failed, or bp.shutdown() was called in this process
            raise ApiError(503, f"the engine stopped ({service.stop_reason}); restart the server",
                           "engine_stopped")
        return service

    def check_model(self, name) -> None:
        """A request's "model": ours (or left out, or "", as vLLM allows), else 404."""
        if name not in (None, "") and name not in self.model_names:
            names = ", ".join(map(repr, self.config.served_model_names or (self.model_id,)))
            raise ApiError(404, f"the model {name!r} does not exist here: this server runs {names} "
                                f"(GET /v1/models)", "model_not_found", "model")

    def engine_stats(self) -> EngineStats | None:
        """A copy of the engine's stats, taken between steps (blocking: call from a thread)."""
        service = self._service
        if service is None:
            return None
        try:
            return service.stats(timeout=30)
        except (EngineStoppedError, concurrent.futures.TimeoutError):  # stopped, or stuck in a step
            return None

    # ---- work in flight ----------------------------------------------------------------------
    @contextmanager
    def track(self, batch: Batch) -> Iterator[None]:
        """Hold `batch` as in flight: a shutdown cancels it. Enter on the event loop."""
        if self.shutting_down:
            raise ApiError(503, SHUTTING_DOWN, "shutting_down")
        with self._lock:
            self._active.add(batch)
        try:
            yield
        finally:
            with self._lock:
                self._active.discard(batch)

    def prompts_pending(self) -> int:
        """Prompts of in-flight requests not answered yet (queued or running)."""
        with self._lock:
            active = list(self._active)
        return sum(b.total - b.progress.done for b in active)

    def requests_in_flight(self) -> int:
        with self._lock:
            return len(self._active)

    def begin_shutdown_threadsafe(self) -> None:
        """From a signal handler: start the shutdown on the event loop."""
        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.begin_shutdown)

    def abandon_threadsafe(self) -> None:
        """From a signal handler (a second Ctrl-C): answer every request in flight now, 503,
        without waiting for the engine's step (as when it is stuck)."""
        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._abandon)

    def _abandon(self) -> None:
        self.begin_shutdown()
        self.abandoned.set()

    @property
    def shutting_down(self) -> bool:
        return self.stopping.is_set()

    def begin_shutdown(self) -> asyncio.Future | None:
        """Refuse new work and cancel what is in flight, so that uvicorn's wait for open
        requests ends at once (each answers 503, or ends its stream with an error). Nothing here
        waits on the engine thread: if it is stuck in a step, `abandoned` is set after
        CANCEL_GRACE_S and the requests are answered without it."""
        if self.shutting_down:
            return self._cancelling
        self.stopping.set()
        self.transfers.cut_blocked()
        with self._lock:
            active = list(self._active)
        if active:
            self.cancelled["shutdown"] += len(active)
            self._cancelling = asyncio.ensure_future(_cancel_all(active))
            self._watch = asyncio.ensure_future(self._abandon_if_stuck(self._cancelling))  # held: a task
            # only weakly referenced by the loop could be collected before it runs
        return self._cancelling

    async def _abandon_if_stuck(self, cancelling: asyncio.Future) -> None:
        done, _ = await asyncio.wait({cancelling}, timeout=CANCEL_GRACE_S)
        if not done:
            log.warning("the engine did not finish its step within %.0fs of the shutdown: the requests in "
                        "flight are answered without it", CANCEL_GRACE_S)
            self.abandoned.set()


async def _cancel_all(batches: list[Batch]) -> None:
    """Ask the engine to drop every batch's unfinished work; return once it has."""
    waits = []
    for batch in batches:
        try:
            fut = batch.request_cancel()
        except Exception:  # noqa: BLE001  (one batch's failure must not keep the others running)
            log.exception("could not cancel a request at shutdown")
            continue
        if fut is not None:
            waits.append(asyncio.wrap_future(fut))
    for outcome in await asyncio.gather(*waits, return_exceptions=True):
        if isinstance(outcome, Exception) and not isinstance(outcome, EngineStoppedError):
            log.error("could not cancel a request at shutdown: %s", outcome)


async def _end_async_batches(state: ServerState) -> None:
    """Async batches live in memory: at a stop, each still running is cancelled, and its webhook
    is sent once (no retries), so that a receiver waiting for it learns that it ended
    ("cancelled", with the results that finished) rather than waiting forever. Bounded: the
    cancels by CANCEL_GRACE_S, the posts by one attempt's timeout, at most STOP_TIMEOUT_S."""
    running = [job for job in state.batches.all() if job.finished_at is None]
    for job in running:
        job.cancel_asked = True
    state.webhooks.stopping = True
    if running:
        cancels = [asyncio.ensure_future(job.batch.cancel_async()) for job in running]
        await asyncio.wait(cancels, timeout=CANCEL_GRACE_S)
    tasks = [job.task for job in state.batches.all() if job.task is not None and not job.task.done()]
    if tasks:
        _, late = await asyncio.wait(tasks, timeout=min(state.webhooks.timeout_s, STOP_TIMEOUT_S) + 1)
        for task in late:  # an engine stuck in a step, or a receiver that never answers
            task.cancel()
        if late:
            await asyncio.wait(late, timeout=CANCEL_GRACE_S)


async def close(state: ServerState) -> None:
    """At the app's end: cancel what is in flight, async batches and their webhooks included;
    stop the Batch API's batches (their finished requests are committed: they resume next start)."""
    pending = state.begin_shutdown()
    await _end_async_batches(state)
    if pending is not None and not state.abandoned.is_set():  # begun at the signal: done unless the engine is stuck
        await asyncio.wait({pending}, timeout=CANCEL_GRACE_S)
    await state.webhooks.close()
    await state.batch_api.close()
