"""OpenAI's Batch API routes (the official `openai` client's client.batches.* call them):

    POST /v1/batches               {input_file_id, endpoint, completion_window, metadata?} -> Batch
    GET  /v1/batches               after, limit (1-100, default 20), newest first -> list
    GET  /v1/batches/{id}          Batch
    POST /v1/batches/{id}/cancel   Batch (cancelled, or cancelling if it takes longer than 5 s)

The endpoints a batch may run: /v1/chat/completions and /v1/completions."""
from __future__ import annotations

from fastapi import APIRouter, Request

from .errors import JSONAnswer
from .routes_files import batch_api, page
from .schemas import BatchCreate, query_int, read_json

router = APIRouter()
# Each answer is a JSONAnswer of its own: FastAPI's writer of a route's dict goes through pydantic,
# which refused a lone surrogate in a key of the metadata of a batch an earlier version stored.


@router.post("/v1/batches")
async def create_batch(request: Request) -> dict:
    body = await read_json(request, BatchCreate)
    return JSONAnswer(await batch_api(request).create(body))


@router.get("/v1/batches")
async def list_batches(request: Request) -> dict:
    limit = query_int(request, "limit", 20, 1, 100)
    data, more = await batch_api(request).list_batches(request.query_params.get("after"), limit)
    return JSONAnswer(page(data, more))


@router.get("/v1/batches/{batch_id}")
async def get_batch(batch_id: str, request: Request) -> dict:
    return JSONAnswer(await batch_api(request).get_batch(batch_id))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request) -> dict:
    return JSONAnswer(await batch_api(request).cancel(batch_id))
