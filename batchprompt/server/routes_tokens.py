"""vLLM's tokenizer routes: POST /tokenize (a prompt, or chat messages through the chat template,
as a request would be rendered), POST /detokenize, and GET /version. As in vLLM they are outside
/v1, so they need no API key."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from .errors import ApiError
from .openapi import package_version
from .requests import prompt_ids
from .schemas import DetokenizeRequest, TokenizeRequest, read_json
from .state import ServerState

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request) -> dict:
    state: ServerState = request.app.state.server
    body = await read_json(request, TokenizeRequest)
    state.check_model(body.get("model"))
    if (body.get("prompt") is None) == (body.get("messages") is None):
        raise ApiError(400, "give either prompt (a completion's text) or messages (a chat), one of them",
                       "invalid_request", "prompt")
    service = state.service()
    tokenizer = service.tokenizer
    ids = await asyncio.to_thread(prompt_ids, body, tokenizer)  # the tokenizer's lock and CPU: off the loop
    strs = tokenizer.hf.convert_ids_to_tokens(ids) if body.get("return_token_strs") else None
    return {"count": len(ids), "max_model_len": service.max_model_len, "tokens": ids, "token_strs": strs}


@router.post("/detokenize")
async def detokenize(request: Request) -> dict:
    state: ServerState = request.app.state.server
    body = await read_json(request, DetokenizeRequest)
    state.check_model(body.get("model"))
    tokenizer = state.service().tokenizer
    vocab = tokenizer.vocab_size
    bad = next((t for t in body["tokens"] if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is not in the vocabulary (0 to {vocab - 1})", "invalid_value", "tokens")
    return {"prompt": await asyncio.to_thread(tokenizer.decode, body["tokens"], False)}


@router.get("/version")
async def version() -> dict:
    return {"version": package_version()}
