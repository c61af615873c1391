"""Reading a job's input: one Row per input line (or table row), or a RowError for a bad one.

Formats: OpenAI Batch API JSONL (`custom_id`, `method`, `url`, `body`), plain JSONL with
`prompt` or `messages` (optional `id`), CSV and Parquet with a prompt column. A bad line
becomes a RowError with its line number; it never stops the others.
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"
COMPLETION_OR_CHAT = "plain"  # plain JSONL: a "prompt" string is a user turn (chat template applies)
#: Body fields we act on; others (model, user, metadata, ...) are accepted and ignored.
KNOWN_FIELDS = {"messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                "seed", "stop", "n", "logprobs", "top_logprobs", "top_k",
                "response_format", "guided_choice", "guided_regex", "guided_json", "guided_grammar",
                "structured_outputs", "choice_mode"}


class InputError(Exception):
    """The input as a whole cannot be read (missing file, unknown format, no such column)."""


@dataclass(frozen=True)
class Row:
    line: int  # 1-based line (JSONL) or data row (CSV/Parquet) number
    custom_id: str
    url: str  # CHAT or COMPLETION
    messages: list[dict] | None = None
    prompt: str | None = None
    body: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RowError:
    line: int
    custom_id: str | None
    code: str
    message: str


@dataclass
class Table:
    """The input as read: rows, and for CSV/Parquet the table itself (for --format table)."""

    rows: list[Row | RowError]
    format: str  # "jsonl", "csv" or "parquet"
    raw: bytes
    table: Any = None  # pyarrow.Table for csv/parquet


def detect_format(path: str) -> str:
    suffix = Path(path).suffix.lower()
    if path == "-" or suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if suffix in (".csv", ".tsv"):
        return "csv"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise InputError(f"{path}: unknown input format {suffix!r}; use .jsonl (OpenAI batch or plain "
                     f"prompt/messages lines), .csv or .parquet (with --column)")


def read_input(path: str, column: str | None = None, stdin=None) -> Table:
    fmt = detect_format(path)
    if path == "-":
        raw = (stdin or __import__("sys").stdin.buffer).read()
    else:
        p = Path(path)
        if not p.is_file():
            raise InputError(f"{path}: no such input file")
        raw = p.read_bytes()
    if fmt == "jsonl":
        if column:
            raise InputError("--column applies to CSV and Parquet input, not JSONL")
        return Table(read_jsonl(raw), "jsonl", raw)
    table = _read_table(raw, fmt, path)
    if not column:
        raise InputError(f"{path}: {fmt} input needs --column naming the prompt column "
                         f"(columns: {', '.join(table.column_names)})")
    if column not in table.column_names:
        raise InputError(f"{path}: no column {column!r}; the columns are: {', '.join(table.column_names)}")
    rows: list[Row | RowError] = []
    for i, value in enumerate(table.column(column).to_pylist(), 1):
        if not isinstance(value, str) or not value.strip():
            rows.append(RowError(i, f"row-{i}", "invalid_prompt", f"row {i}: column {column!r} is empty"))
        else:
            rows.append(Row(i, f"row-{i}", CHAT, messages=[{"role": "user", "content": value}]))
    return Table(rows, fmt, raw, table)


def _read_table(raw: bytes, fmt: str, path: str):
    try:
        import pyarrow as pa
        import pyarrow.csv as pacsv
        import pyarrow.parquet as pq
    except ImportError as e:
        raise InputError(f"{path}: reading {fmt} needs pyarrow: pip install pyarrow") from e
    try:
        if fmt == "parquet":
            return pq.read_table(pa.BufferReader(raw))
        delimiter = "\t" if path.endswith(".tsv") else ","
        return pacsv.read_csv(pa.BufferReader(raw), parse_options=pacsv.ParseOptions(delimiter=delimiter),
                              convert_options=pacsv.ConvertOptions(strings_can_be_null=False))
    except (pa.ArrowInvalid, OSError) as e:
        raise InputError(f"{path}: cannot read it as {fmt}: {e}") from e


def read_jsonl(raw: bytes) -> list[Row | RowError]:
    rows: list[Row | RowError] = []
    text = raw.decode("utf-8", errors="replace")
    for n, line in enumerate(io.StringIO(text), 1):
        if not line.strip():
            continue
        rows.append(parse_line(n, line))
    return rows


def parse_line(n: int, line: str) -> Row | RowError:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return RowError(n, None, "invalid_json", f"line {n}: not valid JSON ({e.msg} at column {e.colno})")
    if not isinstance(obj, dict):
        return RowError(n, None, "invalid_request", f"line {n}: expected a JSON object")
    if "body" in obj or "url" in obj or "custom_id" in obj:
        return _openai_row(n, obj)
    cid = str(obj.get("id", f"line-{n}"))
    return _from_body(n, cid, CHAT if "messages" in obj else COMPLETION_OR_CHAT, obj)


def _openai_row(n: int, obj: dict) -> Row | RowError:
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return RowError(n, None, "missing_custom_id", f"line {n}: an OpenAI batch line needs a string custom_id")
    method = obj.get("method", "POST")
    if method != "POST":
        return RowError(n, cid, "invalid_method", f"line {n}: method must be POST, got {method!r}")
    url = obj.get("url")
    if url not in (CHAT, COMPLETION):
        return RowError(n, cid, "invalid_url",
                        f"line {n}: url {url!r} is not supported; use {CHAT} or {COMPLETION}")
    body = obj.get("body")
    if not isinstance(body, dict):
        return RowError(n, cid, "missing_body", f"line {n}: the line has no body object")
    return _from_body(n, cid, url, body)


def _from_body(n: int, cid: str, url: str, body: dict) -> Row | RowError:
    if url in (CHAT, COMPLETION_OR_CHAT) and "messages" in body:
        msgs = body["messages"]
        if not (isinstance(msgs, list) and msgs and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs)):
            return RowError(n, cid, "invalid_messages",
                            f"line {n}: messages must be a non-empty list of {{role, content}} with string content")
        return Row(n, cid, CHAT, messages=[{"role": m["role"], "content": m["content"]} for m in msgs], body=body)
    prompt = body.get("prompt")
    if url == CHAT:
        return RowError(n, cid, "missing_messages", f"line {n}: a chat completion body needs messages")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        return RowError(n, cid, "missing_prompt", f"line {n}: the line needs a non-empty prompt string or messages")
    if url == COMPLETION_OR_CHAT:  # plain JSONL: the prompt is the user's turn
        return Row(n, cid, CHAT, messages=[{"role": "user", "content": prompt}], body=body, prompt=None)
    return Row(n, cid, COMPLETION, prompt=prompt, body=body)


def read_rows(path: str, column: str | None = None) -> list[Row | RowError]:
    return read_input(path, column).rows

