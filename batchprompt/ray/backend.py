"""RayBackend: the Backend seam (backends/base.py) over engine replicas that are Ray actors.

One dispatcher thread on the driver takes the sources' items in order (trie order within a
batch), cuts them into blocks of neighbours (blocks.py) and keeps a few blocks in flight on
every ready replica. A block's outputs come back together and are answered at once, so the job
journal records them as they return.

A replica that dies (its process killed, its node gone) fails its blocks with a RayActorError:
their items go back to the front of the queue and run on the other replicas (counted in
`rows_rerun`), while Ray restarts the actor (`max_restarts`); a probe call tells when it is back,
and the sessions' pinned prefixes are pinned there again. Items lost with a replica twice are
re-sent one per block, so a prompt that crashes its engine is found and fails alone after
`MAX_ATTEMPTS` losses instead of taking every replica down in turn.

Every item is answered exactly once: by its output, by 'abort' after a cancel or a shutdown, or
by an error when no replica is left (all dead for good, or none back within `recover_timeout_s`).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import re
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

from ..api.callbacks import CallbackThread
from ..backends.base import Item, Source, StopCounts, answer, stopped_output
from ..engine import EngineStats, RequestOutput, SamplingParams
from .blocks import block_size, cut
from .replica import ReplicaInfo

log = logging.getLogger("batchprompt")

#: Times an item may be lost with its replica before it fails alone (it may crash the engine).
MAX_ATTEMPTS = 3
SHUT_DOWN = "the Ray replicas were shut down (bp.shutdown(), LanguageModel.close() or backend.shutdown())"
SHUT_DOWN_AT_EXIT = "the Ray replicas were shut down as the Python interpreter exited (the script ended)"
RAY_DOWN = ("Ray was shut down in this process (ray.shutdown()) while this ran; the finished rows are kept: "
            "create the session again to run the rest")
_block_ids = itertools.count()
_backend_ids = itertools.count()


@dataclasses.dataclass(eq=False)
class Block:
    id: int
    source: Source
    items: list[Item]
    attempts: int = 0  # times lost with a replica
    slot: "Slot | None" = None
    incarnation: int = 0  # of the slot when sent


@dataclasses.dataclass(eq=False)
class Slot:
    """One replica: its actor handle and what the driver knows of it."""

    index: int
    handle: Any
    state: str = "starting"  # starting, pinning (its sessions' prefixes), ready, recovering, dead
    info: ReplicaInfo | None = None
    blocks: dict[int, Block] = dataclasses.field(default_factory=dict)
    incarnation: int = 0  # +1 each time it is lost
    restarts: int = 0
    error: str | None = None  # why it is dead


@dataclasses.dataclass
class Tally:
    """Counters of the outputs that came back (a restarted replica starts its own from zero)."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    decode_tokens: int = 0
    finished: int = 0
    failed: int = 0


class RayBackend(StopCounts):
    """Built by `RayCluster.as_backend`; see the module's docstring."""

    SHUT_DOWN_REASONS = (SHUT_DOWN, SHUT_DOWN_AT_EXIT)

    def __init__(self, handles: list, tokenizer_loader: Callable[[ReplicaInfo], Any], *, blocks_in_flight: int,
                 block_rows: int, start_timeout_s: float, recover_timeout_s: float, on_shutdown: Callable[[], None]):
        self.name = f"ray-{next(_backend_ids)}"
        self.blocks_in_flight = blocks_in_flight
        self.block_rows = block_rows
        self.recover_timeout_s = recover_timeout_s
        self.stop_reason: str | None = None
        self.rows_rerun = 0  # items re-sent after their replica was lost
        self.replicas_lost = 0
        self._on_shutdown = on_shutdown
        self._tokenizer_loader = tokenizer_loader
        self._tokenizer = None
        self._info: ReplicaInfo | None = None
        self._cond = threading.Condition()
        self._events: list[tuple] = []
        self._sources: deque[Source] = deque()
        self._retry: deque[Block] = deque()
        self._pins: dict[str, list[int]] = {}
        self._sessions: set[str] = set()
        self._tally = Tally()
        self._stopping = False
        self._cut_short = 0  # items answered 'abort' by a shutdown
        self._no_replica_since: float | None = None
        self._first_ready = threading.Event()
        self._slots = [Slot(i, h) for i, h in enumerate(handles)]
        self._callbacks = CallbackThread(f"batchprompt-callbacks-{self.name}")
        self._thread = threading.Thread(target=self._loop, name=f"batchprompt-dispatch-{self.name}", daemon=True)
        self._thread.start()
        from ..api.service import stop_at_exit
        stop_at_exit(self)  # ray is imported: the exit stops these replicas before Ray's own hook runs
        for slot in self._slots:
            self._probe(slot)
        try:
            ready = self._first_ready.wait(start_timeout_s)
        except BaseException:  # Ctrl-C while the replicas start: they get it too, and their end is ours
            self.shutdown()
            raise
        if not ready:
            self.shutdown()
            from .cluster import ClusterError
            raise ClusterError(f"no Ray replica was ready within {start_timeout_s:.0f}s; the cluster may lack "
                               f"the resources asked for each replica ({_cluster_resources()})")
        if self._info is None:  # every replica failed to start
            reasons = sorted({s.error for s in self._slots if s.error})
            self.shutdown()
            from .cluster import ClusterError
            raise ClusterError("no Ray replica could start: " + "; ".join(reasons))
        self._tokenizer = tokenizer_loader(self._info)

    # ---- the seam ---------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._info.max_model_len

    def refuses(self, params: SamplingParams) -> str | None:
        return None  # each replica is a local engine

    @property
    def stopped(self) -> bool:
        return self._stopping

    @property
    def replicas(self) -> list[dict]:
        """Each replica's state, process and node (for a person, tests and benchmarks)."""
        with self._cond:
            return [dict(index=s.index, state=s.state, pid=s.info and s.info.pid, node_id=s.info and s.info.node_id,
                         restarts=s.restarts, in_flight=sum(len(b.items) for b in s.blocks.values()),
                         handle=s.handle) for s in self._slots]

    def submit(self, source: Source) -> None:
        with self._cond:
            if not self._stopping:
                self._sources.append(source)
                self._cond.notify()
                return
        while source.items:
            item = source.items.popleft()
            answer(item, stopped_output(item, self.stop_reason, self._shut_down))

    def cancel(self, source: Source, on_pending: Callable[[Item], None]) -> Future:
        fut: Future = Future()
        self._command(("cancel", source, on_pending, fut), fut)
        return fut

    def dispatch(self, fn: Callable, *args, cut: bool = False) -> None:
        self._callbacks.dispatch(fn, *args, cut=cut)

    def pin_prefix(self, name: str, token_ids: list[int]) -> Future:
        """Pin `token_ids` on every replica (pinned again on a replica that restarts); the future
        gives the tokens pinned (as on one engine). A replica not ready yet pins when it is."""
        fut: Future = Future()
        if not token_ids:
            fut.set_result(0)
            return fut
        self._command(("pin", name, list(token_ids), fut), fut)
        return fut

    def copy_pin(self, source: str, name: str) -> Future:
        fut: Future = Future()
        with self._cond:
            ids = self._pins.get(source)
        if ids is None:
            fut.set_result(0)
            return fut
        return self.pin_prefix(name, ids)

    def add_session(self, name: str) -> None:
        with self._cond:
            self._sessions.add(name)

    def close_session(self, name: str) -> None:
        with self._cond:
            self._sessions.discard(name)
            had = self._pins.pop(name, None) is not None
            slots = [s for s in self._slots if s.state == "ready"]
        if had and not self._stopping and _ray_up():  # a call with Ray down would start a new local Ray
            for s in slots:
                try:
                    s.handle.unpin.remote(name)
                except Exception:  # noqa: BLE001  (a replica gone, or Ray ending at exit: its pin went with it)
                    log.debug("replica %s: could not release the session %s", s, name, exc_info=True)

    @property
    def open_sessions(self) -> int:
        return len(self._sessions)

    @property
    def in_flight(self) -> int:
        with self._cond:
            return sum(len(b.items) for s in self._slots for b in s.blocks.values())

    def stats(self, timeout: float | None = None) -> EngineStats:
        """Counters of the outputs returned (prompt and cached tokens, tokens generated, rows
        finished and failed), with the replicas' own step, time and KV figures summed over the
        ready ones."""
        import ray

        with self._cond:
            tally = dataclasses.replace(self._tally)
            slots = [s for s in self._slots if s.state == "ready"]
        out = EngineStats(prompt_tokens=tally.prompt_tokens, cached_prompt_tokens=tally.cached_prompt_tokens,
                          decode_tokens=tally.decode_tokens, finished=tally.finished, failed=tally.failed)
        refs = [s.handle.stats.remote() for s in slots]
        deadline = None if timeout is None else time.monotonic() + timeout
        for ref in refs:
            try:
                s = ray.get(ref, timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(f"a Ray replica did not answer within {timeout}s") from None
            except ray.exceptions.RayError:  # lost meanwhile: its figures go with it
                continue
            for f in ("steps", "prefill_tokens", "preemptions", "busy_seconds", "running", "waiting",
                      "kv_blocks_used", "kv_blocks_total", "kv_bytes"):
                setattr(out, f, getattr(out, f) + getattr(s, f))
        return out

    def shutdown(self, timeout: float | None = None, at_exit: bool = False) -> bool:
        """Stop: every item still waiting or running is answered ('abort'), the actors end.
        Returns once the dispatcher has ended (True), or after `timeout` seconds (False).
        `at_exit`: the callbacks on the items it cuts short are not run (counted instead)."""
        if at_exit:
            self._callbacks.drop_cut()
        with self._cond:
            if not self._stopping:
                self._stopping, self.stop_reason = True, SHUT_DOWN_AT_EXIT if at_exit else SHUT_DOWN
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        return not self._thread.is_alive() or threading.current_thread() is self._thread

    # ---- driver side, any thread -------------------------------------------------------------
    def _command(self, command: tuple, fut: Future) -> None:
        with self._cond:
            if not self._stopping:
                self._events.append(command)
                self._cond.notify()
                return
        from ..api.result import EngineStoppedError
        fut.set_exception(EngineStoppedError(self.stop_reason))

    def _event(self, event: tuple) -> None:
        with self._cond:
            self._events.append(event)
            self._cond.notify()

    def _when_done(self, ref, event: tuple) -> None:
        """Queue `event + (future,)` once `ref` completes (Ray calls back on its own thread)."""
        ref.future().add_done_callback(lambda f: self._event(event + (f,)))

    def _probe(self, slot: Slot) -> None:
        if _ray_up():  # else the loop ends (RAY_DOWN): a call now would start a new local Ray
            self._when_done(slot.handle.info.remote(), ("probe", slot, slot.incarnation))

    # ---- dispatcher thread -------------------------------------------------------------------
    def _loop(self) -> None:
        failure = None
        try:
            while True:
                with self._cond:
                    while not (self._events or self._stopping or self._can_send() or not _ray_up()):
                        self._cond.wait(1.0)
                        if self._check_recovery():
                            break
                    if not self._stopping and not _ray_up():  # its blocks and events are answered in _end
                        self._stopping, self.stop_reason = True, RAY_DOWN
                    if self._stopping:
                        break
                    events, self._events = self._events, []
                for event in events:
                    getattr(self, "_on_" + event[0])(*event[1:])
                with self._cond:
                    self._send()
        except BaseException as e:  # noqa: BLE001  (a bug here: answer everyone, below)
            log.exception("the Ray dispatcher failed; its requests fail")
            failure = f"{type(e).__name__}: {e}"
        self._end(failure)

    def _ready_slots(self) -> list[Slot]:
        return [s for s in self._slots if s.state == "ready"]

    def _has_work(self) -> bool:
        return bool(self._retry) or any(s.items and not s.cancelled for s in self._sources)

    def _can_send(self) -> bool:
        return self._has_work() and any(len(s.blocks) < self.blocks_in_flight for s in self._ready_slots())

    def _check_recovery(self) -> bool:
        """With work waiting and no replica ready for recover_timeout_s, give up on it (True)."""
        if self._ready_slots() or not (self._has_work() or any(s.blocks for s in self._slots)):
            self._no_replica_since = None
            return False
        now = time.monotonic()
        if self._no_replica_since is None:
            self._no_replica_since = now
        elif now - self._no_replica_since > self.recover_timeout_s:
            self._stopping = True
            self.stop_reason = (f"no Ray replica was available for {self.recover_timeout_s:.0f}s (lost and not "
                                f"restarted: {self._dead_reasons()}); the finished rows are kept")
            return True
        return False

    def _dead_reasons(self) -> str:
        return "; ".join(f"replica {s.index}: {s.error or s.state}" for s in self._slots)

    def _send(self) -> None:
        """Fill every ready replica up to blocks_in_flight (called holding the lock)."""
        if not _ray_up():  # the loop ends next round (RAY_DOWN)
            return
        ready = self._ready_slots()
        while True:
            room = [s for s in ready if len(s.blocks) < self.blocks_in_flight]
            if not room:
                return
            block = self._next_block(len(ready))
            if block is None:
                return
            slot = min(room, key=lambda s: len(s.blocks))
            block.slot, block.incarnation = slot, slot.incarnation
            slot.blocks[block.id] = block
            for i, item in enumerate(block.items):
                item.request_id = f"{self.name}-{block.id}.{i}"
                block.source.in_engine[item.request_id] = item
            prompts = [(item.token_ids, item.params) for item in block.items]
            self._when_done(slot.handle.run_block.remote(block.id, prompts), ("block", block))

    def _next_block(self, replicas: int) -> Block | None:
        while self._retry:
            block = self._retry.popleft()
            if not block.source.cancelled:
                return block
            self._events.append(("aborted", block))  # cancelled while queued: answered next round
        sources = [s for s in self._sources if s.items and not s.cancelled]
        self._sources = deque(sources)
        if not sources:
            return None
        top = max(s.priority for s in sources)
        source = next(s for s in sources if s.priority == top)
        self._sources.remove(source)
        self._sources.append(source)  # round-robin among sources of one priority
        size = block_size(len(source.items), replicas, self.blocks_in_flight, self.block_rows)
        window = [source.items[i] for i in range(min(len(source.items), size + 1))]
        n = cut([it.token_ids for it in window], size)
        items = [source.items.popleft() for _ in range(n)]
        return Block(next(_block_ids), source, items)

    def _on_block(self, block: Block, fut) -> None:
        import ray

        slot = block.slot
        with self._cond:  # `replicas` and `in_flight` read the blocks from callers' threads
            slot.blocks.pop(block.id, None)
        for item in block.items:
            block.source.in_engine.pop(item.request_id, None)
        try:
            outputs = fut.result()
        except ray.exceptions.RayActorError as e:
            self._lost(slot, block, e)
            return
        except Exception as e:  # noqa: BLE001  (the block cannot come back: its rows fail)
            log.exception("a block failed on a Ray replica")
            outputs = [RequestOutput(item.request_id or "", item.token_ids, [], "", "error",
                                     error=f"the Ray replica could not run it: {type(e).__name__}: {e}")
                       for item in block.items]
        with self._cond:
            t = self._tally
            for out in outputs:
                t.prompt_tokens += len(out.prompt_token_ids)
                t.cached_prompt_tokens += out.num_cached_tokens
                t.decode_tokens += len(out.output_token_ids)
                t.finished += 1
                t.failed += out.error is not None
        for item, out in zip(block.items, outputs):
            answer(item, out)

    def _lost(self, slot: Slot, block: Block, error: Exception) -> None:
        """The block's replica died: re-send its items; the replica, once Ray restarts it, is
        probed back into service."""
        if slot.state == "ready" and block.incarnation == slot.incarnation:
            log.warning("Ray replica %d (pid %s) was lost (%s); its rows run %s", slot.index,
                        slot.info and slot.info.pid, type(error).__name__,
                        "on the others" if len(self._slots) > 1 else "again once Ray has restarted it")
            self.replicas_lost += 1
            slot.state, slot.incarnation = "recovering", slot.incarnation + 1
            self._probe(slot)
        if block.source.cancelled:
            self._on_aborted(block)
            return
        block.attempts += 1
        with self._cond:
            self.rows_rerun += len(block.items)
            if block.attempts >= 2 and len(block.items) > 1:  # one per block: a crashing prompt shows itself
                self._retry.extendleft(reversed([Block(next(_block_ids), block.source, [it], block.attempts)
                                                 for it in block.items]))
                return
        if block.attempts >= MAX_ATTEMPTS:
            item = block.items[0]
            self.rows_rerun -= 1  # it fails instead of running again
            answer(item, RequestOutput(item.request_id or "", item.token_ids, [], "", "error", error=(
                f"the Ray replica running this prompt died {block.attempts} times (it may crash the engine); "
                f"last: {type(error).__name__}")))
            return
        with self._cond:
            self._retry.appendleft(block)

    def _on_probe(self, slot: Slot, incarnation: int, fut) -> None:
        import ray

        if incarnation != slot.incarnation or slot.state == "dead":
            return
        try:
            info = fut.result()
        except ray.exceptions.ActorDiedError as e:  # restarts used up, or the model cannot load there
            slot.state, slot.error = "dead", _reason(e)
            log.warning("Ray replica %d is gone for good: %s", slot.index, slot.error)
            if all(s.state == "dead" for s in self._slots):
                self._first_ready.set()
                if self._info is not None:
                    with self._cond:
                        self._stopping = True
                        self.stop_reason = f"every Ray replica is gone ({self._dead_reasons()})"
            return
        except Exception:  # noqa: BLE001  (unavailable for a moment, e.g. restarting): ask again
            threading.Timer(1.0, self._event, (("reprobe", slot, incarnation),)).start()
            return
        if slot.state == "recovering":
            slot.restarts += 1
            log.warning("Ray replica %d is back (pid %d)", slot.index, info.pid)
        slot.info = info
        if self._info is None:
            self._info = info
        if not self._pins:
            self._set_ready(slot)
            return
        # A new process has none of the sessions' pinned prefixes: it takes rows once they are
        # pinned there, or rows sent beside the pins' prefill would compute the prefix again.
        slot.state = "pinning"
        refs = [slot.handle.pin_prefix.remote(name, ids) for name, ids in self._pins.items()]
        incarnation = slot.incarnation

        def wait() -> None:
            lost = False
            for ref in refs:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError:
                    lost = True
                except Exception:  # noqa: BLE001  (the prefix cannot run there: nor can its rows, which say so)
                    pass
            self._event(("pinned", slot, incarnation, lost))
        threading.Thread(target=wait, name="batchprompt-ray-repin", daemon=True).start()

    def _on_pinned(self, slot: Slot, incarnation: int, lost: bool) -> None:
        if incarnation != slot.incarnation or slot.state != "pinning":
            return
        if lost:  # died while pinning: probed back once Ray restarts it
            slot.state, slot.incarnation = "recovering", slot.incarnation + 1
            self._probe(slot)
            return
        self._set_ready(slot)

    def _set_ready(self, slot: Slot) -> None:
        slot.state = "ready"
        self._no_replica_since = None
        self._first_ready.set()

    def _on_reprobe(self, slot: Slot, incarnation: int) -> None:
        if incarnation == slot.incarnation and slot.state != "dead":
            self._probe(slot)

    def _on_aborted(self, block: Block) -> None:
        for item in block.items:
            answer(item, RequestOutput(item.request_id or "", item.token_ids, [], "", "abort"))

    def _on_cancel(self, source: Source, on_pending: Callable[[Item], None], fut: Future) -> None:
        source.cancelled = True
        while source.items:
            on_pending(source.items.popleft())
        with self._cond:
            queued = [b for b in self._retry if b.source is source]
            for b in queued:
                self._retry.remove(b)
        for b in queued:
            for item in b.items:
                on_pending(item)
        running = [b for s in self._slots for b in s.blocks.values() if b.source is source]
        if not running:
            fut.set_result(None)
            return
        left = [len(running)]
        lock = threading.Lock()

        def one_done(_f) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last and not fut.done():
                fut.set_result(None)
        for b in running:
            b.slot.handle.cancel_block.remote(b.id).future().add_done_callback(one_done)

    def _on_pin(self, name: str, ids: list[int], fut: Future) -> None:
        import ray

        self._pins[name] = ids
        refs = [s.handle.pin_prefix.remote(name, ids) for s in self._slots if s.state in ("ready", "pinning")]

        def collect() -> None:  # off the dispatcher: the prefill takes a moment
            pinned = 0
            for ref in refs:
                try:
                    pinned = max(pinned, ray.get(ref))
                except ray.exceptions.RayActorError:  # lost: it pins again once restarted
                    continue
                except Exception as e:  # noqa: BLE001  (the prompt cannot run: the caller's error)
                    fut.set_exception(e.cause if isinstance(e, ray.exceptions.RayTaskError) and e.cause else e)
                    return
            fut.set_result(pinned)
        threading.Thread(target=collect, name="batchprompt-ray-pin", daemon=True).start()

    def _end(self, failure: str | None) -> None:
        import ray

        with self._cond:
            if failure is not None:
                self.stop_reason = f"the Ray dispatcher failed: {failure}"
            self._stopping = True
            if self.stop_reason is None:
                self.stop_reason = SHUT_DOWN
            events, self._events = self._events, []
            sources, self._sources = list(self._sources), deque()
            retry, self._retry = list(self._retry), deque()
            running = [b for s in self._slots for b in s.blocks.values()]
            for s in self._slots:
                s.blocks = {}
        self._first_ready.set()
        for event in events:
            if event[0] in ("cancel", "pin"):
                from ..api.result import EngineStoppedError
                if not event[-1].done():
                    event[-1].set_exception(EngineStoppedError(self.stop_reason))
            elif event[0] == "aborted":  # a cancelled block taken off the queue: its answer was to come next round
                self._on_aborted(event[1])
        shut_down = self._shut_down
        for block in running + retry:
            for item in block.items:
                block.source.in_engine.pop(item.request_id, None)
                self._cut_short += shut_down * (not block.source.cancel_asked) * item.prompts
                answer(item, stopped_output(item, self.stop_reason, shut_down))
        for source in sources:
            source.cancelled = True
            while source.items:
                item = source.items.popleft()
                self._cut_short += shut_down * (not source.cancel_asked) * item.prompts
                answer(item, stopped_output(item, self.stop_reason, shut_down))
        for s in self._slots if _ray_up() else ():  # Ray shut down under us: the actors went with it
            try:
                ray.kill(s.handle, no_restart=True)
            except Exception:  # noqa: BLE001  (already gone)
                pass
        self._callbacks.close()
        self._on_shutdown()


def _ray_up() -> bool:
    """Ray is connected: calling a replica now neither fails nor starts a new local Ray (as a
    call does once ray.shutdown() has run, e.g. at exit)."""
    import ray
    return ray.is_initialized()


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)\b")  # "ValueError: ..."


def _reason(e: Exception) -> str:
    """What Ray's long message says happened. A replica whose __init__ raised: its first line
    (where) and the error it raised, the traceback's last line (the first 6 lines were where
    and the traceback's top frames, never the cause: "no CUDA GPU is visible")."""
    lines = [line.strip() for line in _ANSI.sub("", str(e)).strip().splitlines() if line.strip()]
    raised = next((line for line in reversed(lines[1:]) if _RAISED.match(line)), None)
    if raised is not None:
        return f"{lines[0].split(' (pid=')[0]}: {raised}"[:600]
    return " ".join(lines[:6])[:600]


def _cluster_resources() -> str:
    try:
        import ray
        return f"the cluster has {ray.cluster_resources()}, free {ray.available_resources()}"
    except Exception:  # noqa: BLE001
        return "the cluster's resources are unknown"
