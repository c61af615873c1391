"""One prompt's text in pieces as its tokens are made: `LanguageModel.prompt_streaming` (the
browser Prompt API's promptStreaming()) and its asyncio twin.

Tokens and the result both come from the engine's thread (not the callback thread, where
another batch's callback may hold them up), in the order they were made, so the result comes
after its last piece of tokens; TextStream holds back
what may still change. Joined, the pieces are the result's text. Leaving the iteration early
cancels the prompt. A backend that does not stream tokens (a pool, Ray) gives the text whole."""
from __future__ import annotations

import asyncio
import queue
from typing import AsyncIterator, Iterator

from .batch import Batch, _call_soon
from .callbacks import on_callback_thread
from .result import Result
from .text_stream import TextStream

POLL_S = 1.0  # how often a wait for the next piece looks whether the batch has finished


def text_pieces(batch: Batch, decode) -> Iterator[str]:
    if on_callback_thread():  # inside a callback no other callback runs: the text comes whole
        yield from _whole(batch, batch.wait()[0])
        return
    q: queue.SimpleQueue = queue.SimpleQueue()
    # Both on the engine's thread, in the order they are made: the shared callback thread could
    # be held by another batch's callback (a stream froze for as long as that callback ran).
    batch._add_on_tokens(lambda _, ids: q.put(ids), last=False, inline=True)  # the end comes from the result
    batch._subscribe(lambda _, r: q.put(r))
    stream = TextStream(decode, batch.stop_strings(0))
    try:
        batch.start()
        while True:
            try:
                got = q.get(timeout=POLL_S)
            except queue.Empty:
                if batch.finished and q.empty():  # its callbacks ran: the result is in the queue or lost
                    got = batch.results[0]
                else:
                    continue
            if isinstance(got, Result):
                batch.raise_for(got)
                piece = stream.finish(got.text)
                if piece:
                    yield piece
                return
            piece = stream.push(got)
            if piece:
                yield piece
    finally:
        if not batch.done:
            batch.cancel()


async def atext_pieces(batch: Batch, decode) -> AsyncIterator[str]:
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    batch._add_on_tokens(lambda _, ids: _call_soon(loop, q.put_nowait, ids), last=False, inline=True)
    batch._subscribe(lambda _, r: _call_soon(loop, q.put_nowait, r))
    stream = TextStream(decode, batch.stop_strings(0))
    try:
        batch.start()
        while True:
            try:
                got = await asyncio.wait_for(q.get(), POLL_S)
            except asyncio.TimeoutError:
                if batch.finished and q.empty():
                    got = batch.results[0]
                else:
                    continue
            if isinstance(got, Result):
                batch.raise_for(got)
                piece = stream.finish(got.text)
                if piece:
                    yield piece
                return
            piece = stream.push(got)
            if piece:
                yield piece
    finally:
        if not batch.done:
            batch.cancel()


def _whole(batch: Batch, result: Result) -> Iterator[str]:
    batch.raise_for(result)
    if result.text:
        yield result.text
