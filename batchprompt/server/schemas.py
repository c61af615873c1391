"""Request bodies: read as JSON (400 if not, 413 above the limit) and checked against a schema
of the fields' types (422 naming each wrong field). Values are checked later, by the code that
uses them (SamplingParams, the job reader, OutputSpec), with their messages (400).

The models are strict (no "1" for 1) and allow other fields: vLLM's extra parameters and
OpenAI's fields we ignore pass through to the job reader, which knows them. The Batch API's
create is the exception: as OpenAI's, it answers 400 naming a field it does not know."""
from __future__ import annotations

from typing import Any, Type

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import ClientDisconnect

from ..jobs.rows import CHAT, COMPLETION, json_loads, json_type
from .errors import ApiError, validation_error

CLIENT_GONE = 499  # nginx's "client closed request": what the metrics count it as


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Body):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: the usage so far in every chunk


class _OpenAIBody(_Body):
    model: str | None = None  # vLLM lets it out; OpenAI's clients always send it
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_choice: list[str] | None = None
    guided_regex: str | None = None
    guided_json: Any = None  # a schema object, or its JSON text
    guided_grammar: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None  # JSON keys are text: token ids as strings
    include_stop_str_in_output: bool | None = None
    best_of: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None


class ChatRequest(_OpenAIBody):
    messages: list[Any]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class CompletionRequest(_OpenAIBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: bool | int | None = None  # k top tokens; true/false as a Batch API row takes them
    echo: bool | None = None


#: The body each endpoint takes (a Batch API row's too).
ENDPOINT_BODIES: dict[str, Type[BaseModel]] = {CHAT: ChatRequest, COMPLETION: CompletionRequest}


def body_type_error(url: str, body: dict[str, Any]) -> ApiError | None:
    """The 422 that the endpoint `url` answers `body` with for a field of the wrong type, if any
    (a Batch API row's error is the endpoint's answer to the same body)."""
    try:
        ENDPOINT_BODIES[url].model_validate(body)
    except ValidationError as e:
        return validation_error(e.errors())
    return None


class BatchRequest(_Body):
    """/v1/batch/sync and /async: prompts, a shared system prompt, the batch API's options."""

    prompts: list[str | list[dict[str, Any]]]
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
    try:
        schema.model_validate(obj)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None
    return obj


class BatchCreate(_Body):
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
