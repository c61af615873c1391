"""OpenAI's routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions.

Each route parses, hands the prompts to the process's engine as one batch, and shapes the
answer; every request is batched with every other (and with in-process callers) by the engine."""
from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ..api.batch import Batch
from ..jobs.bodies import ChatRequest, CompletionRequest
from . import responses, waiting
from .errors import ApiError
from .middleware import client_request_id
from .requests import plan_chat, plan_completion, vocabulary_problem
from .schemas import read_json
from .state import ServerState

router = APIRouter()


def server_state(request: Request) -> ServerState:
    return request.app.state.server


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    state = server_state(request)
    # As vLLM: each --served-model-name is a model card (the first is the one answers carry by default)
    return {"object": "list", "data": [_model(state, name) for name in state.config.served_model_names or
                                       (state.model_id,)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict:
    state = server_state(request)
    state.check_model(model_id)
    return _model(state, model_id if model_id in state.config.served_model_names else state.model_id)


def _model(state: ServerState, name: str) -> dict:
    card = {"id": name, "object": "model", "created": state.created, "owned_by": "batchprompt"}
    if state.max_model_len is not None:  # as vLLM's model card has it (a pool of servers reads it)
        card["max_model_len"] = state.max_model_len
    return card


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    return await _complete(request, ChatRequest, plan_chat, chat=True)


@router.post("/v1/completions")
async def completions(request: Request):
    return await _complete(request, CompletionRequest, plan_completion, chat=False)


async def _complete(request: Request, schema, plan_fn, chat: bool):
    state = server_state(request)
    body = await read_json(request, schema)
    # stream_options without stream: refused with the body's other fields (jobs.refusals)
    state.check_model(body.get("model"))
    # The answer carries the name the request gave (one of the model's), as vLLM's does
    model = body.get("model") or state.model_id
    service = state.service()
    # Rendering and tokenizing take the tokenizer's lock and some CPU: off the event loop.
    # The answer's id is the client's request id where it gave one, as vLLM makes it
    # (chatcmpl-<X-Request-Id>, else the body's request_id), so logs on both sides match.
    rid = getattr(request.state, "client_request_id", None) or client_request_id(body.get("request_id"))
    plan = await asyncio.to_thread(plan_fn, body, service.tokenizer, service.max_model_len, rid)
    refused = vocabulary_problem(plan, service.vocab_size)
    if refused is not None:
        raise refused
    batch = Batch(service, plan.prepared)
    created = int(time.time())
    if body.get("stream"):
        options = body.get("stream_options") or {}
        chunks = responses.Chunks(plan, chat, model, created, bool(options.get("include_usage")),
                                  bool(options.get("continuous_usage_stats")))
        if state.shutting_down:
            raise ApiError(503, "the server is shutting down", "shutting_down")
        return StreamingResponse(waiting.events(state, batch, chunks), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    results = await waiting.results(request, state, batch)
    failed = responses.failure(results, body, plan.several)
    if failed is not None:
        raise failed
    return responses.body(plan, results, model, created)
