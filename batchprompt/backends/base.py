"""The backend seam: what the batch API, the job runner and the server hand their work to.

Everything above this seam (sessions, streaming batches, cancel, progress, journals,
structured outputs, HTTP routes) knows only `Backend`; what runs the prompts is behind it:

    local   EngineService (api/service.py): one engine in this process
    remote  a pool of OpenAI-compatible endpoints (batchprompt.remote)
    ray     engine replicas as Ray actors (batchprompt.ray)

Work crosses the seam as `Source`s, queues of `Item`s: token ids rendered above the seam (one
place renders chat templates), `SamplingParams` (structured output as a plain-data `Grammar`),
and a done-callback that receives one `RequestOutput`. The contract every backend keeps:

- every submitted item is answered exactly once through `on_done`, whatever fails (an error
  output names the reason; `finish_reason` "abort" after a cancel or a shutdown);
- `on_done` may run on any thread of the backend and must be quick; user callbacks go through
  `dispatch`, which runs them on one callback thread, in order;
- `cancel` drops the source's items not yet started (each goes to `on_pending`) and aborts
  those running (their outputs still come back through `on_done`);
- a higher `Source.priority` is served first (interactive requests before bulk rows), without
  starving the others.
"""
from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

from ..engine import EngineStats, RequestOutput, SamplingParams

log = logging.getLogger("batchprompt")

#: Priority classes (higher first). Interactive HTTP requests and in-process calls run at
#: INTERACTIVE; Batch API rows and background batches at BULK.
INTERACTIVE = 0
BULK = -1


@dataclass(eq=False)
class Item:
    """One prompt on its way to a backend. `on_done` runs on a backend thread."""

    token_ids: list[int]
    params: SamplingParams
    on_done: Callable[[RequestOutput], None]
    request_id: str | None = None
    #: Optional: `on_tokens(ids, last, logprobs)` with the tokens made since the last call, as a
    #: step makes them; last=True for those of the step that finished the prompt, just before
    #: `on_done` (which still carries them all); `logprobs`, where the params ask for them, is
    #: (their log-probs, their top ones), else None. Backends that cannot stream never call it.
    on_tokens: Callable[[list[int], bool, tuple | None], None] | None = None
    #: How many of the caller's prompts this item answers: a batch's repeated greedy prompts run
    #: as one item (api.batch), and a stop that cuts it short counts them all.
    prompts: int = 1


@dataclass(eq=False)
class Source:
    """A caller's pending items, handed to the backend in this order. Items of a source with a
    higher `priority` are admitted first."""

    items: deque[Item] = field(default_factory=deque)
    in_engine: dict[str, Item] = field(default_factory=dict)
    cancelled: bool = False
    #: Its caller asked for a cancel (set on the caller's thread, before the backend runs it): a
    #: stop that finds its items still pending does not count them as cut short by the stop.
    cancel_asked: bool = False
    priority: int = INTERACTIVE
    #: Tokens its items still in the engine have made so far (a batch's live progress), where
    #: the backend can tell (the local engine, counted about every second); 0 elsewhere.
    made: int = 0


class StopCounts:
    """What a backend's stop says (mixed into the local, Ray and pool backends): whether it was
    shut down as asked (`SHUT_DOWN_REASONS`: by a call, or at exit) rather than by a failure,
    and, for the exit's warning (api/service.py `_stop_at_exit`), how many prompts the stop cut
    short and how many of their callbacks it dropped. The backend sets `stop_reason`, counts
    `_cut_short` and holds its CallbackThread in `_callbacks`."""

    SHUT_DOWN_REASONS: tuple[str, ...] = ()
    stop_reason: str | None
    _cut_short: int
    _callbacks: Any

    @property
    def _shut_down(self) -> bool:
        return self.stop_reason in self.SHUT_DOWN_REASONS

    @property
    def cancelled_at_stop(self) -> int:
        """Prompts that the stop cut short (answered 'cancelled' or 'abort')."""
        return self._cut_short

    @property
    def callbacks_dropped(self) -> int:
        return self._callbacks.dropped

    def finish_callbacks(self, stall_s: float) -> int:
        """After a stop: run the callbacks of results that came, while they go on finishing (see
        CallbackThread.drain); how many were left unrun."""
        return self._callbacks.drain(stall_s)


@runtime_checkable
class Backend(Protocol):
    """What runs prompts. `api.service.EngineService` is the local one."""

    name: str

    @property
    def tokenizer(self) -> Any:
        """Renders prompts above the seam (`encode_prompt(messages)`, `encode`, `decode`)."""

    @property
    def max_model_len(self) -> int:
        """The longest prompt + output a request may have."""

    @property
    def stopped(self) -> bool: ...

    stop_reason: str | None

    def refuses(self, params: SamplingParams) -> str | None:
        """Why these parameters cannot run here (None: they can); asked before any work is sent,
        so that an option no row can use is refused once, up front."""

    def submit(self, source: Source) -> None:
        """Queue `source`'s items; on a stopped backend each is answered at once."""

    def cancel(self, source: Source, on_pending: Callable[[Item], None]) -> Future:
        """See the module's contract; the future completes once the cancel has taken effect."""

    def dispatch(self, fn: Callable, *args, cut: bool = False) -> None:
        """Run a user callback on the backend's callback thread, in order (`cut`: on results a
        stop cancelled, which no backend runs at interpreter exit)."""

    def pin_prefix(self, name: str, token_ids: list[int]) -> Future:
        """Compute `token_ids` once and keep them cached under `name` (a session's shared
        prefix); the future gives how many tokens stay cached (0 where the backend keeps
        prefixes its own way, as a remote server's prefix cache does)."""

    def copy_pin(self, source: str, name: str) -> Future:
        """Pin `source`'s prefix again under `name` (a cloned session); future of its tokens."""

    def add_session(self, name: str) -> None: ...

    def close_session(self, name: str) -> None:
        """Forget a session and release its pinned prefix."""

    @property
    def open_sessions(self) -> int: ...

    @property
    def in_flight(self) -> int: ...

    def stats(self, timeout: float | None = None) -> EngineStats:
        """A snapshot of the counters (summed over replicas or endpoints where there are many)."""

    def shutdown(self) -> None:
        """Stop; every item still waiting is answered ('abort')."""


def stopped_output(item: Item, reason: str | None, shut_down: bool, rid: str | None = None) -> RequestOutput:
    """What an item gets when its backend stops under it: 'abort' after a shutdown (a cancel
    the user asked for), 'error' when it failed. Either way the item did not run to its end
    through no fault of its own (retryable)."""
    return RequestOutput(rid if rid is not None else item.request_id or "", item.token_ids, [], "",
                         "abort" if shut_down else "error", error=reason, retryable=True)


def answer(item: Item, out: RequestOutput) -> None:
    """Hand `out` to the item's handler. A handler that raises is called once more with an error
    output, so that its item is still answered (a caller may be waiting on it). Every backend
    answers its items through this."""
    try:
        item.on_done(out)
        return
    except Exception as e:  # noqa: BLE001
        log.exception("a result handler failed")
        error = f"the result could not be handled: {type(e).__name__}: {e}"
    try:
        item.on_done(RequestOutput(out.request_id, item.token_ids, [], "", "error", error=error))
    except Exception:  # noqa: BLE001
        log.exception("a result handler failed on an error output too")
