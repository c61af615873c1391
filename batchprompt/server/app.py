"""create_app: the FastAPI app of `batchprompt serve`.

Routes live in routes_*.py, one file per family, each an APIRouter included here: the health
routes, OpenAI's completions and chat, vLLM's tokenizer routes, the batch endpoints, and
OpenAI's Files and Batch API.
Middleware, outermost first: metrics (and each answer's X-Request-Id), the shutdown's cut of
transfers blocked on their client (transfers.py), CORS (with
--allowed-origins), the API key (every /v1 route), the body size limit."""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from . import routes_batch, routes_batch_api, routes_files, routes_health, routes_openai, routes_tokens
from .config import ServerConfig
from .errors import JSONAnswer, install_handlers
from .metrics import Metrics
from .middleware import LimitBody, RecordMetrics, RequireApiKey
from .openapi import openapi_schema
from .state import SHUTTING_DOWN, ServerState, close
from .transfers import EndOnShutdown


def create_app(config: ServerConfig, state: ServerState | None = None) -> FastAPI:
    """The app. It loads the model when it starts (lifespan), if it is not loaded yet."""
    state = state or ServerState(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        state.load()  # blocking: nothing is served before the model is there
        await state.batch_api.start()  # batches left unfinished by an earlier run resume
        try:
            yield
        finally:
            await close(state)

    # No /docs page: the API is OpenAI's, documented there and in the README. /openapi.json
    # describes the routes with their bodies (openapi.py), for tools (schemathesis fuzzes it).
    # JSONAnswer: a route's dict is written by errors.JSONAnswer (a lone surrogate escaped), not by
    # pydantic's fast path, which refused one.
    app = FastAPI(title="batchprompt", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json",
                  default_response_class=JSONAnswer)
    app.openapi = lambda: openapi_schema(app, api_key=config.api_key is not None)
    app.state.server = state
    app.state.metrics = metrics = Metrics(state)
    modules = (routes_health, routes_openai, routes_tokens, routes_batch, routes_files, routes_batch_api)
    for module in modules:
        app.include_router(module.router)
    install_handlers(app)
    # add_middleware wraps what is there: the last added runs first.
    app.add_middleware(LimitBody, limit=config.max_body_bytes, uploads={"/v1/files": config.max_file_bytes})
    app.add_middleware(RequireApiKey, api_key=config.api_key)
    if config.allowed_origins:  # outside the key check: a browser's preflight carries no key
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["x-request-id"])
    app.add_middleware(EndOnShutdown, transfers=state.transfers, message=SHUTTING_DOWN)
    app.add_middleware(RecordMetrics, metrics=metrics, routes=[r for m in modules for r in m.router.routes])
    return app
