"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, one status each.

Routes raise ApiError (or let FastAPI/Starlette raise theirs); the handlers here turn every one
into the same JSON body, so a client reads one shape whatever went wrong."""
from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..jobs.bodies import wrong_types
from ..jobs.openai_io import error_type
from ..jobs.storage import StorageError

log = logging.getLogger("batchprompt")



class JSONAnswer(JSONResponse):
    """A JSON answer that also carries a lone surrogate ("\\ud800", valid JSON that a client may
    send, and its error message or a batch's metadata may repeat), written as JSON's own escape.
    Starlette's encoding of it raised (a 500, then a dropped connection), and pydantic's, of a
    batch stored with such metadata, failed every later list of batches."""

    def render(self, content: Any) -> bytes:
        # Outside strings json.dumps writes ASCII alone, so a surrogate can only be inside one,
        # where backslashreplace's "\\udXXX" is exactly JSON's escape of it.
        return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None,
                          separators=(",", ":")).encode("utf-8", "backslashreplace")


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type(status),
                      "param": param, "code": code}}


def error_response(status: int, message: str, code: str | None = None, param: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONAnswer(error_body(status, message, code, param), status_code=status, headers=headers)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return error_response(e.status, e.message, e.code, e.param)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        if e.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see GET /v1/models and the README"
            return error_response(404, message, "not_found")
        if e.status_code == 405:
            return error_response(405, f"{request.method} is not allowed on {request.url.path}",
                                  "method_not_allowed", headers=e.headers)
        return error_response(e.status_code, str(e.detail), None, headers=e.headers)

    @app.exception_handler(StorageError)
    async def _storage_error(request: Request, e: StorageError) -> JSONResponse:
        # A full disk under --data-dir: the request's change is rolled back; what was kept stays.
        log.error("%s %s: %s", request.method, request.url.path, e)
        return error_response(507, f"the server cannot store this: {e}", "storage_error")

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return validation_response(e.errors())

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(e).__name__}: {e}", "internal_error")


def validation_response(errors) -> JSONResponse:
    e = validation_error(errors)
    return error_response(e.status, e.message, e.code, e.param)


def validation_error(errors) -> ApiError:
    """422 `invalid_type` naming the first field that is wrong (jobs.bodies.wrong_types)."""
    message, param = wrong_types(errors)
    return ApiError(422, message, "invalid_type", param)
