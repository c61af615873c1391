"""aurora_swarm's methods and patterns on an EndpointPool, async as there, so its users can switch:

    pool = bp.EndpointPool("hosts.txt", model=...)
    responses = await pool.send_all_batched(prompts, max_tokens=256)   # input order
    responses = await scatter_gather(pool, prompts)
    summary = await tree_reduce(pool, "Summarize {item}", "Combine:\\n{responses}", items=docs)

What differs from aurora's VLLMPool: `send_all_batched` goes through the pool (sub-batches sized
by tokens, least-loaded routing with prefix affinity, retries, dead endpoints drained), not one
list request per endpoint; prompts are rendered client-side with the model's chat template (a
user message each), so the servers get token ids; the default temperature is 0 (greedy), as in
the rest of batchprompt (pass temperature= for sampling). `post_batch(i, prompts)` still sends
to endpoint i alone, in sub-batches, retried there. `post`, `send_all` and `broadcast_prompt`
send one /v1/chat/completions per prompt, as aurora does.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..backends.base import BULK, Item, Source
from ..engine import RequestOutput, SamplingParams
from . import wire
from .endpoint import backoff
from .errors import EndpointError

if TYPE_CHECKING:
    from .backend import RemoteBackend


@dataclass
class Response:
    """One prompt's answer, in aurora_swarm's shape."""

    success: bool
    text: str
    error: str | None = None
    agent_index: int | None = None


class SwarmMethods:
    """Mixed into EndpointPool."""

    # ---- batched: through the pool ---------------------------------------------------------------
    async def send_all_batched(self, prompts: list[str], max_tokens: int | None = None, **options: Any) -> list[Response]:
        """Every prompt through the pool (sub-batches, routing, retries); responses in input order.
        `options`: SamplingParams fields (temperature, top_p, seed, stop, ...)."""
        if not self.use_batch:
            return await self.send_all(prompts, max_tokens, **options)
        if not prompts:
            return []
        backend: RemoteBackend = self.as_backend()
        params = self._params(max_tokens, options)
        ids = await asyncio.to_thread(lambda: [backend.tokenizer.encode_prompt(_check_prompt(p, i))
                                               for i, p in enumerate(prompts)])
        outputs = await _run_items(backend, ids, params)
        return [_response(out) for out in outputs]

    async def post_batch(self, agent_index: int, prompts: list[str], max_tokens: int | None = None,
                         **options: Any) -> list[Response]:
        """`prompts` to endpoint `agent_index` only, in sub-batches (/v1/completions, a list of
        token-id prompts each), retried there; responses in input order."""
        backend: RemoteBackend = self.as_backend()
        e = self._endpoint(backend, agent_index)
        if not prompts:
            return []
        params = self._params(max_tokens, options)
        ids = await asyncio.to_thread(lambda: [backend.tokenizer.encode_prompt(_check_prompt(p, i))
                                               for i, p in enumerate(prompts)])
        fut = backend.run_coroutine(self._post_batch_on_loop(backend, e, ids, params))
        return await asyncio.wrap_future(fut)

    async def _post_batch_on_loop(self, backend, e, ids: list[list[int]], params: SamplingParams) -> list[Response]:
        out: list[Response] = []
        chunk: list[list[int]] = []
        tokens = 0
        chunks = []
        for p in ids:
            cost = len(p) + params.max_tokens
            if chunk and (tokens + cost > self.batch_tokens or len(chunk) >= self.batch_prompts):
                chunks.append(chunk)
                chunk, tokens = [], 0
            chunk.append(p)
            tokens += cost
        chunks.append(chunk)
        results = await asyncio.gather(*(self._one_chunk(backend, e, c, params) for c in chunks))
        for r in results:
            out += r
        return out

    async def _one_chunk(self, backend, e, prompts: list[list[int]], params: SamplingParams) -> list[Response]:
        body = wire.completion_body(backend.model, prompts, params, self.structured)
        last: EndpointError | None = None
        start = time.monotonic()
        for attempt in range(self.max_retries + 1):  # at least once: max_retries >= 0
            tokens = sum(len(p) + params.max_tokens for p in prompts)
            e.begin(tokens)
            try:
                data = await e.post_json("/v1/completions", body)
                per = wire.parse_completions(data, len(prompts), params.n, e.url)
            except EndpointError as err:
                e.end(tokens)
                last = err
                if err.kind == "request":
                    break
                await asyncio.sleep(err.retry_after if err.retry_after is not None else backoff(self.backoff_s, attempt + 1))
                continue
            e.end(tokens, tokens)
            e.counters.prompts += len(prompts)
            return [Response(True, samples[0].text, None, e.index) for samples in per]
        return [Response(False, "", _gave_up(last, attempt + 1, start), e.index) for _ in prompts]

    # ---- one request per prompt (aurora's post / send_all / broadcast_prompt) ---------------------
    async def post(self, agent_index: int, prompt: str, max_tokens: int | None = None, **options: Any) -> Response:
        """One /v1/chat/completions request to endpoint `agent_index` (retried there)."""
        backend: RemoteBackend = self.as_backend()
        e = self._endpoint(backend, agent_index)
        params = self._params(max_tokens, options)
        fut = backend.run_coroutine(self._chat_on_loop(backend, [e], _check_prompt(prompt, 0), params))
        return await asyncio.wrap_future(fut)

    async def send_all(self, prompts: list[str], max_tokens: int | None = None, **options: Any) -> list[Response]:
        """One /v1/chat/completions request per prompt, to the least loaded live endpoint (another
        one on a failure); responses in input order."""
        backend: RemoteBackend = self.as_backend()
        params = self._params(max_tokens, options)
        futs = [backend.run_coroutine(self._chat_on_loop(backend, None, _check_prompt(p, i), params))
                for i, p in enumerate(prompts)]
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futs)))

    async def broadcast_prompt(self, prompt: str, max_tokens: int | None = None, **options: Any) -> list[Response]:
        """The same prompt to every endpoint, one answer each (in endpoint order)."""
        return list(await asyncio.gather(*(self.post(i, prompt, max_tokens, **options) for i in range(self.size))))

    async def _chat_on_loop(self, backend, fixed, prompt: str, params: SamplingParams) -> Response:
        body = {"model": backend.model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": params.max_tokens, "temperature": params.temperature}
        if params.seed is not None:
            body["seed"] = params.seed
        if params.stop:
            body["stop"] = list(params.stop)
        if params.top_p != 1.0:
            body["top_p"] = params.top_p
        last: EndpointError | None = None
        e = None
        start = time.monotonic()
        for attempt in range(self.max_retries + 1):  # at least once: max_retries >= 0
            candidates = fixed or [x for x in backend.endpoints if x.alive] or backend.endpoints
            e = min(candidates, key=lambda x: (x.in_flight / x.weight, x.outstanding_tokens))
            cost = params.max_tokens
            e.begin(cost)
            try:
                data = await e.post_json("/v1/chat/completions", body)
                text = data["choices"][0]["message"].get("content") or ""
            except EndpointError as err:
                e.end(cost)
                last = err
                if err.kind == "request":
                    break
                if fixed is None and err.kind == "connection":
                    backend._mark_dead(e, err.message)
                    continue
                await asyncio.sleep(err.retry_after if err.retry_after is not None else backoff(self.backoff_s, attempt + 1))
                continue
            except (KeyError, IndexError, TypeError, AttributeError) as err:
                e.end(cost)
                last = EndpointError("server", f"{e.url}: malformed chat answer ({type(err).__name__}: {err})")
                continue
            e.end(cost, cost)
            e.counters.prompts += 1
            return Response(True, text, None, e.index)
        return Response(False, "", _gave_up(last, attempt + 1, start), None if e is None else e.index)

    # ---- helpers ----------------------------------------------------------------------------------
    def _params(self, max_tokens: int | None, options: dict) -> SamplingParams:
        opts = {"temperature": 0.0, **options}
        return SamplingParams(max_tokens=max_tokens or self.max_tokens, **opts)

    def _endpoint(self, backend, agent_index: int):
        if not isinstance(agent_index, int) or not 0 <= agent_index < len(backend.endpoints):
            raise IndexError(f"agent_index must be from 0 to {len(backend.endpoints) - 1}, got {agent_index!r}")
        return backend.endpoints[agent_index]


def _gave_up(last: EndpointError | None, tries: int, start: float) -> str:
    """The last failure, and how many tries over how long it ended (a hanging endpoint's
    `timeout` is each try's, not the whole wait's)."""
    if tries <= 1:
        return str(last)
    return f"{last} (the last of {tries} tries over {time.monotonic() - start:.0f}s)"


# ---- aurora_swarm's patterns ----------------------------------------------------------------------
async def scatter_gather(pool, prompts: list[str], **options: Any) -> list[Response]:
    """Different prompts over the pool, gathered in input order."""
    return await pool.send_all_batched(prompts, **options)


async def map_gather(pool, items: list[Any], prompt_template: str, **options: Any) -> list[Response]:
    """`prompt_template` (with an `{item}` placeholder) filled with each item, scattered, gathered."""
    if "{item}" not in prompt_template:
        raise ValueError("prompt_template needs an {item} placeholder")
    return await scatter_gather(pool, [prompt_template.replace("{item}", str(it)) for it in items], **options)


async def tree_reduce(pool, prompt: str, reduce_prompt: str, fanin: int = 50, items: list[Any] | None = None,
                      **options: Any) -> Response:
    """Leaf answers (the prompt filled with each item, or the prompt broadcast to every endpoint),
    then groups of `fanin` answers summarized by `reduce_prompt` ({responses}, optional {level}),
    level after level, until one answer remains."""
    if fanin < 2:
        raise ValueError(f"fanin must be >= 2, got {fanin}")
    if "{responses}" not in reduce_prompt:
        raise ValueError("reduce_prompt needs a {responses} placeholder")
    if items is not None:
        leaves = await pool.send_all_batched([prompt.replace("{item}", str(it)) for it in items], **options)
    else:
        leaves = await pool.broadcast_prompt(prompt, **options)
    current = [r.text for r in leaves if r.success]
    level = 1
    while len(current) > 1:
        groups = [current[i:i + fanin] for i in range(0, len(current), fanin)]
        prompts = [reduce_prompt.replace("{responses}", "\n---\n".join(g)).replace("{level}", str(level)) for g in groups]
        current = [r.text for r in await pool.send_all_batched(prompts, **options) if r.success]
        level += 1
    if not current:
        return Response(False, "", "every agent failed during the reduction")
    return Response(True, current[0])


# ---- bridging the pool's loop and the caller's -------------------------------------------------------
async def _run_items(backend, ids: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
    """Submit one item per prompt; the outputs in input order once all are in (a cancelled
    caller cancels what has not finished)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    outputs: list[RequestOutput | None] = [None] * len(ids)
    left = [len(ids)]

    def finish() -> None:
        if not done.done():
            done.set_result(None)

    def handler(i: int):
        def on_done(out: RequestOutput) -> None:  # on the pool's loop thread
            outputs[i] = out
            left[0] -= 1
            if left[0] == 0:
                loop.call_soon_threadsafe(finish)
        return on_done

    source = Source(priority=BULK)
    for i, p in enumerate(ids):
        source.items.append(Item(p, params, handler(i)))
    backend.submit(source)
    try:
        await done
    except asyncio.CancelledError:
        backend.cancel(source, lambda item: item.on_done(RequestOutput("", item.token_ids, [], "", "abort")))
        raise
    return outputs  # type: ignore[return-value]


def _response(out: RequestOutput) -> Response:
    if out.error is not None or out.finish_reason in ("error", "abort"):
        return Response(False, out.text, out.error or "cancelled")
    return Response(True, out.text)


def _check_prompt(p: Any, i: int) -> str:
    if not isinstance(p, str):
        raise TypeError(f"prompt {i} is a {type(p).__name__}: the swarm methods take strings")
    return p
