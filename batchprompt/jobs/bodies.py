"""The request bodies of /v1/chat/completions and /v1/completions, and the check of their
fields' types. One check serves the server's endpoints, a Batch API row's body and a `batchprompt
run` line's body, so that all three refuse a field of the wrong type alike: 422 `invalid_type`,
naming the field.

The models are strict (no "1" for 1) and allow other fields: vLLM's extra parameters and
OpenAI's fields we ignore pass through to the job reader, which knows them. Values are checked
later, by the code that uses them (SamplingParams, the job reader, OutputSpec), with their
messages (400)."""
from __future__ import annotations

import functools
import json
import types
import typing
from typing import Any, Type

from pydantic import BaseModel, ConfigDict, ValidationError

CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"


class StrictBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(StrictBody):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: the usage so far in every chunk


class _OpenAIBody(StrictBody):
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
    guided_json: dict[str, Any] | str | bool | None = None  # a schema object, its JSON text, or true (as vLLM)
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
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's log-prob, rank and k most likely
    # OpenAI's fields that we ignore, still of OpenAI's types ("user": 5 was taken)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None


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


def whole_numbers(schema: Type[BaseModel], body: dict[str, Any]) -> dict[str, Any]:
    """`body` with a whole-number float in an integer field as that integer (`"max_tokens": 5.0`,
    which JavaScript and a Python float send, and vLLM's models take); 5.5 is left to be refused."""
    fields = _integer_fields(schema)
    whole = {k: int(v) for k, v in body.items() if k in fields and _whole(v)}
    for k in _ID_LISTS:  # token ids: `"prompt": [2.0, 504.0]` (or a list of such lists)
        ids = body.get(k)
        if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
            if any(map(_has_whole_float, ids)):
                whole[k] = [_as_ints(x) if _has_whole_float(x) else x for x in ids]
        elif _has_whole_float(ids):
            whole[k] = _as_ints(ids)
    return {**body, **whole} if whole else body


_ID_LISTS = ("prompt", "stop_token_ids", "allowed_token_ids")


def _whole(v: Any) -> bool:
    return isinstance(v, float) and v.is_integer() and abs(v) < 2 ** 63


def _has_whole_float(ids: Any) -> bool:
    """A list of integers, some of them written as whole-number floats (and no other float)."""
    return (isinstance(ids, list) and any(_whole(x) for x in ids)
            and all(_whole(x) or (isinstance(x, int) and not isinstance(x, bool)) for x in ids))


def _as_ints(ids: list) -> list[int]:
    return [int(x) for x in ids]


@functools.cache  # per body model, not per body: a job's rows each ask
def _integer_fields(schema: Type[BaseModel]) -> frozenset[str]:
    """The fields of `schema` that take an integer and no float (max_tokens, n, seed, ...)."""
    def takes_int(annotation) -> bool:
        args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
        return (int in args and float not in args) if args else annotation is int

    return frozenset(name for name, f in schema.model_fields.items() if takes_int(f.annotation))


def type_problem(url: str, body: dict[str, Any], missing: bool = True) -> tuple[str, str | None] | None:
    """(message, param) of the 422 that the endpoint `url` answers `body` with for a field of
    the wrong type, if any. `missing=False` leaves a missing prompt or messages out (`run`'s row
    reader says more of it: a completion body takes no messages, ...)."""
    try:
        ENDPOINT_BODIES[url].model_validate(body)
    except ValidationError as e:
        wrong = [err for err in e.errors() if missing or err.get("type") != "missing"]
        return wrong_types(wrong) if wrong else None
    return None


def wrong_types(errors) -> tuple[str, str | None]:
    """(message, param) of the 422 naming the first field that is wrong (all of them in the
    message), from pydantic's errors: what the endpoints answer a body of wrong types with, a
    Batch API row and a `run` line too."""
    errors = _token_id_errors(list(errors))
    params = [".".join(str(p) for p in err.get("loc", ()) if p != "body" and not _type_tag(p)) for err in errors]
    shown = "; ".join(f"{p or 'body'}: {err.get('msg')}{_given(err)}" for p, err in list(zip(params, errors))[:4])
    if len(errors) > 4:
        shown += f" (and {len(errors) - 4} more)"
    return f"invalid request: {shown}", params[0] if params else None


def _token_id_errors(errors: list[dict]) -> list[dict]:
    """`errors` with a token-id list's fractions alone, where a field's value is a list of numbers
    (or of such lists) that holds one: `"prompt": [1, 2.5]` fails as a list of token ids, not
    also as text and a list of texts."""
    fractions = [err for err in errors if _fraction(err)]
    fields = {err["loc"][:-3 if err["loc"][-3] == "list[list[int]]" else -2] for err in fractions}
    if not fractions:
        return errors
    shown = [{**err, "msg": "token ids are whole numbers"} for err in fractions]
    return shown + [err for err in errors if not any(err["loc"][:len(f)] == f for f in fields)]


def _fraction(err: dict) -> bool:
    """An error for a number with a fraction where a list of token ids holds an integer."""
    loc, value = err.get("loc", ()), err.get("input")
    in_ids = (len(loc) >= 3 and loc[-2] == "list[int]") or (len(loc) >= 4 and loc[-3] == "list[list[int]]")
    return in_ids and isinstance(value, float) and not _whole(value)


#: What pydantic puts in an error's location for the member of a union that failed ("stop.str"):
#: not a field of the body.
TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "bytes", "tuple", "set"}


def _type_tag(part) -> bool:
    return isinstance(part, str) and (part in TYPE_TAGS or "[" in part
                                      or part.startswith(("function-", "constrained-")))


def _given(err: dict) -> str:
    """", got <the value>" for an error about a value the client sent (as JSON writes it: true,
    null; cut short)."""
    if err.get("type") == "missing" or "input" not in err:
        return ""
    try:
        shown = json.dumps(err["input"], ensure_ascii=False)
    except (TypeError, ValueError):
        shown = repr(err["input"])
    return f", got {shown if len(shown) <= 60 else shown[:57] + '...'}"
