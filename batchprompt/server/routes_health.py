"""GET /health (the process answers), /ready (the model is loaded), /metrics (Prometheus).
None of them needs the API key: load balancers and scrapers call them."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from .errors import ApiError
from .metrics import CONTENT_TYPE

router = APIRouter()


@router.get("/health")
async def health() -> dict:
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    state = request.app.state.server
    if state.ready:
        return JSONResponse({"status": "ready", "model": state.model_id})
    try:
        state.service()
        status = "not_ready"
    except ApiError as e:
        status = e.code
    return JSONResponse({"status": status, "model": state.model_id}, status_code=503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    # Reading the engine's stats waits for the step in progress: off the event loop.
    text = await asyncio.to_thread(request.app.state.metrics.render)
    return Response(text, media_type=CONTENT_TYPE)
