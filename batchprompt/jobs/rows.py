"""Reading a job's input: one Row per input line (or table row), or a RowError for a bad one.

Formats: OpenAI Batch API JSONL (`custom_id`, `method`, `url`, `body`), plain JSONL with
`prompt` or `messages` (optional `id`), CSV and Parquet with a prompt column. A bad line
becomes a RowError with its line number; it never stops the others.

Text is UTF-8; a byte-order mark at the start is skipped. Bytes that are not UTF-8 are
replaced with U+FFFD and the row carries a warning, so the job can say how many rows had them.
Body fields that are neither used nor known OpenAI/vLLM fields are ignored (as vLLM does) and
counted per name on the Table, so the job can name them once.
"""
from __future__ import annotations

import json
import re
import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..api.messages import check_messages
from .bodies import CHAT, COMPLETION, ENDPOINT_BODIES, type_problem, whole_numbers

COMPLETION_OR_CHAT = "plain"  # plain JSONL: a "prompt" string is a user turn (chat template applies)
#: Body fields we act on.
KNOWN_FIELDS = {"messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                "seed", "stop", "n", "logprobs", "top_logprobs", "top_k",
                "response_format", "guided_choice", "guided_regex", "guided_json", "guided_grammar",
                "structured_outputs", "choice_mode", "presence_penalty", "frequency_penalty", "logit_bias",
                "best_of", "min_p", "repetition_penalty", "include_stop_str_in_output", "min_tokens",
                "stop_token_ids", "ignore_eos"}
#: Fields of OpenAI's and vLLM's chat and completion requests that we accept and ignore without
#: a word (`model`: the command's --model runs every row). Anything else is counted as unknown.
IGNORED_FIELDS = {
    # OpenAI chat and completions
    "model", "user", "metadata", "store", "stream", "stream_options", "service_tier", "tools", "tool_choice", "parallel_tool_calls", "functions",
    "function_call", "modalities", "audio", "prediction", "reasoning_effort", "verbosity",
    "web_search_options", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "moderation",
    "echo", "suffix",
    # vLLM extra parameters
    "use_beam_search", "length_penalty", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids",
    "bad_words", "add_generation_prompt", "continue_final_message", "add_special_tokens", "documents",
    "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "guided_decoding_backend",
    "guided_whitespace_pattern", "priority", "request_id", "return_tokens_as_token_ids", "return_token_ids",
    "cache_salt",
    "kv_transfer_params", "vllm_xargs", "include_reasoning", "thinking_token_budget"}
#: Chat's fields that a completions body does not have (its log-probs are `logprobs: k`): ignored
#: there, and named as unknown, as vLLM names them (they were ignored without a word).
CHAT_ONLY_FIELDS = {"top_logprobs"}
#: Top-level keys of a plain JSONL line that are not body fields.
PLAIN_LINE_KEYS = {"id"}
MAX_N = 128  # OpenAI's limit on choices per request
INVALID_UTF8 = "invalid UTF-8 replaced with U+FFFD"


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
    warnings: tuple[str, ...] = ()  # things a person should hear about (INVALID_UTF8)
    unknown_fields: tuple[str, ...] = ()  # body fields ignored as unknown


@dataclass(frozen=True)
class RowError:
    line: int
    custom_id: str | None
    code: str
    message: str
    param: str | None = None  # the field it is about, as OpenAI's error names it


@dataclass
class Table:
    """The input as read: rows, and for CSV/Parquet the table itself (for --format table)."""

    rows: list[Row | RowError]
    format: str  # "jsonl", "csv" or "parquet"
    raw: bytes
    table: Any = None  # pyarrow.Table for csv/parquet

    @property
    def invalid_utf8_rows(self) -> int:
        return sum(isinstance(r, Row) and INVALID_UTF8 in r.warnings for r in self.rows)

    @property
    def unknown_fields(self) -> Counter[str]:
        """Unknown body field name -> rows that had it (ignored, as vLLM ignores them)."""
        return Counter(f for r in self.rows if isinstance(r, Row) for f in r.unknown_fields)

    def notes(self) -> list[str]:
        """One line each for the job summary about what was read but not as written."""
        notes = []
        if self.invalid_utf8_rows:
            notes.append(f"{_rows(self.invalid_utf8_rows)} had invalid UTF-8 (replaced with U+FFFD)")
        if streamed := sum(isinstance(r, Row) and bool(r.body.get("stream")) for r in self.rows):
            notes.append(f"{_rows(streamed)} asked for stream: true; a job writes whole results, so "
                         f"{'it runs' if streamed == 1 else 'they run'} unstreamed")
        if self.unknown_fields:
            names = ", ".join(f"{name} ({_rows(n)})" for name, n in sorted(self.unknown_fields.items()))
            notes.append(f"ignored unknown body fields: {names}")
        return notes


def _rows(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


PARQUET_SUFFIXES = (".parquet", ".pq")


def detect_format(path: str, raw: bytes | None = None) -> str:
    """The input's format, by its name's suffix; a name without a known one (a process
    substitution's /dev/fd/63, a file named `requests`) is JSON lines if it starts with '{'."""
    suffix = Path(path).suffix.lower()
    if path == "-" or suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if suffix in (".csv", ".tsv"):
        return "csv"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    if raw is not None and raw.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"{"):
        return "jsonl"
    raise InputError(f"{path}: unknown input format {suffix or '(no suffix)'!r}; use .jsonl (OpenAI batch or plain "
                     f"prompt/messages lines), .csv, .tsv or .parquet (with --column), or give JSON lines on "
                     f"standard input as -")


def check_wide_encoding(raw: bytes, name: str) -> None:
    """A text file that no reader here can read, named for what it is: UTF-16 (what Windows
    PowerShell's `>` writes) or UTF-32 failed as "no line is JSON ... write a CSV"."""
    head = raw[:4096]
    wide = "UTF-32" if head.startswith((b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff")) else None
    if wide is None and (head.startswith((b"\xff\xfe", b"\xfe\xff"))
                         or (len(head) >= 4 and head.count(b"\x00") * 4 >= len(head))):
        wide = "UTF-16"
    if wide is not None:
        shown = " (as Windows PowerShell's > writes)" if wide == "UTF-16" else ""
        raise InputError(f"{name} is {wide}{shown}, not UTF-8: save it as UTF-8 (PowerShell: "
                         f"Set-Content -Encoding utf8; or iconv -f {wide} -t UTF-8)")


def check_line_ends(raw: bytes, name: str) -> None:
    """JSON lines that end with CR alone read as one line (a CSV reader takes CR as a line end)."""
    if b"\r" in raw and b"\n" not in raw:
        raise InputError(f"{name}: its lines end with a carriage return alone (CR, old Mac line endings), which "
                         f"reads as one line: end them with LF or CRLF (tr '\\r' '\\n' < old > new)")


def read_input(path: str, column: str | None = None, stdin=None) -> Table:
    if path != "-" and Path(path).is_dir():  # before its name's format ("unknown input format ''")
        raise InputError(f"{path}: is a folder, not an input file; give the file in it (a .jsonl, .csv or "
                         f".parquet file)")
    if path == "-":
        try:  # a closed stdin (`<&-`) is None; one open for writing only reads with EBADF
            raw = (stdin or __import__("sys").stdin.buffer).read()
        except (AttributeError, OSError) as e:
            why = e.strerror if isinstance(e, OSError) else "it is closed"
            raise InputError(f"standard input (-): cannot read it ({why})") from None
    else:
        p = Path(path)
        if not p.exists():  # a FIFO (`<(zcat in.jsonl.gz)`) is read as a file is
            raise InputError(f"{path}: no such input file")
        try:
            raw = p.read_bytes()
        except OSError as e:  # no read permission: a PermissionError traceback, exit 1
            raise InputError(f"{path}: cannot read it ({e.strerror})") from None
    name = "standard input (-)" if path == "-" else path
    if Path(path).suffix.lower() not in PARQUET_SUFFIXES:  # a UTF-16 file without a suffix too
        check_wide_encoding(raw, name)
    fmt = detect_format(path, raw)
    if fmt == "jsonl":
        check_line_ends(raw, name)
        if column:
            raise InputError("--column applies to CSV and Parquet input, not JSONL")
        rows = read_jsonl(raw)
        if rows and all(isinstance(r, RowError) and r.code == "invalid_json" for r in rows):
            # Plain text (one prompt a line) failed every line as "not valid JSON", exit 1.
            name = "standard input (-)" if path == "-" else path
            raise InputError(f"{name}: no line is JSON ({rows[0].message}): the input is JSON lines, one request "
                             f"each ({{\"prompt\": \"...\"}}, or OpenAI's batch lines); for plain text, one prompt a "
                             f"line, write a CSV with a header and give --column") from None
        return Table(rows, "jsonl", raw)
    table = _read_table(raw, fmt, path, column)
    if not column:
        raise InputError(f"{path}: {fmt} input needs --column naming the prompt column "
                         f"(columns: {', '.join(table.column_names)})")
    if column not in table.column_names:
        raise InputError(f"{path}: no column {column!r}; the columns are: {', '.join(table.column_names)}")
    _check_text_column(table, column, path)
    table, bad = _replace_invalid_utf8(table)
    rows: list[Row | RowError] = []
    for i, value in enumerate(table.column(column).to_pylist(), 1):
        if not isinstance(value, str) or not value.strip():
            rows.append(RowError(i, f"row-{i}", "invalid_prompt", f"row {i}: column {column!r} is empty"))
        else:
            rows.append(Row(i, f"row-{i}", CHAT, messages=[{"role": "user", "content": value}],
                            warnings=(INVALID_UTF8,) if i - 1 in bad else ()))
    return Table(rows, fmt, raw, table)


def _check_text_column(table, column: str, path: str) -> None:
    """A prompt column that is not text (Parquet's own types: numbers, dates, ...) is one error
    naming its type; each row of it was "empty"."""
    import pyarrow as pa

    t = table.schema.field(column).type
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t) or pa.types.is_null(t):
        return
    kind = ("numbers" if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)
            else "booleans" if pa.types.is_boolean(t) else "binary data" if pa.types.is_binary(t)
            else "dates or times" if pa.types.is_temporal(t) else "values")
    raise InputError(f"{path}: column {column!r} holds {kind} ({t}), not text: --column names the column of "
                     f"prompts, a text (string) column")


def _read_table(raw: bytes, fmt: str, path: str, column: str | None = None):
    try:
        import pyarrow as pa
        import pyarrow.csv as pacsv
        import pyarrow.parquet as pq
    except ImportError as e:
        raise InputError(f"{path}: reading {fmt} needs pyarrow: pip install pyarrow") from e
    try:
        # use_threads=False: on the calling thread. pyarrow's reader threads, still starting as
        # an input error ended the command, aborted it (exit 134, "terminate called without an
        # active exception") in about 1 of 3 runs on a busy machine.
        if fmt == "parquet":
            # pre_buffer=False too: its reads ran on pyarrow's IO threads, and an input error then
            # aborted the exit as above (exit 134 in 5 of 10 runs beside two busy processes).
            parquet = pq.ParquetFile(pa.BufferReader(raw), pre_buffer=False)
            _check_names(parquet.schema_arrow.names, path)
            return parquet.read(use_threads=False)
        tsv = path.lower().endswith(".tsv")
        delimiter = "\t" if tsv else ","
        if not tsv:
            _check_quotes_close(raw, path)

        def read(block_size: int | None = None):
            # Not checking UTF-8 here keeps text columns text (checked, pyarrow would turn a column
            # with one bad byte into binary); _replace_invalid_utf8 repairs them. pyarrow skips a BOM.
            # Every column is text as written: the prompt column of numbers ("42", "007") is prompts
            # too, and --format table gives the other columns back as they came (typed, zip code
            # 00501 came back 501, 1.50 as 1.5, NA empty; and a column of numbers with a word
            # after the first block failed the whole file).
            read_options = pacsv.ReadOptions(block_size=block_size, use_threads=False)
            # A TSV has no quoting (IANA's text/tab-separated-values; what cut and awk read): a cell
            # starting with '"' merged the next lines into it (5,574 SMS read as 5,572, silently).
            parse_options = pacsv.ParseOptions(delimiter=delimiter, quote_char=False if tsv else '"')
            names = _header(raw, block_size, parse_options)
            _check_names(names, path)
            types = {name: pa.string() for name in names}
            return pacsv.read_csv(pa.BufferReader(raw), read_options=read_options, parse_options=parse_options,
                                  convert_options=pacsv.ConvertOptions(strings_can_be_null=False, check_utf8=False,
                                                                       column_types=types))
        try:
            return read()
        except pa.ArrowInvalid as e:
            if "straddl" not in str(e):
                raise
            # A cell larger than pyarrow's 1 MiB block (a document of megabytes): the whole file as
            # one block. That row is then refused as too long for the context, alone.
            return read(min(len(raw) + 1, 2**31 - 1))
    except (pa.ArrowInvalid, OSError) as e:
        kind = "tsv" if path.lower().endswith(".tsv") else fmt
        ragged = re.search(r"Row #(\d+): Expected (\d+) columns, got (\d+)", str(e))
        if ragged:  # pyarrow counts the header as row 1; its "CSV parse error" said so of a .tsv too
            row, want, got = ragged.groups()
            sep = "tab" if kind == "tsv" else "comma"
            why = (f"a {sep} in a cell splits it in two" + ("" if kind == "tsv" else ": quote such a cell")
                   if int(got) > int(want) else f"an empty cell is nothing between two {sep}s")
            cells = "1 cell" if got == "1" else f"{got} cells"
            raise InputError(f"{path}: record {row} of the file (the header is record 1) has {cells} where the "
                             f"header has {want}: give every record the header's columns ({why})") from None
        raise InputError(f"{path}: cannot read it as {kind}: {e}") from e


def _check_quotes_close(raw: bytes, path: str) -> None:
    """A CSV cell that opens a quote and never closes it is the rest of the file: pyarrow read
    a stray quote on line 3 of 6 as 2 rows, silently (as pandas refuses it: "EOF inside string").
    Read as pyarrow reads: a '"' opens a quoted cell only at a cell's start, '""' inside one is a
    quote, and the first lone '"' closes it (what follows up to the comma stays in the cell); a
    '"' anywhere else is text. Only the quotes are visited (str.find), so a large file costs little."""
    text = raw.decode("utf-8", "replace")
    starts = ",\n\r\ufeff"  # what a cell's first character follows (the file's start too)
    at = text.find('"')
    while at != -1:
        if at > 0 and text[at - 1] not in starts:  # inside an unquoted cell: text
            at = text.find('"', at + 1)
            continue
        end = at + 1
        while True:
            end = text.find('"', end)
            if end == -1:
                line = text.count("\n", 0, at) + 1
                raise InputError(f"{path}: line {line} opens a quoted cell that is never closed, so the rest of the "
                                 f"file would be one cell: close that quote, or double each \" inside a quoted cell "
                                 f"(\"\")")
            if text.startswith('""', end):
                end += 2
                continue
            break
        at = text.find('"', end + 1)


def _header(raw: bytes, block_size: int | None, parse_options) -> list[str]:
    """A CSV's column names: the header read alone, every row skipped. (Not open_csv: its
    read-ahead thread brings back the abort that use_threads=False avoids.)"""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    def names(skip: int) -> list[str]:
        return pacsv.read_csv(pa.BufferReader(raw), parse_options=parse_options,
                              read_options=pacsv.ReadOptions(block_size=block_size, use_threads=False,
                                                             skip_rows_after_names=skip),
                              convert_options=pacsv.ConvertOptions(check_utf8=False)).column_names
    try:
        return names(2**31 - 1)
    except pa.ArrowInvalid:  # skipping past the end of a file that is a header alone fails ("straddling")
        return names(0)


def _check_names(names: list[str], path: str) -> None:
    """A header that names a column twice (two blank names, from a spreadsheet) is one error: it
    failed later in pyarrow's words ('Field "" exists 2 times in schema')."""
    seen: dict[str, int] = {}
    for i, name in enumerate(names, 1):
        if name in seen:
            shown = "no name" if not name.strip() else f"the name {name!r}"
            raise InputError(f"{path}: columns {seen[name]} and {i} of the header have {shown}: give each column "
                             f"a name of its own")
        seen[name] = i


def _replace_invalid_utf8(table):
    """The table with invalid UTF-8 in its text columns replaced by U+FFFD (so the prompt and a
    --format table output are valid text), and the 0-based indices of the rows that had any."""
    import pyarrow as pa

    bad: set[int] = set()
    for name in table.column_names:
        col = table.column(name)
        if not pa.types.is_string(col.type):
            continue
        try:
            col.validate(full=True)
            continue
        except pa.ArrowInvalid:
            pass
        values = []
        for i, b in enumerate(col.cast(pa.binary()).to_pylist()):
            text, ok = _decode(b) if b is not None else (None, True)
            if not ok:
                bad.add(i)
            values.append(text)
        table = table.set_column(table.column_names.index(name), name, pa.array(values, pa.string()))
    return table, bad


def _decode(b: bytes) -> tuple[str, bool]:
    """The text of `b`, and whether it was valid UTF-8 (if not, bad bytes become U+FFFD)."""
    try:
        return b.decode("utf-8"), True
    except UnicodeDecodeError:
        return b.decode("utf-8", errors="replace"), False


def read_jsonl(raw: bytes) -> list[Row | RowError]:
    rows: list[Row | RowError] = []
    if raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark, as some editors write
        raw = raw[3:]
    # Split the bytes, not the text: a newline byte never occurs inside a UTF-8 sequence, and each
    # line is decoded alone so that its invalid bytes are its own warning.
    for n, chunk in enumerate(raw.split(b"\n"), 1):
        line, ok = _decode(chunk)
        if not line.strip():
            continue
        row = parse_line(n, line)
        if not ok:
            row = _id_as_written(row, chunk)
        if not ok and isinstance(row, Row):
            row = replace(row, warnings=row.warnings + (INVALID_UTF8,))
        rows.append(row)
    return rows


def _id_as_written(row: Row | RowError, chunk: bytes) -> Row | RowError:
    """The row with its id as the line's bytes have it, where those are not UTF-8: each bad
    byte a lone surrogate (which ids.check_ids refuses as not text), not U+FFFD. With U+FFFD,
    an id changed without a word, and two ids that differ in their bad bytes ("a\xff", "a\xfe")
    refused the whole file as duplicates."""
    if row.custom_id is None or "\ufffd" not in row.custom_id:
        return row
    try:
        obj = json_loads(chunk.decode("utf-8", errors="surrogateescape"))
    except ValueError:
        return row
    raw = obj.get("custom_id", obj.get("id")) if isinstance(obj, dict) else None
    return replace(row, custom_id=raw) if isinstance(raw, str) and raw != row.custom_id else row


class _NotJson(ValueError):
    pass


def _no_constant(name: str) -> Any:
    raise _NotJson(name)


def json_loads(text: str | bytes) -> Any:
    """json.loads of strict JSON, as OpenAI reads it: NaN and Infinity (which Python's json
    takes) are a JSONDecodeError, as is JSON nested too deeply for it (a RecursionError: the
    depth that raises it differs by Python version, from 5,000 levels or fewer to tens of thousands), so
    that such input is refused like any other bad JSON. A UTF-8 byte-order mark before the JSON
    is skipped on any line, as on the first (files saved with one and joined with `cat`: Python's
    "Unexpected UTF-8 BOM (decode using utf-8-sig)" failed the row)."""
    if isinstance(text, str):
        text = text.removeprefix("\ufeff")
    else:
        text = text.removeprefix(b"\xef\xbb\xbf")
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        doc = text if isinstance(text, str) else text.decode("utf-8", "replace")
        raise json.JSONDecodeError("nested too deeply for the JSON parser", doc, 0) from None
    except _NotJson as e:
        doc = text if isinstance(text, str) else text.decode("utf-8", "replace")
        raise json.JSONDecodeError(f"{e} is not a JSON value (write a number, or null)", doc,
                                   max(doc.find(str(e)), 0)) from None
    except ValueError as e:
        if "integer string conversion" not in str(e):  # a JSONDecodeError, invalid UTF-8 bytes: the callers' own
            raise
        # Python's limit on an integer's digits (sys.get_int_max_str_digits): a plain ValueError
        # failed a whole `run`, and a Batch API file as an internal error without its line.
        doc = text if isinstance(text, str) else text.decode("utf-8", "replace")
        at = re.search(r"\d{%d,}" % (sys.get_int_max_str_digits() + 1), doc)
        raise json.JSONDecodeError(f"a number has more digits than the {sys.get_int_max_str_digits():,} a number is "
                                   f"read with", doc, at.start() if at else 0) from None


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type (an error message's "got an array")."""
    if isinstance(value, bool):
        return "a boolean"
    return {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
            type(None): "null"}.get(type(value), type(value).__name__)


def parse_line(n: int, line: str) -> Row | RowError:
    try:
        obj = json_loads(line)
    except json.JSONDecodeError as e:
        where = "column" if e.msg.endswith(" at") else "at column"  # "Unterminated string starting at"
        return RowError(n, None, "invalid_json", f"line {n}: not valid JSON ({e.msg} {where} {e.colno})")
    if not isinstance(obj, dict):
        return RowError(n, None, "invalid_request", f"line {n}: expected a JSON object, got {json_type(obj)}")
    if "body" in obj or "url" in obj or "custom_id" in obj:
        return _openai_row(n, obj)
    raw = obj.get("id")  # null is no id (it became the id "None"); a number or other JSON reads as JSON
    cid = f"line-{n}" if raw is None else raw if isinstance(raw, str) else json.dumps(raw, ensure_ascii=False)
    if obj.get("messages") is not None and obj.get("prompt") is not None:  # the prompt was dropped, unsaid
        return RowError(n, cid, "invalid_request", f"line {n}: the line has both prompt and messages: give one "
                                                   f"(prompt: one user turn; messages: the whole chat)", "prompt")
    chat = obj.get("messages") is not None or ("messages" in obj and obj.get("prompt") is None)  # a null is none
    other = "prompt" if chat else "messages"  # null beside the one given: left out
    body = {k: v for k, v in obj.items() if k not in PLAIN_LINE_KEYS and not (k == other and v is None)}
    return row_from_body(n, cid, CHAT if chat else COMPLETION_OR_CHAT, body)


def custom_id_wanted(cid: Any) -> str | None:
    """What a line's custom_id lacks ("a custom_id, a non-empty string ..."), or None if it is one."""
    if isinstance(cid, str) and cid:
        return None
    if cid == "":
        return "a custom_id, a non-empty string (it is empty)"
    if cid is None:
        return "a custom_id, a non-empty string"
    return f"a custom_id, a non-empty string (got {json_type(cid)}: write it in quotes)"


def _openai_row(n: int, obj: dict) -> Row | RowError:
    cid = obj.get("custom_id")
    if (wanted := custom_id_wanted(cid)) is not None:
        return RowError(n, None, "missing_custom_id", f"line {n}: an OpenAI batch line needs {wanted}", "custom_id")
    method = obj.get("method", "POST")
    if method != "POST":
        return RowError(n, cid, "invalid_method", f"line {n}: method must be POST, got {method!r}", "method")
    url = obj.get("url")
    if url is None:  # it said "url None is not supported"
        return RowError(n, cid, "missing_url", f"line {n}: the line has no url; give \"url\": \"{CHAT}\" or "
                                               f"\"{COMPLETION}\"", "url")
    if url not in (CHAT, COMPLETION):
        return RowError(n, cid, "invalid_url",
                        f"line {n}: url {url!r} is not supported; use {CHAT} or {COMPLETION}", "url")
    body = obj.get("body")
    if not isinstance(body, dict):
        return RowError(n, cid, "missing_body", f"line {n}: the line has no body object", "body")
    body = whole_numbers(ENDPOINT_BODIES[url], body)  # "max_tokens": 5.0 is 5, as the endpoint reads it
    wrong = type_problem(url, body, missing=False)  # the endpoint's 422, as a Batch API row has it
    if wrong is not None:
        return RowError(n, cid, "invalid_type", f"line {n}: {wrong[0]}", wrong[1])
    return row_from_body(n, cid, url, body)


def row_from_body(n: int, cid: str, url: str, body: dict) -> Row | RowError:
    """One request body as a Row (line `n`, id `cid`), or the RowError that says what is wrong
    with it: the check `batchprompt run` makes of each line, also used by the server."""
    problem = _check_counts(body)
    if problem:
        name, message = problem
        return RowError(n, cid, "invalid_parameter", f"line {n}: {message}", name)  # the server's code for it
    row = _row_from_body(n, cid, url, body)
    if isinstance(row, Row):
        unknown = tuple(k for k in body if (k not in KNOWN_FIELDS and k not in IGNORED_FIELDS)
                        or (url == COMPLETION and k in CHAT_ONLY_FIELDS))
        row = replace(row, unknown_fields=unknown) if unknown else row
    return row


def max_tokens_field(body: dict) -> Any:
    """The body's max_completion_tokens, else its max_tokens, else None. A null counts as not
    given, as in OpenAI's and vLLM's servers: the `openai` client sends
    `"max_completion_tokens": null` beside `max_tokens` where a caller passes None."""
    given = body.get("max_completion_tokens")
    return given if given is not None else body.get("max_tokens")


def echo_only(body: dict) -> bool:
    """A completion body that asks for its prompt alone (`echo: true` with max_tokens 0), which
    OpenAI's completions and vLLM answer with the prompt (and its log-probs), generating nothing."""
    return body.get("echo") is True and "messages" not in body and max_tokens_field(body) == 0


def max_tokens_name(body: dict) -> str:
    """The field that `max_tokens_field` reads, for messages about it."""
    return "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"


def _check_counts(body: dict) -> tuple[str, str] | None:
    """(field, what is wrong) with the body's n or max_tokens, if anything. Checked here because
    0 must not fall back to the default. (Temperature, top_p, seed, ... are SamplingParams' to
    check.)"""
    for name in ("n", "best_of"):  # best_of: as many sequences as n (a million would hold the engine)
        v = body.get(name)
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_N):
            return name, f"{name} must be an integer from 1 to {MAX_N}, got {v!r}"
    least = 0 if echo_only(body) else 1  # 0: the prompt alone
    for name in ("max_tokens", "max_completion_tokens"):
        v = body.get(name)
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= least):
            hint = " (0 only with echo: true, for the prompt alone)" if v == 0 and "messages" not in body else ""
            return name, f"{name} must be an integer >= 1{hint}, got {v!r}"
    return None


def _row_from_body(n: int, cid: str, url: str, body: dict) -> Row | RowError:
    if url in (CHAT, COMPLETION_OR_CHAT) and "messages" in body:
        try:
            msgs = check_messages(body["messages"], "messages")
        except ValueError as e:
            return RowError(n, cid, "invalid_messages", f"line {n}: {e}", "messages")
        return Row(n, cid, CHAT, messages=msgs, body=body)
    prompt = body.get("prompt")
    if url == CHAT:
        return RowError(n, cid, "missing_messages", f"line {n}: a chat completion body needs messages", "messages")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt:  # the endpoint's other forms: one answer per line here
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            fix = "give the prompt as text (the server's /v1/completions route takes token ids)"
            what = "token ids"
        else:
            fix, what = "put each prompt on a line of its own", f"a list of {len(prompt)} prompts"
        return RowError(n, cid, "unsupported_prompt", f"line {n}: the prompt is {what}; a batch line takes one "
                                                      f"prompt as text: {fix}", "prompt")
    if not isinstance(prompt, str) or not prompt:
        needs = "a non-empty prompt string" + (" or messages" if url == COMPLETION_OR_CHAT else "")
        return RowError(n, cid, "missing_prompt", f"line {n}: the line needs {needs}"
                        + (" (a completion body takes no messages)" if url == COMPLETION and "messages" in body else ""),
                        "prompt")
    if url == COMPLETION_OR_CHAT:  # plain JSONL: the prompt is the user's turn
        return Row(n, cid, CHAT, messages=[{"role": "user", "content": prompt}], body=body, prompt=None)
    return Row(n, cid, COMPLETION, prompt=prompt, body=body)


def read_rows(path: str, column: str | None = None) -> list[Row | RowError]:
    return read_input(path, column).rows

