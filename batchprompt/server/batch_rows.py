"""A batch's requests in the engine: each request's choices become items of one API Batch, and
each finished request becomes its output line (or error line), in the shapes `batchprompt run`
writes (jobs/openai_io.py). Requests are planned as the endpoints plan a body (requests.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..api.batch import Prepared
from ..api.result import Result
from ..jobs import openai_io
from ..jobs.rows import Row, RowError
from .errors import ApiError
from .requests import plan_row

#: What a request that never ran says, by how its batch ended (OpenAI's codes).
UNFINISHED = {"cancelled": ("batch_cancelled", "the batch was cancelled before this request ran"),
              "expired": ("batch_expired", "this request could not run before the batch's completion window "
                                           "ended")}


@dataclass(eq=False)
class Pending:
    row: Row
    choices: list[Result | None]


@dataclass
class Plan:
    items: list[Prepared] = field(default_factory=list)
    owners: list[tuple[Pending, int]] = field(default_factory=list)  # per item: its request and choice
    refused: list[tuple[Row, dict[str, Any]]] = field(default_factory=list)  # (request, its error line)


def plan_rows(rows: list[Row], tokenizer, max_model_len: int, job: str = "") -> Plan:
    """The engine's items for `rows`; a request that cannot run is refused with its error line
    (`job`, the batch's id, scopes the lines' ids: openai_io._id)."""
    plan = Plan()
    for row in rows:
        try:
            choices = plan_row(row, tokenizer, max_model_len)
        except ApiError as e:
            plan.refused.append((row, openai_io.error_line(row.line, row.custom_id, e.code or "invalid_request",
                                                           f"line {row.line}: {e.message}", job, e.param)))
            continue
        except Exception as e:  # noqa: BLE001  (whatever fails to plan one request is its own error)
            plan.refused.append((row, openai_io.error_line(row.line, row.custom_id, "invalid_request",
                                                           f"line {row.line}: {type(e).__name__}: {e}", job)))
            continue
        pending = Pending(row, [None] * len(choices))
        for c in choices:
            plan.items.append(Prepared(len(plan.items), c.token_ids, c.params, spec=c.spec))
            plan.owners.append((pending, c.index))
    return plan


@dataclass(frozen=True)
class Answer:
    ok: bool
    record: dict[str, Any]  # the output line, or the error line
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


def answer(p: Pending, model: str, created: int, token_text: Callable[[int], str], job: str = "") -> Answer:
    """The line of a request whose choices are all in."""
    row = p.row
    failed = openai_io.failed_choice(p.choices)
    if failed is not None:
        return Answer(False, openai_io.error_line(row.line, row.custom_id, openai_io.failure_code(failed.error),
                                                  f"line {row.line}: {failed.error}", job))
    try:
        body = openai_io.response_body(row, p.choices, model, created, token_text, job)
    except Exception as e:  # noqa: BLE001  (an answer that cannot be shaped is its request's error)
        return Answer(False, openai_io.error_line(row.line, row.custom_id, "request_failed",
                                                  f"line {row.line}: {type(e).__name__}: {e}", job))
    usage = body["usage"]
    return Answer(True, openai_io.output_line(row, body, job), usage["prompt_tokens"], usage["completion_tokens"],
                  usage["prompt_tokens_details"]["cached_tokens"])


def refused_line(err: RowError, job: str = "") -> dict[str, Any]:
    return openai_io.row_error_line(err, job)


def unfinished_line(row: Row | RowError, ended: str, job: str = "") -> dict[str, Any]:
    code, message = UNFINISHED[ended]
    return openai_io.error_line(row.line, row.custom_id, code, f"line {row.line}: {message}", job)
