"""The server's OpenAPI document, served at GET /openapi.json (no key needed, no /docs page).

The routes read their bodies themselves (schemas.read_json), so FastAPI's generated document
knows the paths but not the bodies: this adds them from the same pydantic models the routes
check against, the query parameters of the list routes, the upload's form, the content types
that are not JSON (a stream's events, /metrics, a file's bytes), and one error shape for every
other status (errors.error_body). Tools that fuzz or generate clients from it see what the
server really takes."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from ..jobs.bodies import ChatRequest, CompletionRequest
from .schemas import BatchCreate, BatchRequest, DetokenizeRequest, TokenizeRequest

_REF = "#/components/schemas/{model}"

#: (method, path) -> the model its JSON body is checked against.
BODIES: dict[tuple[str, str], type[BaseModel]] = {
    ("post", "/v1/chat/completions"): ChatRequest,
    ("post", "/v1/completions"): CompletionRequest,
    ("post", "/v1/batch/sync"): BatchRequest,
    ("post", "/v1/batch/async"): BatchRequest,
    ("post", "/v1/batches"): BatchCreate,
    ("post", "/tokenize"): TokenizeRequest,
    ("post", "/detokenize"): DetokenizeRequest,
}

_AFTER = {"name": "after", "in": "query", "required": False, "schema": {"type": "string"},
          "description": "the id of the last item of the previous page"}
QUERIES: dict[tuple[str, str], list[dict[str, Any]]] = {
    ("get", "/v1/batches"): [
        _AFTER, {"name": "limit", "in": "query", "required": False,
                 "schema": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20}}],
    ("get", "/v1/files"): [
        _AFTER, {"name": "limit", "in": "query", "required": False,
                 "schema": {"type": "integer", "minimum": 1, "maximum": 10000, "default": 10000}},
        {"name": "order", "in": "query", "required": False, "schema": {"enum": ["asc", "desc"], "default": "desc"}},
        {"name": "purpose", "in": "query", "required": False, "schema": {"type": "string"}}],
}

UPLOAD = {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {"file": {"type": "string", "format": "binary",
                            "description": "JSONL: one request per line (custom_id, method, url, body)"},
                   "purpose": {"type": "string", "enum": ["batch"]}}}}}}

#: One server-sent event of a stream (OpenAPI 3.1: the schema of text/event-stream is an event's).
EVENT = {"type": "object", "required": ["data"], "properties": {"data": {
    "type": "string", "description": "a JSON chunk, a JSON error object, or [DONE] (the last event)"}}}

#: (method, path) -> the content types of its success response, where not only JSON.
CONTENT: dict[tuple[str, str], dict[str, Any]] = {
    ("get", "/metrics"): {"text/plain": {"schema": {"type": "string"}}},
    ("get", "/v1/files/{file_id}/content"): {"application/octet-stream": {"schema": {"type": "string",
                                                                                      "format": "binary"}}},
    ("post", "/v1/chat/completions"): {"application/json": {"schema": {"type": "object"}},
                                       "text/event-stream": {"schema": EVENT}},
    ("post", "/v1/completions"): {"application/json": {"schema": {"type": "object"}},
                                  "text/event-stream": {"schema": EVENT}},
}

ERROR = {"type": "object", "required": ["error"], "additionalProperties": False, "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "additionalProperties": False,
    "properties": {"message": {"type": "string", "minLength": 1}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


def openapi_schema(app: FastAPI, api_key: bool = False) -> dict[str, Any]:
    """The document for `app` (computed once, then kept on the app, as FastAPI does)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(title="batchprompt", version=package_version(), routes=app.routes,
                      description="OpenAI-compatible: the bodies are OpenAI's (and vLLM's extra fields); "
                                  "every error is {\"error\": {message, type, param, code}}.")
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):  # the routes answer errors in OpenAI's shape
        schemas.pop(name, None)
    schemas["Error"] = ERROR
    if api_key:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, item in doc["paths"].items():
        for method, op in item.items():
            key = (method, path)
            if key in BODIES:
                op["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": _model_schema(BODIES[key], schemas)}}}
            elif key == ("post", "/v1/files"):
                op["requestBody"] = UPLOAD
            if key in QUERIES:
                op["parameters"] = op.get("parameters", []) + QUERIES[key]
            responses = {code: r for code, r in op["responses"].items() if code.startswith("2")}
            if key in CONTENT:
                for r in responses.values():
                    r["content"] = CONTENT[key]
            responses["default"] = {"description": "an error", "content": {"application/json": {
                "schema": {"$ref": _REF.format(model="Error")}}}}
            op["responses"] = responses
            if api_key and path.startswith("/v1/"):
                op["security"] = [{"bearer": []}]
    app.openapi_schema = doc
    return doc


def _model_schema(model: type[BaseModel], schemas: dict[str, Any]) -> dict[str, Any]:
    """`model`'s JSON schema in components (its nested models beside it); a $ref to it."""
    schema = model.model_json_schema(ref_template=_REF)
    for name, sub in schema.pop("$defs", {}).items():
        schemas[name] = sub
    schemas[model.__name__] = schema
    return {"$ref": _REF.format(model=model.__name__)}


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("batchprompt")
    except PackageNotFoundError:
        return "0.0.0"
