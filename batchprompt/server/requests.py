"""From an OpenAI request body to the batch API's prepared prompts.

A body's options are read by the same code as `batchprompt run`'s rows (jobs/rows.py checks
the body, jobs/run.py turns it into sampling parameters and a structured-output spec), so the
server and the job runner accept and refuse the same bodies with the same messages. What is
the server's own: the prompt forms of /v1/completions (a list of prompts, token ids), OpenAI's
defaults (temperature 1, max_tokens 16 for completions), and refusing fields it cannot honour
(echo, suffix, tools, beam search, prompt_logprobs)."""
from __future__ import annotations

import contextlib
import logging
import uuid
from dataclasses import dataclass, replace
from typing import Any, Callable

from ..api.batch import Prepared
from ..jobs import rows as job_rows
from ..jobs import openai_io, refusals
from ..jobs.rows import CHAT, COMPLETION, Row, RowError, max_tokens_name
from ..engine.samples import prompt_ids_problem, sampling_problem
from ..jobs.run import JobOptions, render, row_params, row_spec
from ..models.tokenizer import InvalidText
from .errors import ApiError

#: OpenAI's and vLLM's defaults where a body gives none (`batchprompt run` and the batch API
#: decode greedily instead; the server answers as the APIs it stands in for).
COMPLETION_MAX_TOKENS = 16
TEMPERATURE = 1.0
log = logging.getLogger("batchprompt")
_unknown_logged: set[str] = set()  # unknown body fields named in the log already (once each)

@dataclass
class Plan:
    """One request's prompts: `rows[i]` is prompt i; its choice j is `prepared[i * n + j]`."""

    request_id: str
    rows: list[Row]
    n: int
    prepared: list[Prepared]
    token_text: Callable[[int], str] | openai_io.TokenPieces  # how a token reads in log-probs
    decode: Callable[[list[int]], str] | None = None  # a choice's tokens as text (streaming)
    listed: bool = False  # a completion's prompt given as a list of prompts, even of one

    @property
    def several(self) -> bool:
        """Whether the request asks for several choices (n > 1, or a list of prompts, as a pool
        sends a sub-batch of one): one whose answer breaks its schema then carries its error,
        and the others are answered (openai_io.failed_choice)."""
        return self.n > 1 or len(self.rows) > 1 or self.listed


def plan_chat(body: dict, tokenizer, max_model_len: int, request_id: str | None = None) -> Plan:
    """`request_id`: the client's (X-Request-Id, as vLLM takes it), else the answer's id is random."""
    body = refuse_unsupported(body)
    rid = request_id or uuid.uuid4().hex
    row = _row(CHAT, body, rid)
    # Unset max_tokens: the rest of the context, as vLLM (the engine stops at the context's end).
    opts = JobOptions(input="-", output="-", max_tokens=max_model_len, temperature=TEMPERATURE)
    params, n, spec = _params(row, opts, tokenizer, max_model_len)
    ids = _checked(_render(row, tokenizer, max_model_len), max_model_len, "the messages",
                   refusals.asked_max_tokens(body, params), max_tokens_name(body))
    return Plan(rid, [row], n, _choices([ids], params, n, spec), openai_io.TokenPieces.of(tokenizer), tokenizer.decode)


def plan_completion(body: dict, tokenizer, max_model_len: int, request_id: str | None = None) -> Plan:
    """`request_id`: the client's (X-Request-Id, as vLLM takes it), else the answer's id is random."""
    body = refuse_unsupported(body)
    rid = request_id or uuid.uuid4().hex
    prompts = _prompts(body.get("prompt"))
    # The body's options are checked once, with a stand-in prompt: the prompt forms are ours.
    base = _row(COMPLETION, {**body, "prompt": "-"}, rid)
    opts = JobOptions(input="-", output="-", max_tokens=COMPLETION_MAX_TOKENS, temperature=TEMPERATURE)
    params, n, spec = _params(base, opts, tokenizer, max_model_len)
    rows, all_ids = [], []
    for i, prompt in enumerate(prompts):
        what = f"prompt {i}" if len(prompts) > 1 else "the prompt"
        row = replace(base, prompt=prompt if isinstance(prompt, str) else None)
        ids = _render(row, tokenizer, max_model_len, what) if isinstance(prompt, str) else list(prompt)
        rows.append(row)
        all_ids.append(_checked(ids, max_model_len, what, params.max_tokens, max_tokens_name(body),
                                default=refusals.asked_max_tokens(body, params) is None))
    listed = isinstance(body.get("prompt"), list) and not all(isinstance(t, int) for t in body["prompt"])
    return Plan(rid, rows, n, _choices(all_ids, params, n, spec), openai_io.TokenPieces.of(tokenizer), tokenizer.decode,
                listed)


def vocabulary_problem(plan: Plan, vocab_size: int) -> ApiError | None:
    """The 400 that the engine's refusal of a token id outside the vocabulary (a token-id prompt's,
    logit_bias's, stop_token_ids') becomes, found before any work starts: a stream answered 200
    and then an error event, where OpenAI and vLLM refuse the request (the client's status-based
    error handling missed it)."""
    for p in plan.prepared:
        message = prompt_ids_problem(p.token_ids, vocab_size) or sampling_problem(p.params, vocab_size)
        if message is not None:
            body = plan.rows[p.index // plan.n].body
            code = openai_io.failure_code(message, body)
            return ApiError(openai_io.STATUS.get(code, 400), message, code, openai_io.failure_param(message, body))
    return None


def plan_row(row: Row, tokenizer, max_model_len: int) -> list[Prepared]:
    """A Batch API request's prepared choices (indices 0 to n-1), planned as its endpoint
    plans the same body, with the same defaults; ApiError says why it cannot run."""
    _name_unknown_fields(row)  # a Batch API row's too (they went unsaid)
    row = replace(row, body=refuse_unsupported(row.body))
    # Unset max_tokens: as the endpoints (chat: the rest of the context; completions: 16).
    opts = JobOptions(input="-", output="-", max_tokens=max_model_len if row.url == CHAT else COMPLETION_MAX_TOKENS,
                      temperature=TEMPERATURE)
    params, n, spec = _params(row, opts, tokenizer, max_model_len)
    asked = refusals.asked_max_tokens(row.body, params) if row.url == CHAT else params.max_tokens
    ids = _checked(_render(row, tokenizer, max_model_len), max_model_len,
                   "the messages" if row.url == CHAT else "the prompt", asked, max_tokens_name(row.body))
    return _choices([ids], params, n, spec)


def prompt_ids(body: dict, tokenizer) -> list[int]:
    """A /tokenize body's token ids: its `prompt` as a completion's, or its `messages` as a chat's
    (with the chat template's fields), rendered as those endpoints render them, with no limit."""
    url = CHAT if body.get("messages") is not None else COMPLETION
    fields = {k: v for k, v in body.items() if k != "return_token_strs"}  # /tokenize's own
    return _render(_row(url, fields, "tokenize"), tokenizer, None)


def refuse_unsupported(body: dict) -> dict:
    """The body to plan, or ApiError naming a field this server cannot honour."""
    with _refusal_as_400():
        return refusals.refuse_unsupported(body)


@contextlib.contextmanager
def _refusal_as_400():
    """refusals.Refused (shared with `batchprompt run`) as the server's 400, with its code and param."""
    try:
        yield
    except refusals.Refused as e:
        raise ApiError(400, str(e), e.code, e.param) from None


def _prompts(prompt: Any) -> list[str | list[int]]:
    """vLLM's prompt forms: a string, a list of strings, a list of token ids, a list of those."""
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    else:
        raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids or a list of "
                            "token-id lists, and not empty", "invalid_prompt", "prompt")
    for i, p in enumerate(prompts):
        if isinstance(p, str) and p:
            continue
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            continue
        raise ApiError(400, f"prompt {i} is empty or not a string / token-id list: give text or token ids",
                       "invalid_prompt", "prompt")
    return prompts


def _row(url: str, body: dict, rid: str) -> Row:
    # row_from_body is the job reader's check of one body (messages, n, max_tokens); a bad body
    # is a RowError whose message starts with the line number, which means nothing here.
    row = job_rows.row_from_body(1, rid, url, body)
    if isinstance(row, RowError):
        message = row.message.removeprefix("line 1: ")
        raise ApiError(400, message, row.code, row.param or refusals.param_named(message, body))
    _name_unknown_fields(row)
    return row


def _name_unknown_fields(row: Row) -> None:
    """Ignored as vLLM ignores them, and named as it names them (here once each, not per request)."""
    new = sorted(set(row.unknown_fields) - _unknown_logged)
    if new:
        _unknown_logged.update(new)
        log.warning("requests name fields that are neither used nor OpenAI/vLLM request fields; they are "
                    "ignored: %s (each is named once)", ", ".join(new))


def _params(row: Row, opts: JobOptions, tokenizer, max_model_len: int):
    try:
        params, n = row_params(row, opts)
        spec = row_spec(row, opts)
        if spec is not None:
            params = spec.sampling_params(params, tokenizer, max_model_len)
    except (TypeError, ValueError) as e:
        message, param = str(e), refusals.param_named(str(e), row.body)
        if param == "guided_json" and message.startswith("json_schema "):  # the field the request named
            message = "guided_json" + message.removeprefix("json_schema")
        raise ApiError(400, message, "invalid_parameter", param) from None
    return params, n, spec


def _render(row: Row, tokenizer, max_model_len: int, what: str = "") -> list[int]:
    try:
        return render(row, tokenizer, None, max_model_len, what)
    except refusals.Refused as e:  # too long by its length alone
        raise ApiError(400, str(e), e.code, e.param) from None
    except InvalidText as e:  # it said "the prompt cannot be rendered: ValueError: ...", with no param
        chat = row.url == CHAT
        raise ApiError(400, f"{what or ('the messages' if chat else 'the prompt')}: {e}", "invalid_prompt",
                       "messages" if chat else "prompt") from None
    except Exception as e:  # noqa: BLE001  (a chat template that raises on these messages)
        raise ApiError(400, f"the prompt cannot be rendered: {type(e).__name__}: {e}", "invalid_prompt") from None


def _checked(ids: list[int], max_model_len: int, what: str, max_tokens: int | None, field: str,
             default: bool = False) -> list[int]:
    """The prompt's ids, or a 400 where the prompt plus `max_tokens` (when asked for, in `field`;
    `default`: the endpoint's own) does not fit."""
    with _refusal_as_400():
        return refusals.check_context(ids, max_model_len, what, max_tokens, field, default)


def _choices(all_ids: list[list[int]], params, n: int, spec) -> list[Prepared]:
    out = []
    for ids in all_ids:
        for choice in range(n):
            p = params
            if n > 1 and params.seed is not None:  # seeded choices differ, as in `batchprompt run`
                try:
                    p = replace(params, seed=params.seed + choice)
                except ValueError as e:
                    raise ApiError(400, str(e), "invalid_parameter", "seed") from None
            out.append(Prepared(len(out), ids, p, spec=spec))
    return out
