"""The batch endpoints, in the batch API's terms (greedy and 256 tokens unless told):

    POST /v1/batch/sync    {prompts, system?, max_tokens?, temperature?, ...}  -> results in input order
    POST /v1/batch/async   {..., callback_url?}                              -> {batch_id}
    GET  /v1/batch/{id}    status, progress (done/total, failed, tokens/s, ETA); results when done
    POST /v1/batch/{id}/cancel
    GET  /v1/batch/stats   the engine's stats

A prompt is a string or a list of chat messages; options are the batch API's (`max_tokens`,
`temperature`, `top_p`, `top_k`, `seed`, `stop`, `logprobs`, `choices`, `choice_mode`, `regex`,
`json_schema`, `response_format`, `grammar`). A prompt that fails carries its error in its
result; the others are unaffected. An async batch runs at bulk priority, behind chat and
completion requests (never starved); a sync batch, whose client waits, runs beside them."""
from __future__ import annotations

import asyncio
import threading
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..api.session import LanguageModel
from ..backends import BULK, INTERACTIVE
from ..jobs import refusals
from ..jobs.rows import MAX_N
from . import waiting
from .batches import AsyncBatch, check_callback_url, redacted
from .errors import ApiError, JSONAnswer
from .responses import progress_json, result_json
from .schemas import BatchRequest, read_json
from .state import CANCEL_GRACE_S, SHUTTING_DOWN, ServerState

router = APIRouter()
_NOT_OPTIONS = ("prompts", "system", "model", "callback_url")


def server_state(request: Request) -> ServerState:
    return request.app.state.server


async def _prepare(request: Request, state: ServerState, body: dict, priority: int = INTERACTIVE):
    """A session with the body's system prompt, and its (unstarted) batch of the prompts at
    `priority` (a client waits on a sync batch; an async one runs behind interactive requests)."""
    state.check_model(body.get("model"))
    state.service()  # 503 while loading or shutting down
    options = {k: v for k, v in body.items() if k not in _NOT_OPTIONS}
    best_of = options.get("best_of")
    if best_of is not None and not (isinstance(best_of, int) and not isinstance(best_of, bool)
                                    and 1 <= best_of <= MAX_N):  # as /v1/completions: a million would hold the engine
        raise ApiError(400, f"best_of must be an integer from 1 to {MAX_N}, got {best_of!r}", "invalid_parameter",
                       "best_of")

    def build():
        # The same device and dtype as load(): the service it finds is the server's, not a second engine.
        c = state.config
        session = LanguageModel.create(system=body.get("system"), model=state.model_key, device=c.device,
                                       dtype=c.dtype)
        try:
            return session, session.create_batch(body["prompts"], priority=priority, **options)
        except BaseException:
            session.destroy()
            raise

    try:
        return await _unless_stopped(state, build)
    except (TypeError, ValueError) as e:  # an unknown option, a bad value, a bad system prompt
        raise ApiError(400, str(e), "invalid_parameter", refusals.param_named(str(e), body)) from None


async def _unless_stopped(state: ServerState, build):
    """`build()`'s (session, batch), made on a thread of its own: the session's system prompt waits
    for the engine. A 503 if the server stops and the engine has not answered CANCEL_GRACE_S later,
    or at once on a second Ctrl-C: a stuck engine held this request (and the stop) until uvicorn
    gave up on it with a 500. The thread is a daemon, which the event loop's end does not wait
    for; a session it makes after the 503 is destroyed."""
    loop = asyncio.get_running_loop()
    made: asyncio.Future = loop.create_future()

    def settle(value, error) -> None:
        if made.cancelled():
            if error is None:
                value[0].destroy()
        elif error is None:
            made.set_result(value)
        else:
            made.set_exception(error)

    def run() -> None:
        try:
            value, error = build(), None
        except BaseException as e:  # noqa: BLE001  (handed to the request, on the loop)
            value, error = None, e
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop is gone: nobody waits for this session any more
            if error is None:
                value[0].destroy()

    threading.Thread(target=run, name="batchprompt-prepare", daemon=True).start()
    stop = asyncio.ensure_future(state.stopping.wait())
    try:
        await asyncio.wait({made, stop}, return_when=asyncio.FIRST_COMPLETED)
        if not made.done():
            gone = asyncio.ensure_future(state.abandoned.wait())
            await asyncio.wait({made, gone}, timeout=CANCEL_GRACE_S, return_when=asyncio.FIRST_COMPLETED)
            gone.cancel()
    finally:
        stop.cancel()
        if not made.done():
            made.cancel()
    if made.cancelled():
        raise ApiError(503, SHUTTING_DOWN, "shutting_down")
    return made.result()


@router.post("/v1/batch/sync")
async def batch_sync(request: Request) -> dict:
    state = server_state(request)
    body = await read_json(request, BatchRequest)
    if body.get("callback_url") is not None:  # it was ignored: no webhook ever came
        raise ApiError(400, "callback_url applies to /v1/batch/async; /v1/batch/sync answers with the results",
                       "invalid_parameter", "callback_url")
    session, batch = await _prepare(request, state, body)
    try:
        results = await waiting.results(request, state, batch)
    finally:
        session.destroy()
    # A prompt refused before it ran (longer than the context, ...) costs nothing: its tokens
    # were counted (9,031 prompt tokens for one prompt that never ran).
    ran = [r for r in results if r.error is None or r.usage.completion_tokens]
    usage = {"prompt_tokens": sum(r.usage.prompt_tokens for r in ran),
             "completion_tokens": sum(r.usage.completion_tokens for r in ran)}
    return {"id": "batch_" + uuid.uuid4().hex, "object": "batch.sync", "model": state.model_id,
            "status": "completed", "progress": progress_json(batch.progress), "usage": usage,
            "results": [result_json(r) for r in results]}


@router.post("/v1/batch/async", status_code=202)
async def batch_async(request: Request) -> JSONResponse:
    state = server_state(request)
    body = await read_json(request, BatchRequest)
    url = body.get("callback_url")
    if url is not None:
        check_callback_url(url)
    session, batch = await _prepare(request, state, body, priority=BULK)
    job = AsyncBatch(batch, session, state.model_id, url)
    if url is not None:
        job.webhook = {"url": redacted(url), "status": "pending", "attempts": 0, "last_error": None}
    try:
        state.batches.add(job)  # 429 when full of running batches
    except ApiError:
        session.destroy()
        raise
    batch.start()
    job.task = asyncio.ensure_future(_finish(state, job))
    return JSONAnswer({"batch_id": job.id, "id": job.id, "object": "batch.async", "status": job.status,
                       "total": batch.total}, status_code=202)


async def _finish(state: ServerState, job: AsyncBatch) -> None:
    """Wait for the batch (cancelling this task cancels it), then call its webhook."""
    try:
        await job.batch.wait_async()
    finally:
        job.finished_at = time.time()
        job.ended.set()
        job.session.destroy()
    if job.callback_url is not None:
        await state.webhooks.deliver(job)


@router.get("/v1/batch/stats")
async def batch_stats(request: Request) -> dict:
    state = server_state(request)
    state.service()
    s = await asyncio.to_thread(state.engine_stats)
    if s is None:
        raise ApiError(503, "the engine is not running", "model_not_ready")
    engine = {"running": s.running, "waiting": s.waiting, "finished": s.finished, "failed": s.failed,
              "steps": s.steps, "prompt_tokens": s.prompt_tokens, "cached_prompt_tokens": s.cached_prompt_tokens,
              "prefix_cache_hit_rate": s.prefix_cache_hit_rate, "generation_tokens": s.decode_tokens,
              "generation_tokens_per_s": s.decode_tokens_per_s, "prefill_tokens_per_s": s.prefill_tokens_per_s,
              "preemptions": s.preemptions, "inside_steps": s.inside_steps, "kv_blocks_used": s.kv_blocks_used,
              "kv_blocks_total": s.kv_blocks_total,
              "kv_cache_usage": s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0}
    server = {"requests_in_flight": state.requests_in_flight(), "prompts_pending": state.prompts_pending(),
              "async_batches_running": state.batches.running(), "async_batches_kept": len(state.batches),
              "batch_api_batches_running": state.batch_api.running(),
              "requests_cancelled": dict(state.cancelled)}
    return {"model": state.model_id, "engine": engine, "server": server}


@router.get("/v1/batch/{batch_id}")
async def batch_status(batch_id: str, request: Request) -> dict:
    return (await _async_batch(request, batch_id)).to_json()


@router.post("/v1/batch/{batch_id}/cancel")
async def batch_cancel(batch_id: str, request: Request) -> dict:
    job = await _async_batch(request, batch_id)
    if job.finished_at is None:
        job.cancel_asked = True
        await job.batch.cancel_async()
        # The batch is done; its task records the end right after (bounded: never hang a request).
        await asyncio.wait({asyncio.ensure_future(job.ended.wait())}, timeout=5)
    return job.to_json()


async def _async_batch(request: Request, batch_id: str):
    """The async batch `batch_id`; a 404 that points to /v1/batches where the id is a Batch API
    batch's (the ids look alike: it said the batch was unknown or dropped)."""
    state = server_state(request)
    try:
        return state.batches.get(batch_id)
    except ApiError as e:
        if e.status == 404 and await asyncio.to_thread(state.batch_api.store.get_batch, batch_id) is not None:
            raise ApiError(404, f"{batch_id} is a Batch API batch, not an async one: GET /v1/batches/{batch_id} "
                                f"(POST /v1/batches/{batch_id}/cancel)", "batch_not_found", "batch_id") from None
        raise
