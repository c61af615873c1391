"""Replica: one engine in a Ray actor, loaded once, fed blocks of prompts by the driver.

The actor holds the local backend (`EngineService`: an engine stepped on its own thread), so a
replica batches, caches prefixes, isolates bad prompts and answers every request exactly as a
local run does. It is an async actor: many `run_block` calls are in flight at once (several
blocks keep the engine's batch full), each returning its block's `RequestOutput`s, in the
block's order, once the last of them is done. The engine's prefix cache outlives a block, so a
system prompt shared by many blocks is computed once per replica.

This module imports no Ray: `cluster.py` wraps the class with `ray.remote` and its options.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Any

from ..engine import EngineStats, RequestOutput, SamplingParams

log = logging.getLogger("batchprompt")


@dataclasses.dataclass(frozen=True)
class ReplicaInfo:
    """What the driver learns from a replica once it has loaded its model."""

    pid: int
    node_id: str
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    model_name: str


class Replica:
    def __init__(self, model: str | None, device: str, dtype: str, engine_options: dict,
                 threads: int | None) -> None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        import torch

        from ..api.service import EngineService, build_engine
        from ..models import resolve_model

        if threads:
            torch.set_num_threads(threads)
        source = resolve_model(model)
        self._model_name = source.name
        self._service = EngineService(  # built on the service's engine thread
            lambda: build_engine(str(source.path), device, dtype, engine_options), name=f"replica{os.getpid()}")
        self._blocks: dict[int, Any] = {}  # block id -> its Source, while it runs

    def info(self) -> ReplicaInfo:
        import ray

        engine = self._service.engine
        eos = engine.eos_token_ids
        return ReplicaInfo(os.getpid(), ray.get_runtime_context().get_node_id(), engine.max_model_len,
                           tuple(sorted(eos)), self._model_name)

    async def run_block(self, block_id: int, prompts: list[tuple[list[int], SamplingParams]]) -> list[RequestOutput]:
        """Run a block of prompts; their outputs in the block's order. Each prompt fails alone
        (its output carries the error), as in a local run."""
        from ..backends.base import Item, Source

        if self._service.stopped:
            # The engine thread died (a bug): this process cannot run prompts any more. Exiting
            # makes Ray restart the replica with a fresh engine, and the driver re-sends the block.
            log.error("the replica's engine stopped (%s); restarting the replica", self._service.stop_reason)
            os._exit(1)
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        left = [len(prompts)]

        def finish() -> None:
            if not done.done():
                done.set_result(None)

        def on_done(index: int):
            def record(out: RequestOutput) -> None:  # on the engine thread: quick
                if outputs[index] is None:
                    outputs[index] = out
                    left[0] -= 1
                    if left[0] == 0:
                        loop.call_soon_threadsafe(finish)
            return record

        source = Source()
        for i, (ids, params) in enumerate(prompts):
            source.items.append(Item(list(ids), params, on_done(i)))
        self._blocks[block_id] = source
        try:
            if prompts:
                self._service.submit(source)
                await done
        finally:
            self._blocks.pop(block_id, None)
        return outputs  # type: ignore[return-value]  (every one is set: left reached 0)

    async def cancel_block(self, block_id: int) -> None:
        """Drop the block's prompts not started and abort those running (each still comes back
        from run_block, 'abort')."""
        source = self._blocks.get(block_id)
        if source is None:
            return

        def on_pending(item) -> None:
            item.on_done(RequestOutput("", item.token_ids, [], "", "abort"))
        await asyncio.wrap_future(self._service.cancel(source, on_pending))

    async def pin_prefix(self, name: str, token_ids: list[int]) -> int:
        return await asyncio.wrap_future(self._service.pin_prefix(name, token_ids))

    async def unpin(self, name: str) -> None:
        self._service.close_session(name)

    async def stats(self) -> EngineStats:
        return await asyncio.wrap_future(self._service.call(lambda: dataclasses.replace(self._service.engine.stats)))
