"""OpenAI Batch API output: `chat.completion` / `text_completion` bodies, output and error lines."""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from ..api.result import Result
from .rows import CHAT, Row, RowError, echo_only

FINISH = {"stop": "stop", "length": "length"}


def failed_choice(choices: Sequence[Result], several: bool | None = None) -> Result | None:
    """The choice that fails its request, if one does (`several`: whether the request asks for
    several choices, n > 1 or a list of prompts, even of one; by default whether `choices` are
    several). An output that `max_tokens` cut before it completed its structured output is not
    one: as OpenAI and vLLM answer it, the partial text is the answer, with finish_reason
    "length" (the endpoint, the Batch API and `batchprompt run` alike). Nor, in a request of
    several choices, is an answer that breaks its schema (invalid_output): the others are
    answered, and it carries its `error` beside its text (choice_error); one bad answer of n=3
    lost the two good ones."""
    several = len(choices) > 1 if several is None else several
    return next((c for c in choices if c.error is not None and c.finish_reason != "length"
                 and not (several and choice_error(c))), None)


def choice_error(r: Result) -> dict[str, Any] | None:
    """The `error` of a choice whose answer broke its schema, in a request of several choices
    (failed_choice), in OpenAI's error shape; None for any other choice."""
    if r.error is None or r.finish_reason == "length" or not r.error.startswith(INVALID_OUTPUT):
        return None
    return {"message": r.error, "type": "invalid_request_error", "param": None, "code": "invalid_output"}


#: How the structured-output check words an answer that its grammar let through but that breaks
#: its schema (api/structured.py): code invalid_output, with the text in the message. A 400, not
#: a 500: the fault is the answer's, but a client retries a 500 (the openai client twice, a pool
#: until its tries run out), and a greedy request gets the same answer every time.
INVALID_OUTPUT = ("the output breaks its schema", "the output's number", "the output does not parse as the schema")


def with_output(message: str, text: str, limit: int = 300) -> str:
    """An invalid output's message with the text it judged (a row's error line keeps no text)."""
    if not message.startswith(INVALID_OUTPUT):
        return message
    shown = text if len(text) <= limit else text[:limit] + f"... ({len(text):,} characters)"
    return f"{message}; the output: {shown}"


def failure_code(message: str, body: dict) -> str:
    """OpenAI's error code for a request (`body`) the engine failed with this message: the
    engine's own fault (a step that raised, an engine that stopped), a prompt too long, a value
    of one of its fields (as the server's own checks code a bad value), or the request's."""
    if message.startswith(("the engine", "the model failed on this step")):
        return "engine_error"
    if message.startswith(INVALID_OUTPUT):  # the model's answer, not the request, is at fault
        return "invalid_output"
    if "shorten the prompt" in message:
        return "context_length_exceeded"
    return "invalid_parameter" if failure_param(message, body) else "invalid_request"


def failure_param(message: str, body: dict) -> str | None:
    """The field a request's failure is about (its `param`): the engine names token ids outside
    the vocabulary in logit_bias, stop_token_ids or the prompt."""
    if message.startswith("the prompt has token ids"):
        return "prompt"
    first = message.split(" ", 1)[0]
    return first if first in body else None


def _id(prefix: str, job: str, custom_id: str | None, line: int) -> str:
    """The id of a row's line: the same for the same row of the same job (a resumed job writes
    what it would have written), different across jobs (ids are keys: OpenAI's are unique)."""
    # surrogatepass: an id holding a lone surrogate still hashes (its row is an error, not a crash)
    key = f"{job}:{custom_id}:{line}".encode("utf-8", "surrogatepass")
    return prefix + hashlib.sha256(key).hexdigest()[:24]


@dataclass(frozen=True)
class TokenPieces:
    """How a token reads in log-probs: its text, and its bytes (OpenAI's `bytes`, with which a
    client rebuilds a character split across tokens; such a token's text is U+FFFD). Without
    `bytes`, the text's own UTF-8."""

    text: Callable[[int], str]
    bytes: Callable[[int], bytes] | None = None
    decode: Callable[[list[int]], str] | None = None  # a prompt given as token ids, as text (echo)

    @classmethod
    def of(cls, tokenizer) -> "TokenPieces":
        text = getattr(tokenizer, "token_text", None) or (lambda t: tokenizer.decode([t]))
        decode = getattr(tokenizer, "decode", None)
        # An echoed prompt keeps its special tokens, as its log-probs' tokens (and their
        # text_offset) and a prompt given as text do, and as vLLM echoes it: `[1, 504]` echoed
        # "The", and its offsets counted the "<|im_start|>" that the text lacked.
        echo = None if decode is None else (lambda ids: decode(ids, skip_special_tokens=False))
        return cls(text, getattr(tokenizer, "token_bytes", None), echo)


def response_body(row: Row, choices: Sequence[Result], model: str, created: int,
                  token_text: Callable[[int], str] | TokenPieces, job: str = "") -> dict[str, Any]:
    """The body OpenAI would return for this row (one Result per choice, n of them); `job`
    scopes its id (see _id). `token_text`: how a token reads (a TokenPieces, or its text alone)."""
    pieces = token_pieces(row, token_text)
    with_ids = bool(row.body.get("return_token_ids"))  # vLLM's: each choice's generated token ids
    prompt_tokens = choices[0].usage.prompt_tokens
    alone = echo_only(row.body)  # the prompt alone: the token its prefill yielded is not the answer's
    completion = 0 if alone else sum(r.usage.completion_tokens for r in choices)
    cached = choices[0].usage.cached_tokens
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
             "total_tokens": prompt_tokens + completion,
             "prompt_tokens_details": {"cached_tokens": cached}}
    rid = _id("chatcmpl-" if row.url == CHAT else "cmpl-", job, row.custom_id, row.line)
    if row.url == CHAT:
        out = []
        for i, r in enumerate(choices):
            choice = {"index": i, "message": {"role": "assistant", "content": r.text, "refusal": None},
                      "finish_reason": FINISH.get(r.finish_reason, "stop"), "logprobs": None}
            if r.logprobs is not None:
                choice["logprobs"] = {"content": chat_logprobs(r.token_ids, r.logprobs, _tops(r), pieces),
                                      "refusal": None}
            out.append(_with_extras(choice, r, with_ids))
        body = {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": out, "usage": usage, "system_fingerprint": None}
        if with_ids:  # vLLM's: the prompt's on the response, each choice's own on the choice
            body["prompt_token_ids"] = list(choices[0].prompt_token_ids)
        if row.body.get("prompt_logprobs") is not None:  # vLLM's: the response's, not a choice's
            body["prompt_logprobs"] = prompt_logprobs(choices[0], row.body["prompt_logprobs"], pieces)
        return body
    out = []
    for i, r in enumerate(choices):
        if alone:  # as vLLM: the prompt, finish_reason "length" (max_tokens 0 reached), no stop reason
            r = replace(r, text="", token_ids=[], logprobs=None if r.logprobs is None else [], top_logprobs=None,
                        finish_reason="length", stop_reason=None)
        choice = {"index": i, "text": r.text, "finish_reason": FINISH.get(r.finish_reason, "stop"), "logprobs": None}
        if r.logprobs is not None:
            choice["logprobs"] = completion_logprobs(r.token_ids, r.logprobs, _tops(r), pieces)
        if row.body.get("echo") is True:
            choice = _echoed(choice, row, r, pieces)
        if row.body.get("prompt_logprobs") is not None:
            choice["prompt_logprobs"] = prompt_logprobs(r, row.body["prompt_logprobs"], pieces)
        if with_ids:  # vLLM's: on each choice of a completion
            choice["prompt_token_ids"] = list(r.prompt_token_ids)
        out.append(_with_extras(choice, r, with_ids))
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": out, "usage": usage}


def _with_extras(choice: dict[str, Any], r: Result, with_ids: bool) -> dict[str, Any]:
    """The choice with the fields beyond OpenAI's, as vLLM adds its own (OpenAI's clients keep
    fields they do not know): a label picked by its log-likelihood (choice_mode "score") comes
    with every label's probability, `token_ids` where the body asked (return_token_ids), and
    vLLM's `stop_reason`."""
    choice["stop_reason"] = r.stop_reason  # vLLM's: the stop string or token id, else null
    if (error := choice_error(r)) is not None:
        choice["error"] = error
    if r.choice_probs is not None:
        choice["choice_probs"] = dict(r.choice_probs)
    if with_ids:
        choice["token_ids"] = list(r.token_ids)
    return choice


def token_pieces(row: Row, token_text: Callable[[int], str] | TokenPieces) -> TokenPieces:
    """How the row's log-probs name tokens: `token_text`, or vLLM's "token_id:123" where the body
    asks (return_tokens_as_token_ids)."""
    if row.body.get("return_tokens_as_token_ids"):
        decode = token_text.decode if isinstance(token_text, TokenPieces) else None
        return TokenPieces(lambda t: f"token_id:{t}", decode=decode)
    return token_text if isinstance(token_text, TokenPieces) else TokenPieces(token_text)


def chat_logprobs(token_ids: Sequence[int], logprobs: Sequence[float], tops: Sequence | None,
                  pieces: TokenPieces) -> list[dict[str, Any]]:
    """A chat choice's `logprobs.content`: each token, its log-prob and bytes, and its top ones."""
    return [{**_chat_token(tid, lp, pieces),
             "top_logprobs": [_chat_token(t, v, pieces) for t, v in (tops[i] if tops else ())]}
            for i, (tid, lp) in enumerate(zip(token_ids, logprobs))]


def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[float], tops: Sequence | None,
                        pieces: TokenPieces, offset: int = 0) -> dict[str, Any]:
    """A completion choice's `logprobs` (tokens, token_logprobs, top_logprobs, text_offset), its
    offsets counted from `offset` (a stream's chunk: the text before it)."""
    tokens = [pieces.text(t) for t in token_ids]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": list(logprobs),
            "top_logprobs": _completion_tops(tokens, logprobs, tops, pieces), "text_offset": offsets}


def _echoed(choice: dict[str, Any], row: Row, r: Result, pieces: TokenPieces) -> dict[str, Any]:
    """A completion choice with its prompt first (echo), as vLLM answers it: the prompt's text
    before the answer's, and with logprobs its tokens first, the first of them with none (null)."""
    ids = list(r.prompt_token_ids)
    if isinstance(row.prompt, str):
        prompt = row.prompt
    elif pieces.decode is not None:
        prompt = pieces.decode(ids)
    else:
        prompt = "".join(map(pieces.text, ids))
    choice = {**choice, "text": prompt + choice["text"]}
    if choice["logprobs"] is None or not ids:
        return choice
    values = [None, *(r.prompt_logprobs or [None] * (len(ids) - 1))]
    k = row.body.get("logprobs")  # the engine's may be more, where prompt_logprobs asks more
    k = int(k) if isinstance(k, (bool, int)) else 0
    tops = [None, *(top[:k] for top in r.prompt_top_logprobs)] if r.prompt_top_logprobs else None
    echoed = completion_logprobs(ids, values, tops, pieces)
    answer = choice["logprobs"]
    offset = sum(map(len, echoed["tokens"]))
    return {**choice, "logprobs": {
        "tokens": echoed["tokens"] + answer["tokens"],
        "token_logprobs": echoed["token_logprobs"] + answer["token_logprobs"],
        "top_logprobs": echoed["top_logprobs"] + answer["top_logprobs"],
        "text_offset": echoed["text_offset"] + [offset + o for o in answer["text_offset"]]}}


def prompt_logprobs(r: Result, k: int, pieces: TokenPieces) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, then {token id: {logprob,
    rank, decoded_token}} of the token itself (first) and of its position's k most likely (ranks
    1 to k), where the prompt token may be among them."""
    if r.prompt_logprobs is None:
        return None
    ids, ranks, tops = r.prompt_token_ids, r.prompt_ranks or (), r.prompt_top_logprobs
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for i, (tid, value) in enumerate(zip(ids[1:], r.prompt_logprobs)):
        entry = {str(tid): {"logprob": value, "rank": ranks[i] if i < len(ranks) else None,
                            "decoded_token": pieces.text(tid)}}
        for rank, (t, v) in enumerate(tops[i][:k] if tops and k else (), 1):
            entry.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": pieces.text(t)})
        out.append(entry)
    return out


def _chat_token(tid: int, logprob: float, pieces: TokenPieces) -> dict[str, Any]:
    t = pieces.text(tid)
    raw = pieces.bytes(tid) if pieces.bytes is not None else t.encode("utf-8", "surrogatepass")
    return {"token": t, "logprob": logprob, "bytes": list(raw)}


def _completion_tops(tokens: list[str], logprobs: Sequence[float], tops: Sequence | None,
                     pieces: TokenPieces) -> list[dict[str, float]]:
    """/v1/completions' top_logprobs, as OpenAI and vLLM give them: at each position the `logprobs`
    most likely tokens and the chosen one (up to logprobs + 1 entries; `logprobs: 0` gives the
    chosen token alone), whether or not it was among them."""
    tops = tops or [()] * len(tokens)
    out: list = []
    for token, logprob, pos in zip(tokens, logprobs, tops):
        if logprob is None:  # an echoed prompt's first token: no log-prob, and no alternatives (vLLM's null)
            out.append(None)
            continue
        step = {pieces.text(t): v for t, v in pos}
        step.setdefault(token, logprob)
        out.append(step)
    return out


def _tops(r: Result) -> list[list[tuple[int, float]]] | None:
    """Per position, the (token id, log-prob) of the most likely tokens (top_logprobs asked)."""
    # getattr: Result gains `top_logprobs` (from RequestOutput.top_logprobs) in api/result.py.
    return r.top_logprobs


def output_line(row: Row, body: dict[str, Any], job: str = "") -> dict[str, Any]:
    return {"id": _id("batch_req_", job, row.custom_id, row.line), "custom_id": row.custom_id,
            "response": {"status_code": 200, "request_id": _id("req_", job, row.custom_id, row.line), "body": body},
            "error": None}


#: Failures that are no HTTP answer (the batch ended before the request ran): OpenAI writes them
#: with `error` alone and `response` null.
NOT_HTTP = frozenset({"batch_expired", "batch_cancelled"})
#: The HTTP status the endpoint answers an error code with, where it is not 400.
STATUS = {"engine_error": 500, "request_failed": 500, "internal_error": 500, "not_run": 503, "model_not_found": 404,
          "invalid_type": 422}
#: OpenAI's error types: "invalid_request_error" for every 4xx but these (its SDK picks the
#: exception class from the status, not the type).
TYPES = {429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


def error_type(status: int) -> str:
    return TYPES.get(status, "invalid_request_error")


def error_line(line: int, custom_id: str | None, code: str, message: str, job: str = "",
               param: str | None = None) -> dict[str, Any]:
    """A failed row, as OpenAI's batch error file writes a request its endpoint refused:
    `response` holds that HTTP status and the endpoint's error body. `error` (which OpenAI
    leaves null there, and fills for a request the batch's end stopped) carries the code, the
    message and the input line number here too, so that one field reads every failure."""
    response = None
    if code not in NOT_HTTP:
        status = STATUS.get(code, 400)
        # The body's message as the endpoint words it: the file's line (a table's row) is in `error.line`.
        where = message.removeprefix(f"line {line}: ").removeprefix(f"row {line}: ")
        body = {"error": {"message": where, "type": error_type(status),
                          "param": param, "code": code}}
        response = {"status_code": status, "request_id": _id("req_", job, custom_id, line), "body": body}
    return {"id": _id("batch_req_", job, custom_id, line), "custom_id": custom_id, "response": response,
            "error": {"code": code, "message": message, "line": line}}


def row_error_line(err: RowError, job: str = "") -> dict[str, Any]:
    return error_line(err.line, err.custom_id, err.code, err.message, job, err.param)


@dataclass(frozen=True)
class Answer:
    """A request's line once all its choices are in: its output line, or its error line."""
    ok: bool
    record: dict[str, Any]
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


def answer(row: Row, choices: Sequence[Result], model: str, created: int, token_text, job: str = "",
           rerun_note: str | None = None) -> Answer:
    """The line of a request whose choices are all in (the Batch API's and `batchprompt run`'s).
    `rerun_note`: a failure for want of a backend (a retryable choice) is `not_run`, with that
    note, rather than the request's own error."""
    failed = failed_choice(choices)
    if failed is not None:
        code = failure_code(failed.error, row.body)
        message = f"line {row.line}: {with_output(failed.error, failed.text)}"
        param = failure_param(failed.error, row.body)
        if rerun_note is not None and any(c.retryable for c in choices):
            code, message, param = "not_run", f"{message} ({rerun_note})", None
        return Answer(False, error_line(row.line, row.custom_id, code, message, job, param))
    try:
        body = response_body(row, choices, model, created, token_text, job)
    except Exception as e:  # noqa: BLE001  (an answer that cannot be shaped is its request's error)
        return Answer(False, error_line(row.line, row.custom_id, "request_failed",
                                        f"line {row.line}: {type(e).__name__}: {e}", job))
    usage = body["usage"]
    return Answer(True, output_line(row, body, job), usage["prompt_tokens"], usage["completion_tokens"],
                  usage["prompt_tokens_details"]["cached_tokens"])


def now() -> int:
    return int(time.time())
