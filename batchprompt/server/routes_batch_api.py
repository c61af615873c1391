"""OpenAI's Batch API routes (the official `openai` client's client.batches.* call them):

    POST /v1/batches               {input_file_id, endpoint, completion_window, metadata?} -> Batch
    GET  /v1/batches               after, limit (1-100, default 20), newest first -> list
    GET  /v1/batches/{id}          Batch
    POST /v1/batches/{id}/cancel   Batch (cancelled, or cancelling if it takes longer than 5 s)

The endpoints a batch may run: /v1/chat/completions and /v1/completions."""
from __future__ import annotations

from fastapi import APIRouter, Request

from .routes_files import batch_api, page
from .schemas import BatchCreate, query_int, read_json

router = APIRouter()


@router.post("/v1/batches")
async def create_batch(request: Request) -> dict:
    body = await read_json(request, BatchCreate)
    return await batch_api(request).create(body)


@router.get("/v1/batches")
async def list_batches(request: Request) -> dict:
    limit = query_int(request, "limit", 20, 1, 100)
    data, more = await batch_api(request).list_batches(request.query_params.get("after"), limit)
    return page(data, more)


@router.get("/v1/batches/{batch_id}")
async def get_batch(batch_id: str, request: Request) -> dict:
    return await batch_api(request).get_batch(batch_id)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request) -> dict:
    return await batch_api(request).cancel(batch_id)
