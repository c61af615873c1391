"""Row ids (a custom_id, or a plain line's id): each unique in the file, each valid Unicode text.

OpenAI's Batch API refuses a file with a duplicated custom_id, since results are matched to
requests by it: the job refuses one before any work. An id holding a lone surrogate (JSON
"\\ud800") cannot be written as UTF-8: that row goes to the errors file, where its id is
written with JSON escapes (json.dumps with ensure_ascii), so it reads back as the same string.
"""
from __future__ import annotations

import json
from collections import defaultdict

from .rows import InputError, Row, RowError

SHOWN = 3  # duplicated ids named in the message


def check_ids(rows: list[Row | RowError], source: str) -> list[Row | RowError]:
    """`rows`, a row whose id is not valid text turned into its RowError; InputError naming
    the lines if any id is on more than one."""
    lines: dict[str, list[int]] = defaultdict(list)
    for r in rows:
        if r.custom_id is not None:
            lines[r.custom_id].append(r.line)
    dups = [(cid, at) for cid, at in lines.items() if len(at) > 1]
    if dups:
        named = "; ".join(f"{json.dumps(cid)} on {_lines(at)}{_automatic(cid, at)}" for cid, at in dups[:SHOWN])
        more = f" (and {len(dups) - SHOWN} more ids)" if len(dups) > SHOWN else ""
        raise InputError(f"{source}: duplicate custom_id: {named}{more}. Each custom_id (or id) must be unique, "
                         f"as OpenAI's Batch API requires, so that each result can be matched to its request")
    return [_invalid(r) if isinstance(r, Row) and not is_text(r.custom_id) else r for r in rows]


def _automatic(cid: str, at: list[int]) -> str:
    """A note where the id is one the reader gave a line or row that had none ("line-7")."""
    for n in at:
        for kind in ("line", "row"):
            if cid == f"{kind}-{n}":
                return f" ({kind} {n} has no id, so it is named {cid}: give it an id of its own)"
    return ""


def is_text(s: str) -> bool:
    """Whether `s` is Unicode text UTF-8 can write: no lone surrogate (JSON's "\\ud800")."""
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _invalid(row: Row) -> RowError:
    return RowError(row.line, row.custom_id, "invalid_custom_id",
                    f"line {row.line}: the id {json.dumps(row.custom_id)} is not valid Unicode text (it holds a "
                    f"lone surrogate, or bytes that are not UTF-8); use ids that are valid UTF-8", "custom_id")


def _lines(at: list[int]) -> str:
    shown = [str(n) for n in at[:5]]
    if len(at) > 5:
        return f"lines {', '.join(shown)} and {len(at) - 5} more"
    return f"lines {', '.join(shown[:-1])} and {shown[-1]}"
