"""Request bodies: read as JSON (400 if not, 413 above the limit) and checked against a schema
of the fields' types (422 naming each wrong field). The completion endpoints' bodies are
jobs.bodies', shared with the Batch API's rows and `batchprompt run`. Values are checked later,
by the code that uses them (SamplingParams, the job reader, OutputSpec), with their messages
(400).

The models are strict (no "1" for 1) and allow other fields. The Batch API's create is the
exception: as OpenAI's, it answers 400 naming a field it does not know."""
from __future__ import annotations

from typing import Any, Type

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import ClientDisconnect

from ..jobs.bodies import StrictBody, whole_numbers
from ..jobs.rows import json_loads, json_type
from .errors import ApiError

CLIENT_GONE = 499  # nginx's "client closed request": what the metrics count it as


class BatchRequest(StrictBody):
    """/v1/batch/sync and /async: prompts, a shared system prompt, the batch API's options."""

    #: Each a string or a list of chat messages; an item of another type is that item's error
    #: (as in the Python API), not the whole request's: one null from a bad cell lost every prompt.
    prompts: list[Any]
    system: str | None = None
    model: str | None = None
    callback_url: str | None = None


async def read_json(request: Request, schema: Type[BaseModel]) -> dict[str, Any]:
    """The body as a dict that fits `schema`'s types."""
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise ApiError(CLIENT_GONE, "the client went away while sending the body", "client_disconnected") from None
    try:
        obj = json_loads(raw)
    except ValueError as e:  # JSONDecodeError, and bytes that are not UTF-8
        raise ApiError(400, f"the body is not valid JSON ({e}); send a JSON object with "
                            f"Content-Type: application/json", "invalid_json") from None
    if not isinstance(obj, dict):
        raise ApiError(400, f"the body must be a JSON object, got {json_type(obj)}", "invalid_json")
    if schema.model_config.get("extra") == "forbid":
        unknown = [k for k in obj if k not in schema.model_fields]
        if unknown:
            raise ApiError(400, f"Unknown parameter: {unknown[0]!r}. This endpoint takes "
                                f"{', '.join(schema.model_fields)}", "unknown_parameter", unknown[0])
    obj = whole_numbers(schema, obj)  # "max_tokens": 5.0 is 5, as vLLM takes it
    try:
        schema.model_validate(obj)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None
    return obj


class TokenizeRequest(StrictBody):
    """POST /tokenize, as vLLM's: a completion's `prompt`, or chat `messages` with the chat
    template's fields."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(StrictBody):
    """POST /detokenize, as vLLM's: token ids back to text."""

    model: str | None = None
    tokens: list[int]


class BatchCreate(StrictBody):
    """POST /v1/batches (OpenAI's fields, and only those: a misspelt one is a 400, not ignored)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None  # {"anchor": "created_at", "seconds": N}


def query_int(request: Request, name: str, default: int, low: int, high: int) -> int:
    """A whole-number query parameter from `low` to `high` (400 naming it otherwise)."""
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise ApiError(400, f"{name} must be a whole number from {low} to {high}, got {raw!r}", "invalid_parameter",
                       name)
    return value
