"""A batch's requests in the engine: each request's choices become items of one API Batch, and
each finished request becomes its output line (or error line), in the shapes `batchprompt run`
writes (jobs/openai_io.py). Requests are planned as the endpoints plan a body (requests.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..api.batch import Prepared
from ..api.result import Result
from ..jobs import openai_io
from ..jobs.rows import Row, RowError
from .errors import ApiError
from .requests import plan_row

#: What a request that did not finish says, by how its batch ended (OpenAI's codes). Some had
#: started ("before this request ran" was said of those too).
UNFINISHED = {"cancelled": ("batch_cancelled", "the batch was cancelled before this request finished"),
              "expired": ("batch_expired", "this request could not finish before the batch's completion window "
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


def refused_line(err: RowError, job: str = "") -> dict[str, Any]:
    return openai_io.row_error_line(err, job)


def unfinished_line(row: Row | RowError, ended: str, job: str = "") -> dict[str, Any]:
    code, message = UNFINISHED[ended]
    return openai_io.error_line(row.line, row.custom_id, code, f"line {row.line}: {message}", job)
