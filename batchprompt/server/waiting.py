"""Running a request's batch while its client waits: the results, or the events of a stream.

A client that goes away has its work cancelled in the engine at once: a non-streaming request
watches the connection for `http.disconnect` while it waits; a stream's generator is closed by
Starlette when the client disconnects, and its `finally` cancels what has not finished."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from fastapi import Request

from ..api.batch import Batch
from ..api.result import Result
from ..jobs import openai_io
from .errors import ApiError
from .responses import DONE, KEEP_ALIVE, Chunks, error_event, result_error
from .schemas import CLIENT_GONE
from .state import SHUTTING_DOWN, ServerState

KEEP_ALIVE_S = 15.0  # a comment line this often while a stream waits, so proxies keep it open


async def results(request: Request, state: ServerState, batch: Batch) -> list[Result]:
    """`batch`'s results in input order; ApiError 503 if a shutdown cancelled them, 499 if the
    client went away (nobody reads that answer, but the metrics count it)."""
    with state.track(batch):
        waiter = asyncio.ensure_future(batch.wait_async())
        gone = asyncio.ensure_future(_disconnected(request))
        stuck = asyncio.ensure_future(state.abandoned.wait())
        try:
            await asyncio.wait({waiter, gone, stuck}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this handler is cancelled: the waiter's cancel cancels the batch
            gone.cancel()
            stuck.cancel()
            if not waiter.done():
                waiter.cancel()
        if state.abandoned.is_set() and not (waiter.done() and not waiter.cancelled()):
            raise ApiError(503, SHUTTING_DOWN, "shutting_down")  # the engine is stuck: answered without it
        if not waiter.done() or waiter.cancelled():
            state.cancelled["client_disconnected"] += 1
            raise ApiError(CLIENT_GONE, "the client went away; its request was cancelled", "client_disconnected")
        out = waiter.result()
    if any(r.finish_reason == "cancelled" for r in out):
        raise ApiError(503, SHUTTING_DOWN, "shutting_down")
    return out


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects (the body has been read: the next message is that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def events(state: ServerState, batch: Batch, chunks: Chunks) -> AsyncIterator[str]:
    """Server-sent events of a streamed request: each choice's text as its tokens are made."""
    loop = asyncio.get_running_loop()
    arrived: asyncio.Queue = asyncio.Queue()

    def put(index: int, got: Result | tuple) -> None:  # on the batch's callback thread
        try:
            loop.call_soon_threadsafe(arrived.put_nowait, (index, got))
        except RuntimeError:  # the loop has closed: the server is gone
            pass

    if chunks.streams_tokens:  # new tokens and their log-probs, then (on the same thread, so after them) the result
        batch._add_on_tokens(lambda index, ids, logprobs: put(index, (ids, logprobs)), last=False, inline=False,
                             logprobs=True)
    batch.on_result(put)
    finished = False
    try:
        with state.track(batch):
            batch.start()
            for chunk in chunks.start():
                yield chunk
            received = 0
            while received < batch.total:
                item = await _next(arrived, state.abandoned)
                if item is ABANDONED:  # shutting down, and the engine is stuck in a step
                    yield error_event(ApiError(503, SHUTTING_DOWN, "shutting_down"))
                    yield DONE
                    finished = True
                    return
                if item is None:
                    yield KEEP_ALIVE
                    continue
                index, result = item
                if isinstance(result, tuple):  # a choice's new tokens, and their log-probs where asked
                    for chunk in chunks.tokens(index, *result):
                        yield chunk
                    continue
                received += 1
                # A failed choice, as an answer not streamed fails (openai_io.failed_choice): also the
                # one choice of a request whose finished text broke its schema, which ended "stop"
                # with no error before (of several, its finish chunk carries the error).
                failed = openai_io.failed_choice([result], chunks.plan.several)
                if result.finish_reason == "cancelled" or failed is not None:
                    yield error_event(_stream_error(state, result, chunks.plan.rows[index // chunks.plan.n].body))
                    yield DONE
                    finished = True
                    return
                for chunk in chunks.result(index, result):
                    yield chunk
            for chunk in chunks.end():
                yield chunk
            finished = True
    except ApiError as e:  # the server began shutting down before this stream started
        yield error_event(e)
        yield DONE
        finished = True
    finally:
        if not batch.done:
            if not finished:
                state.cancelled["client_disconnected"] += 1
            # Not awaited: this may run inside a cancelled task, or as the generator is closed.
            batch.abandon()


ABANDONED = object()


async def _next(arrived: asyncio.Queue, abandoned: asyncio.Event):
    """The next (index, result), None after KEEP_ALIVE_S without one, or ABANDONED once
    `abandoned` is set."""
    if abandoned.is_set():
        return ABANDONED
    got = asyncio.ensure_future(arrived.get())
    stuck = asyncio.ensure_future(abandoned.wait())
    try:
        await asyncio.wait({got, stuck}, timeout=KEEP_ALIVE_S, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stuck.cancel()
        if not got.done():
            got.cancel()
    if got.done() and not got.cancelled():
        return got.result()
    return ABANDONED if abandoned.is_set() else None


def _stream_error(state: ServerState, result: Result, body: dict) -> ApiError:
    if result.finish_reason == "cancelled":
        if state.shutting_down:
            return ApiError(503, SHUTTING_DOWN, "shutting_down")
        return ApiError(500, f"the request was cancelled: {result.error}", "cancelled")
    return result_error(result, body)  # its param named as in an answer that is not streamed
