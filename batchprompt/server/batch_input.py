"""A batch's input file, checked as OpenAI's Batch API checks it.

A line that is not a request of the batch (not UTF-8, not JSON, no custom_id, another
endpoint, no body, a custom_id seen before, a model this server does not run, stream: true) fails the whole
batch: its `errors` name every such line, and nothing runs. A request whose body is wrong in
itself (no messages, n of 0, a bad response_format) is that request's error only: it goes to the
error file, as OpenAI answers it with a 400, and the others run."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..jobs import rows as job_rows
from ..jobs.bodies import ENDPOINT_BODIES, type_problem, whole_numbers
from ..jobs.ids import check_ids
from ..jobs.rows import CHAT, COMPLETION, InputError, Row, RowError

ENDPOINTS = (CHAT, COMPLETION)
MAX_ERRORS = 100  # lines named in a failed batch's errors (then one line says how many more)
BOM = b"\xef\xbb\xbf"


@dataclass
class Checked:
    rows: list[Row | RowError] = field(default_factory=list)  # RowError: a request answered by its error
    errors: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's BatchError objects

    @property
    def ok(self) -> bool:
        return not self.errors


def check_input(raw: bytes, endpoint: str, model_id: str, model_names: Iterable[str]) -> Checked:
    """The file's requests, or the errors that fail the batch. `model_names`: what a body's
    "model" may say (the server's model, `model_id`, by any of its names)."""
    out = Checked()
    models = set(model_names)
    first_line: dict[str, int] = {}
    bad = 0

    def fail(n: int | None, code: str, message: str, param: str | None = None) -> None:
        nonlocal bad
        bad += 1
        if len(out.errors) < MAX_ERRORS:
            out.errors.append({"code": code, "line": n, "message": message, "param": param})

    try:  # named for what it is, as `batchprompt run` names it (it was "line 1: not valid JSON (Extra data ...)")
        job_rows.check_wide_encoding(raw, "the file")
        job_rows.check_line_ends(raw, "the file")
    except InputError as e:
        fail(None, "invalid_file", str(e))
        return out
    for n, chunk in enumerate(raw.split(b"\n"), 1):
        if n == 1 and chunk.startswith(BOM):  # a UTF-8 byte-order mark, as some editors write
            chunk = chunk[len(BOM):]
        if not chunk.strip():
            continue
        obj = _parse(n, chunk, fail)
        if obj is None:
            continue
        cid = obj.get("custom_id")
        if (wanted := job_rows.custom_id_wanted(cid)) is not None:
            fail(n, "missing_custom_id", f"line {n}: each line needs {wanted}", "custom_id")
            continue
        problem = _request_problem(n, obj, endpoint, model_id, models)
        if problem is not None:
            fail(n, *problem)
            continue
        if cid in first_line:
            fail(n, "duplicate_custom_id", f"line {n}: the custom_id {json.dumps(cid)} is also on line "
                                           f"{first_line[cid]}; each must be unique, so results can be matched "
                                           f"to requests", "custom_id")
            continue
        first_line[cid] = n
        body = whole_numbers(ENDPOINT_BODIES[endpoint], obj["body"])  # as the endpoint reads it
        wrong = type_problem(endpoint, body)  # the endpoint's 422 for the same body
        if wrong is not None:
            out.rows.append(RowError(n, cid, "invalid_type", f"line {n}: {wrong[0]}", wrong[1]))
        else:
            out.rows.append(job_rows.row_from_body(n, cid, endpoint, body))
    if bad > len(out.errors):
        out.errors.append({"code": "too_many_errors", "line": None, "param": None,
                           "message": f"and {bad - len(out.errors)} more lines with errors"})
    if not out.rows and not out.errors:
        fail(None, "empty_file", "the file has no requests: give one JSON request per line "
                                 "({\"custom_id\", \"method\", \"url\", \"body\"})")
    if out.ok:
        out.rows = check_ids(out.rows, "the input file")  # an id that is not valid text: its row's error
    return out


def _parse(n: int, chunk: bytes, fail) -> dict | None:
    try:
        text = chunk.decode("utf-8")
    except UnicodeDecodeError as e:
        fail(n, "invalid_utf8", f"line {n}: not valid UTF-8 (byte {e.start + 1} of the line); save the file as UTF-8")
        return None
    try:
        obj = job_rows.json_loads(text)
    except json.JSONDecodeError as e:
        fail(n, "invalid_json", f"line {n}: not valid JSON ({e.msg} at column {e.colno})")
        return None
    if not isinstance(obj, dict):
        fail(n, "invalid_request", f"line {n}: expected a JSON object, got {job_rows.json_type(obj)}")
        return None
    return obj


def _request_problem(n: int, obj: dict, endpoint: str, model_id: str, models: set[str]) -> tuple[str, str, str] | None:
    """(code, message, param) of what makes the line no request of this batch, if anything."""
    method = obj.get("method", "POST")
    if method != "POST":
        return "invalid_method", f"line {n}: method must be POST, got {method!r}", "method"
    url = obj.get("url")
    if url != endpoint:
        if url in ENDPOINTS:
            return ("mismatched_url", f"line {n}: url {url} differs from the batch's endpoint {endpoint}; "
                                      f"every line of a batch goes to its endpoint", "url")
        if url is None:
            return "missing_url", f"line {n}: the line needs a url, the batch's endpoint {endpoint}", "url"
        return "invalid_url", f"line {n}: url {url!r} is not supported; use {endpoint}", "url"
    body = obj.get("body")
    if not isinstance(body, dict):
        return "missing_body", f"line {n}: the line needs a body object (the request)", "body"
    if body.get("stream") is True:  # OpenAI's Batch API refuses it as it validates the file (another
        # value is that row's 422, as the endpoint answers it)
        return ("invalid_request", f"line {n}: a batch request cannot stream (stream: true): its result goes to "
                                   f"the batch's output file; remove stream and stream_options", "body.stream")
    model = body.get("model")
    if model not in (None, "") and model not in models:  # "" is left out, as the endpoints take it
        return ("model_not_found", f"line {n}: the model {model!r} does not exist here; this server runs "
                                   f"{model_id!r} (GET /v1/models)", "body.model")
    return None
