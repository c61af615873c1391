"""`dynamically`: turn a function over a list of items into one called item by item.

    @bp.dynamically(batch_size=64, timeout_ms=5.0, small_batch_threshold=8)
    def embed(texts: list[str]) -> list[np.ndarray]: ...

    embed("one text")                          # one item in, one result out
    embed.many(["a", "b", "c"])                # several
    await embed.acall("one text"); await embed.amany([...])
    for vec in embed.imap(texts, max_in_flight=1024): ...   # a stream, in order, bounded memory
    embed.stats

Works on plain and async functions and on methods (one processor per instance).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import weakref
from asyncio import get_running_loop as _running_loop
from typing import Any, AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Sequence

from . import stream
from .errors import DeadlineExceeded
from .nesting import check, waiting
from .options import call_timeout, check_options, is_int
from .processor import BatchProcessor, QueueFull
from .queue import too_many_for_the_queue
from .stats import BatchStats
from .tensors import TensorBatcher, item_length
from .waiter import Waiter
from .worker import serving


class DynamicFunction:
    """A batched function: call it with one item (or `.many` with several), from any thread or
    coroutine. Per call: `priority` (higher goes first) and `timeout` (seconds; the item then
    fails with DeadlineExceeded)."""

    def __init__(self, fn: Callable, options: dict[str, Any]):
        self._fn = fn
        self._options = options
        self._processor: BatchProcessor | None = None
        functools.update_wrapper(self, fn)

    @property
    def processor(self) -> BatchProcessor:
        if self._processor is None:
            self._processor = _make_processor(self._fn, self._options)
        return self._processor

    def __call__(self, item: Any, *, priority: int = 0, timeout: float | None = None) -> Any:
        p = self._processor or self.processor
        # Inside a batch (another batched function's, or a circle: an error), through many's checks.
        if priority or timeout is not None or p._item_cost is not None or getattr(serving, "processor", None):
            return self.many([item], priority=priority, timeout=timeout)[0]
        return p.call_one(item)

    def many(self, items: Iterable, *, priority: int = 0, timeout: float | None = None) -> list:
        _check_priority(priority)
        timeout = call_timeout(timeout)
        p = self.processor
        with self._waiting(p):
            return p.wait(p.submit(_as_list(items), priority, timeout), timeout)

    async def acall(self, item: Any, *, priority: int = 0, timeout: float | None = None) -> Any:
        p = self._processor or self.processor
        # Inside a batch (an async function's), through amany's checks, as __call__ goes through many.
        if priority or timeout is not None or p.max_queue is not None or getattr(serving, "processor", None):
            return (await self.amany((item,), priority=priority, timeout=timeout))[0]
        # The common path, kept short: join this loop turn's group, await this item's result.
        loop = _running_loop()
        buf = p._buffers.get(loop)
        if buf is None:
            buf = p.open_buffer(loop)
        items = buf.items
        pos = len(items)
        items.append(item)
        group = buf.group
        if pos + 1 >= p.batch_size:
            p.flush_buffer(buf, False)
        try:
            return await Waiter(group, pos, None)
        except asyncio.CancelledError:  # still queued, and alone in its group: it runs for nobody
            p._withdraw_own(group, pos, pos + 1)
            raise

    async def amany(self, items: Iterable, *, priority: int = 0, timeout: float | None = None) -> list:
        _check_priority(priority)
        timeout = call_timeout(timeout)
        p = self.processor
        with self._waiting(p):
            return await self._amany(p, _as_list(items), priority, timeout)

    async def _amany(self, p: BatchProcessor, items: list, priority: int, timeout: float | None) -> list:
        loop = asyncio.get_running_loop()
        if p.max_queue is not None and len(items) > p.max_queue:  # block_when_full waited for ever
            raise QueueFull(too_many_for_the_queue(p.name, len(items), p.max_queue))
        if not items:  # no group to join: alone in its loop turn, it waited for a flush that never came
            return []
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                group, start, stop = p.submit_async(items, loop, priority, timeout)
                break
            except QueueFull:
                if not p.block_when_full:
                    raise
                if deadline is not None and time.monotonic() >= deadline:  # no room within the deadline
                    raise DeadlineExceeded(f"{p.name}: no room in the queue within the {timeout}s deadline") from None
                await asyncio.sleep(p.timeout or 0.001)  # never block the event loop on a lock
        return await p.await_group(group, start, stop, None if deadline is None else deadline - time.monotonic(),
                                   timeout)

    def imap(self, items: Iterable, *, max_in_flight: int = 1024, priority: int = 0,
             own_thread: bool = False) -> Iterator:
        """Results for `items` in input order, while later items are still queued; at most
        `max_in_flight` items are taken from `items` and not yet yielded. An item's error is
        raised at its turn and ends the iteration. `own_thread=True`: the items are taken on a
        thread of their own, so each result comes as soon as it is done, and `items` may wait
        for earlier results (it must then not be bound to this thread, as a sqlite3 cursor is)."""
        _check_priority(priority)
        if not isinstance(own_thread, bool):
            raise TypeError(f"own_thread must be True or False, got {own_thread!r}")
        p = self.processor
        self._not_inside(p)
        results = stream.imap(p, items, max_in_flight, priority, own_thread)
        return results if getattr(serving, "processor", None) is None else self._waiting_through(p, results)

    def aimap(self, items: Iterable | AsyncIterable, *, max_in_flight: int = 1024,
              priority: int = 0) -> AsyncIterator:
        """`imap` for asyncio: `async for result in f.aimap(items)`; `items` may be an async iterable."""
        _check_priority(priority)
        p = self.processor
        self._not_inside(p)
        results = stream.aimap(p, items, max_in_flight, priority)
        return results if getattr(serving, "processor", None) is None else self._awaiting_through(p, results)

    def _waiting_through(self, p: BatchProcessor, results: Iterator) -> Iterator:
        """A stream from inside a batch: its batcher waits on `p` while it is read (a circle
        through imap deadlocked both batchers)."""
        with self._waiting(p):
            yield from results

    async def _awaiting_through(self, p: BatchProcessor, results: AsyncIterator) -> AsyncIterator:
        with self._waiting(p):
            async for r in results:
                yield r

    @property
    def _name(self) -> str:
        return getattr(self._fn, "__name__", "the function")

    def _waiting(self, p: BatchProcessor):
        """Around a call's wait: inside a batch, its batcher waits on `p` (nesting.waiting: a call
        from inside `p`'s own batch, or one closing a circle a -> b -> a, is a RuntimeError)."""
        caller = getattr(serving, "processor", None)
        return contextlib.nullcontext() if caller is None else waiting(caller, p, self._name)

    def _not_inside(self, p: BatchProcessor) -> None:
        """A stream (imap) from inside a batch: checked when it is made (its wait is counted
        once it is read, `_waiting_through`)."""
        caller = getattr(serving, "processor", None)
        if caller is not None:
            check(caller, p, self._name)

    @property
    def stats(self) -> BatchStats:
        return self.processor.stats

    def __get__(self, instance, owner=None):
        """On a method: one processor per instance (or class, under @classmethod), bound to it."""
        if instance is None:
            return self
        key = f"__dynamically_{self._fn.__name__}"
        store = getattr(instance, "__dict__", None)
        if isinstance(store, dict):
            bound = store.get(key)
            if bound is None:  # in the instance's own __dict__: a cycle (instance -> batcher -> instance)
                bound = store[key] = DynamicFunction(self._fn.__get__(instance, owner), self._options)
            return bound
        # A class (its __dict__ is read-only) or a class with __slots__: a map by identity, holding
        # each instance weakly (by equality, two equal dataclass instances shared one batcher and
        # one's calls ran on the other; an unhashable one was refused).
        try:
            found = self._bound_to.get(id(instance))
        except AttributeError:
            self._bound_to: dict[int, tuple[weakref.ref, DynamicFunction]] = {}
            found = None
        if found is not None and found[0]() is instance:
            bound = found[1]
        else:
            try:
                ref = weakref.ref(instance, functools.partial(_forget, self._bound_to, id(instance)))
            except TypeError:  # not weakly referenceable: __slots__ without __dict__ or __weakref__
                raise TypeError(f"{type(instance).__name__}.{self._fn.__name__}: a batched method keeps one "
                                f"batcher per instance, which needs '__dict__' or '__weakref__' in "
                                f"{type(instance).__name__}.__slots__") from None
            bound = DynamicFunction(_weakly_bound(self._fn, instance), self._options)  # not holding it alive
            self._bound_to[id(instance)] = (ref, bound)
        return bound if isinstance(instance, type) else _Pinned(bound, instance)

    def __reduce__(self):
        """Pickled by name, as a function is (multiprocessing's spawn): the other process gets its own
        batcher of the same function."""
        module, name = getattr(self, "__module__", None), getattr(self, "__qualname__", None)
        if module is None or name is None or _lookup(module, name) is not self:
            raise TypeError(f"cannot pickle the batched function {name}: only one defined at a module's top "
                            f"level is pickled (by name)")
        return _lookup, (module, name)


class _Pinned:
    """A batched method of an instance that its batcher holds weakly (a class with __slots__),
    with the instance held while its caller holds this: `Model().embed(x)` lost its temporary
    instance before the batch ran ("its instance is gone")."""

    __slots__ = ("_bound", "_instance")

    def __init__(self, bound: DynamicFunction, instance: Any):
        self._bound, self._instance = bound, instance

    def __call__(self, *args, **kwargs):
        return self._bound(*args, **kwargs)

    def many(self, *args, **kwargs):
        return self._bound.many(*args, **kwargs)

    async def acall(self, *args, **kwargs):
        return await self._bound.acall(*args, **kwargs)

    async def amany(self, *args, **kwargs):
        return await self._bound.amany(*args, **kwargs)

    def imap(self, *args, **kwargs):
        return _holding(self._bound.imap(*args, **kwargs), self._instance)  # its checks at the call

    def aimap(self, *args, **kwargs):
        return _aholding(self._bound.aimap(*args, **kwargs), self._instance)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bound, name)


def _holding(results: Iterator, instance: Any) -> Iterator:
    """`results`, with `instance` held until they are read."""
    yield from results


async def _aholding(results: AsyncIterator, instance: Any) -> AsyncIterator:
    async for result in results:
        yield result


def _forget(table: dict, key: int, ref: weakref.ref) -> None:
    """An instance's batcher let go once the instance is gone (unless its id was reused since)."""
    entry = table.get(key)
    if entry is not None and entry[0] is ref:
        del table[key]


def _weakly_bound(fn: Callable, instance: Any) -> Callable:
    """`fn` bound to `instance` without keeping it alive."""
    ref = weakref.ref(instance)

    def bound(*args, **kwargs):
        obj = ref()
        if obj is None:
            raise ReferenceError(f"{fn.__qualname__}: its instance is gone")
        return fn(obj, *args, **kwargs)

    return functools.update_wrapper(bound, fn)


def _lookup(module: str, qualname: str) -> Any:
    import importlib
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def _as_list(items: Iterable) -> list | Sequence:
    """`many`'s items: a list or tuple as given, any other iterable (a generator) read into a list."""
    if isinstance(items, (list, tuple)):
        return items
    if isinstance(items, (str, bytes, dict)) or not hasattr(items, "__iter__"):
        raise TypeError(f"many() takes an iterable of items, got {type(items).__name__}; for one item, call "
                        f"the function itself")
    return list(items)


def _make_processor(fn: Callable, options: dict[str, Any]) -> BatchProcessor:
    opts = dict(options)
    pad_token = opts.pop("pad_token", None)
    tensors = opts.pop("tensors", False) or pad_token is not None
    if tensors:
        fn = TensorBatcher(fn, pad_token or {})
        if opts.get("buckets") is not None and opts.get("length") is None:
            opts["length"] = item_length  # the items' own lengths
    return BatchProcessor(fn, **opts)


def dynamically(fn: Callable | None = None, /, *, batch_size: int = 32, timeout_ms: float = 5.0,
                small_batch_threshold: int = 8, max_queue: int | None = None, block_when_full: bool = False,
                cost: Callable[[Any], float] | None = None, max_batch_cost: float | None = None,
                split_on_error: bool = True, tensors: bool = False, pad_token: dict | None = None,
                target_latency_ms: float | None = None, min_batch_size: int = 1,
                length: Callable[[Any], float] | None = None, buckets: Sequence[float] | str | None = None,
                workers: int | None = None, replicas: Sequence | Callable[[int], Any] | None = None):
    """Batch calls to `fn(items) -> results` across callers.

    A batch closes at `batch_size` items (or `max_batch_cost`, summing `cost(item)`), or
    `timeout_ms` after its first item arrived. Calls with at most `small_batch_threshold`
    items go ahead of larger `many` calls of the same priority. `max_queue` bounds the queue:
    beyond it a call raises QueueFull, or waits with `block_when_full=True`. If `fn` raises,
    the batch is split and retried to find the items that cause it (`split_on_error`); `fn`
    may also put an exception in an item's slot. `tensors=True` or `pad_token={...}`: items are
    dicts of 1-D arrays/tensors, padded and stacked per key for `fn`, whose outputs are split
    back per item.

    `target_latency_ms`: the batch size follows the function's measured time per batch, within
    [min_batch_size, batch_size]. `length=` (a function of an item; the tensor variant has its own)
    and `buckets=` (boundaries, or "auto"): items of similar length go together, and
    `max_batch_cost` counts padded tokens. An out-of-memory error splits the batch and lowers the
    batch size (raised again slowly). `workers=N`: N worker threads on one queue; `replicas=[...]`
    (one per worker) or `replicas=factory` (called with the worker's index, on its thread): the
    function gets its worker's replica as `replica=`. A function that raises WorkerDied has its
    worker replaced and its batch run again once.
    """
    options = dict(batch_size=batch_size, timeout_ms=timeout_ms, small_batch_threshold=small_batch_threshold,
                   max_queue=max_queue, block_when_full=block_when_full, cost=cost,
                   max_batch_cost=max_batch_cost, split_on_error=split_on_error, tensors=tensors,
                   pad_token=pad_token, target_latency_ms=target_latency_ms, min_batch_size=min_batch_size,
                   length=length, buckets=buckets, workers=workers, replicas=replicas)
    if fn is not None and not callable(fn):
        raise TypeError(f"dynamically({fn!r}): give the options by name, e.g. @bp.dynamically(batch_size={fn!r})"
                        if is_int(fn) else f"dynamically() wraps a function, got {type(fn).__name__} {fn!r}")
    check_options(**{k: v for k, v in options.items() if k not in ("workers", "replicas")})
    _make_processor(lambda items: items, options)  # validate the rest now

    def wrap(f: Callable) -> DynamicFunction:
        if not callable(f):
            raise TypeError(f"dynamically(...) wraps a function, got {type(f).__name__} {f!r}")
        return DynamicFunction(f, options)

    return wrap(fn) if fn is not None else wrap


def _check_priority(priority) -> None:
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise TypeError(f"priority must be an integer (higher goes first), got {priority!r}")
