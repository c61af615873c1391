"""Fuzzing the server through its OpenAPI document (schemathesis): a real server process on
127.0.0.1, its operations called with bodies, parameters and uploads generated from GET
/openapi.json. No request may get a 5xx; every answer must have a documented status and content
type, an error must be OpenAI's error object, data that breaks the document must get a 4xx, and
the OpenAI routes' successful answers must fit the official `openai` client's types.

Two passes. The document as served describes the bodies' types, so most generated requests are
refused by the value checks (400) before they reach the engine; the second pass narrows the
bodies to values that can run (short prompts, a few tokens, options within range, real file and
batch ids), so that generation, streaming, sampling options and the Batch API run on random
input too, and checks that most of them did.

Bounded: a small context (--max-model-len 96) keeps every generation short; a few examples per
operation and mode, no shrinking (a failure is reported as found, with the request that made
it). About a minute on 2 cores."""
from __future__ import annotations

import copy
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from openai.types import Batch, Completion, FileDeleted, FileObject, Model
from openai.types.chat import ChatCompletion
from pydantic import BaseModel
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                               response_schema_conformance, status_code_conformance)

from .batch_util import chat_line, jsonl
from .conftest import start_server, stop_server

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 6  # per operation and generation mode, as served: about 150 requests
RUNNABLE_EXAMPLES = 10  # per operation, the runnable pass: about 120 requests, most of them generating
REQUEST_TIMEOUT_S = 120  # one request at most (a generation is at most --max-model-len tokens)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]

#: (method, path) -> the official client's type of its JSON answer (the rest: the server's own).
OPENAI_TYPES: dict[tuple[str, str], type[BaseModel]] = {
    ("get", "/v1/models/{model_id}"): Model,
    ("post", "/v1/chat/completions"): ChatCompletion,
    ("post", "/v1/completions"): Completion,
    ("post", "/v1/files"): FileObject,
    ("get", "/v1/files/{file_id}"): FileObject,
    ("delete", "/v1/files/{file_id}"): FileDeleted,
    ("post", "/v1/batches"): Batch,
    ("get", "/v1/batches/{batch_id}"): Batch,
    ("post", "/v1/batches/{batch_id}/cancel"): Batch,
}
OPENAI_LISTS = {("get", "/v1/models"): Model, ("get", "/v1/files"): FileObject, ("get", "/v1/batches"): Batch}


@pytest.fixture(scope="module")
def fuzzed_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    server = start_server(tmp, "--max-model-len", "96", "--max-num-seqs", "64", "--log-level", "warning")
    yield server
    status = stop_server(server)
    log = server.output()
    assert status == 0, f"the server exited with {status}:\n{log[-4000:]}"
    assert "unexpected error" not in log and "Traceback" not in log, f"the server logged an error:\n{log[-8000:]}"


@pytest.fixture(scope="module")
def served_doc(fuzzed_server) -> dict:
    r = httpx.get(fuzzed_server.url + "/openapi.json", timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    return r.json()


def load(doc: dict, server) -> schemathesis.BaseSchema:
    schema = schemathesis.openapi.from_dict(with_openai_types(copy.deepcopy(doc)))
    schema.config.update(base_url=server.url)
    return schema


def with_openai_types(doc: dict) -> dict:
    """The document, its OpenAI routes' JSON answers typed with the `openai` client's models."""
    schemas = doc["components"]["schemas"]

    def ref(model: type[BaseModel]) -> dict:
        s = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in s.pop("$defs", {}).items():
            schemas.setdefault(name, sub)
        schemas.setdefault(model.__name__, s)
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    typed = {**{k: ref(m) for k, m in OPENAI_TYPES.items()},
             **{k: {"type": "object", "required": ["object", "data"],
                    "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": ref(m)}}}
                for k, m in OPENAI_LISTS.items()}}
    for (method, path), schema in typed.items():
        doc["paths"][path][method]["responses"]["200"]["content"]["application/json"] = {"schema": schema}
    return doc


def fuzz(operation, mode: GenerationMode, examples: int, statuses: Counter, refused: dict[str, list[str]]) -> None:
    """Call `operation` with `examples` generated cases, counting the answers' status classes
    and keeping the errors' bodies; raises the first failure."""

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    def run(case):
        response = case.call_and_validate(checks=CHECKS, timeout=REQUEST_TIMEOUT_S)
        statuses[operation.label, response.status_code // 100] += 1
        if response.status_code >= 400:
            refused.setdefault(operation.label, []).append(response.text[:300])

    run()


def fuzz_all(schema, modes, examples: int, only: set[str] | None = None) -> tuple[Counter, dict[str, list[str]]]:
    """Every operation (or those labelled in `only`) in each mode; fails listing every failure.
    The count of answers by (operation, status class), and each operation's error bodies."""
    failures, statuses, refused = [], Counter(), {}
    for result in schema.get_all_operations():
        operation = result.ok()
        if only is not None and operation.label not in only:
            continue
        for mode in modes:
            try:
                fuzz(operation, mode, examples, statuses, refused)
            except Unsatisfiable:  # negative: nothing to make invalid (no body, no parameter with a type)
                assert mode is GenerationMode.NEGATIVE, operation.label
            except Exception as e:  # noqa: BLE001  (the check's failure, with the request that caused it)
                failures.append(f"--- {operation.label} ({mode.value}):\n{e}")
    assert not failures, f"{len(failures)} operations failed:\n" + "\n".join(failures)
    return statuses, refused


def test_openapi_document_describes_the_bodies(served_doc):
    """The document has the routes' request bodies, not FastAPI's empty ones."""
    chat = served_doc["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ChatRequest"}
    assert "messages" in served_doc["components"]["schemas"]["ChatRequest"]["required"]
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "multipart/form-data" in served_doc["paths"]["/v1/files"]["post"]["requestBody"]["content"]
    assert {p["name"] for p in served_doc["paths"]["/v1/batches"]["get"]["parameters"]} == {"after", "limit"}
    assert "security" not in chat  # no --api-key: none needed


def test_fuzz_as_served(fuzzed_server, served_doc):
    """Every operation, with data that fits the document and data that does not."""
    statuses, _ = fuzz_all(load(served_doc, fuzzed_server), (GenerationMode.POSITIVE, GenerationMode.NEGATIVE),
                        MAX_EXAMPLES)
    operations = {(method.upper(), path) for path, item in served_doc["paths"].items() for method in item}
    assert {tuple(label.split(" ", 1)) for label, _ in statuses} == operations  # each one was called


# ---- the runnable pass ------------------------------------------------------------------------
def _number(lo: float, hi: float) -> dict:
    return {"type": "number", "minimum": lo, "maximum": hi}


def _integer(lo: int, hi: int, step: int = 1) -> dict:
    # An enum, not {"type": "integer"}: JSON Schema counts 5.0 as an integer, and the generator
    # sends it so; the server's strict types refuse it (422), as they refuse "5".
    return {"enum": list(range(lo, hi + 1, step))}


_TEXT = {"type": "string", "minLength": 1, "maxLength": 40}
_SAMPLING = {
    "max_tokens": _integer(1, 12), "temperature": _number(0, 2), "top_p": {**_number(0, 1), "exclusiveMinimum": 0},
    "top_k": _integer(-1, 50), "seed": _integer(0, 2**31 - 1, 2**24 - 1), "min_p": _number(0, 1),
    "min_tokens": _integer(0, 1),
    "stop": {"anyOf": [{"type": "string", "minLength": 1, "maxLength": 4},
                       {"type": "array", "maxItems": 3, "items": {"type": "string", "minLength": 1, "maxLength": 4}}]},
}
_OPENAI = {
    **_SAMPLING, "n": _integer(1, 3), "stream": {"type": "boolean"},
    # stream_options with stream: true only (a 400 otherwise, as OpenAI); `anyOf` keeps them paired
    "stream_options": {"type": "null"},
    "presence_penalty": _number(-2, 2), "frequency_penalty": _number(-2, 2),
    "repetition_penalty": {**_number(0, 2), "exclusiveMinimum": 0},
    "logit_bias": {"type": "object", "maxProperties": 3, "propertyNames": {"pattern": "^[1-9][0-9]{0,3}$"},
                   "additionalProperties": _number(-100, 100)},
    "include_stop_str_in_output": {"type": "boolean"},
}
#: one structured-output option per request: choices for completions, a regex for chat
#: (labels of at most 10 tokens: one longer than max_tokens, 16 by default, is refused, rightly)
_CHOICES = {"guided_choice": {"type": "array", "minItems": 2, "maxItems": 3, "uniqueItems": True,
                              "items": {"type": "string", "pattern": "^[a-z]{1,10}$"}}}
_REGEX = {"guided_regex": {"enum": ["[ab]{1,5}", "(yes|no)", "[0-9]+"]}}
_MESSAGES = {"type": "array", "minItems": 1, "maxItems": 2, "items": {
    "type": "object", "required": ["role", "content"], "additionalProperties": False,
    "properties": {"role": {"enum": ["system", "user", "assistant"]}, "content": {**_TEXT, "maxLength": 20}}}}
_PROMPT = {"anyOf": [_TEXT, {"type": "array", "minItems": 1, "maxItems": 3, "items": _TEXT},
                     {"type": "array", "minItems": 1, "maxItems": 8, "items": _integer(1, 1000, 37)}]}


def _body(required: list[str], properties: dict) -> dict:
    return {"type": "object", "required": required, "additionalProperties": False, "properties": properties}


def _streamed_or_not(body: dict) -> dict:
    """`body`, or the same streamed (stream: true) with stream_options: they go together."""
    streamed = copy.deepcopy(body)
    streamed["properties"]["stream"] = {"const": True}
    streamed["properties"]["stream_options"] = {"type": "object", "additionalProperties": False,
                                                "properties": {"include_usage": {"type": "boolean"}}}
    return {"anyOf": [body, streamed]}


RUNNABLE = {
    "/v1/chat/completions": "post", "/v1/completions": "post", "/v1/batch/sync": "post", "/v1/batch/async": "post",
    "/v1/batch/{batch_id}": "get", "/v1/batches": "post", "/v1/batches/{batch_id}": "get",
    "/v1/files/{file_id}": "get", "/v1/files/{file_id}/content": "get", "/v1/batches/{batch_id}/cancel": "post",
    "/v1/batch/{batch_id}/cancel": "post",
}


#: the operations whose bodies are generated: most of their requests must run
GENERATED = ("POST /v1/chat/completions", "POST /v1/completions", "POST /v1/batch/sync", "POST /v1/batch/async",
             "POST /v1/batches")


def runnable_doc(doc: dict, ids: dict[str, str]) -> dict:
    """The document narrowed to requests that can run: the bodies' values within range, the
    path parameters real ids (`ids`: parameter name -> value, per path family)."""
    doc = copy.deepcopy(doc)
    schemas = doc["components"]["schemas"]
    schemas["ChatRequest"] = _streamed_or_not(_body(["messages"], {
        **_OPENAI, **_REGEX, "messages": _MESSAGES, "max_completion_tokens": _integer(1, 12),
        "logprobs": {"const": True}, "top_logprobs": _integer(0, 5)}))  # top_logprobs needs logprobs
    schemas["CompletionRequest"] = _streamed_or_not(_body(["prompt"], {**_OPENAI, **_CHOICES, "prompt": _PROMPT,
                                                                       "logprobs": _integer(0, 5)}))
    schemas["BatchRequest"] = _body(["prompts"], {
        **_SAMPLING, "prompts": {"type": "array", "minItems": 1, "maxItems": 4, "items": _TEXT},
        "system": {"anyOf": [_TEXT, {"type": "null"}]}})
    schemas["BatchCreate"] = _body(["input_file_id", "endpoint", "completion_window"], {
        "input_file_id": {"const": ids["file_id"]}, "completion_window": {"const": "24h"},
        "endpoint": {"enum": ["/v1/chat/completions", "/v1/completions"]},
        "metadata": {"type": "object", "maxProperties": 2, "additionalProperties": {"type": "string", "maxLength": 20}}})
    for path, method in RUNNABLE.items():
        for param in doc["paths"][path][method].get("parameters", []):
            if param["in"] == "path":
                key = "async_id" if path.startswith("/v1/batch/") else param["name"]
                param["schema"] = {"const": ids[key]}
    return doc


def test_fuzz_requests_that_run(fuzzed_server, served_doc):
    """Generation (streamed or not, every sampling option), the batch endpoints and the Batch API
    on random valid input: no 5xx, answers that fit the client's types, and most of them 2xx."""
    with fuzzed_server.client() as c:
        lines = [chat_line("a", "Hi"), chat_line("b", "One, two,")]
        r = c.post("/v1/files", files={"file": ("in.jsonl", jsonl(lines))}, data={"purpose": "batch"})
        assert r.status_code == 200, r.text
        file_id = r.json()["id"]
        r = c.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                        "completion_window": "24h"})
        assert r.status_code == 200, r.text
        batch_id = r.json()["id"]
        r = c.post("/v1/batch/async", json={"prompts": ["Hello"], "max_tokens": 2})
        assert r.status_code == 202, r.text
        async_id = r.json()["batch_id"]
    doc = runnable_doc(served_doc, {"file_id": file_id, "batch_id": batch_id, "async_id": async_id})
    only = {f"{method.upper()} {path}" for path, method in RUNNABLE.items()}
    statuses, refused = fuzz_all(load(doc, fuzzed_server), (GenerationMode.POSITIVE,), RUNNABLE_EXAMPLES, only)
    for label in GENERATED:  # the rest take one id each; a cancel of an ended batch is a 400
        ok, total = statuses[label, 2], sum(n for (lb, _), n in statuses.items() if lb == label)
        assert total > 0 and ok / total >= 0.5, (
            f"{label}: {ok} of {total} answers were 2xx; refused:\n" + "\n".join(refused.get(label, [])))


@pytest.mark.parametrize("options", [{"temperature": 1e-300}, {"top_p": 1e-300}, {"repetition_penalty": 1e-300}],
                         ids=["temperature", "top_p", "repetition_penalty"])
def test_options_below_float32_run(fuzzed_server, options):
    """Found by the runnable pass: valid options whose float32 value is 0 (or that overflow a
    logit) made NaN probabilities, and the engine failed the request ("the model failed on this
    step", 400) and every other request in the same step. Now they decode as their limit."""
    with fuzzed_server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "One, two,", "max_tokens": 3, "seed": 1, **options})
    assert r.status_code == 200, r.text
    assert Completion.model_validate(r.json()).choices[0].finish_reason in ("stop", "length")
