"""Reading job inputs: OpenAI batch lines, plain lines, CSV and Parquet; bad rows become errors."""
from __future__ import annotations

import json
import re

import pytest

from batchprompt.jobs import openai_io
from batchprompt.jobs.rows import (CHAT, COMPLETION, INVALID_UTF8, InputError, Row, RowError, Table, parse_line,
                                   read_input, read_jsonl)
from batchprompt.jobs.run import JobOptions, row_params
from tests.json_depth import DEEP


def lines(*objs) -> bytes:
    return "\n".join(o if isinstance(o, str) else json.dumps(o) for o in objs).encode()


def test_openai_lines_and_plain_lines():
    rows = read_jsonl(lines(
        {"custom_id": "a", "method": "POST", "url": CHAT,
         "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}},
        {"custom_id": "b", "method": "POST", "url": COMPLETION, "body": {"prompt": "once upon"}},
        "",
        {"prompt": "plain", "id": 7},
        {"messages": [{"role": "user", "content": "m"}]},
    ))
    assert [type(r) for r in rows] == [Row] * 4
    assert (rows[0].custom_id, rows[0].url, rows[0].line) == ("a", CHAT, 1)
    assert (rows[1].url, rows[1].prompt) == (COMPLETION, "once upon")
    assert (rows[2].custom_id, rows[2].line, rows[2].messages) == ("7", 4, [{"role": "user", "content": "plain"}])
    assert rows[3].custom_id == "line-5"


@pytest.mark.parametrize("line, code", [
    ("{not json", "invalid_json"),
    ('{"prompt": ' + "[" * DEEP + "]" * DEEP + "}", "invalid_json"),  # too deep: was a RecursionError
    ('{"prompt": "p", "max_tokens": ' + "9" * 4301 + "}", "invalid_json"),  # a ValueError that ended the run
    ("[1, 2]", "invalid_request"),
    ({"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "body": {}}, "invalid_url"),
    ({"custom_id": "x", "method": "GET", "url": CHAT, "body": {}}, "invalid_method"),
    ({"custom_id": "x", "method": "POST", "body": {}}, "missing_url"),  # it said "url None is not supported"
    ({"custom_id": "x", "method": "POST", "url": CHAT}, "missing_body"),
    ({"method": "POST", "url": CHAT, "body": {}}, "missing_custom_id"),
    ({"custom_id": "x", "url": CHAT, "body": {"prompt": "p"}}, "missing_messages"),
    ({"custom_id": "x", "url": CHAT, "body": {"messages": [{"role": "user"}]}}, "invalid_messages"),
    ({"custom_id": "x", "url": COMPLETION, "body": {"prompt": ""}}, "missing_prompt"),
    ({"custom_id": "x", "url": COMPLETION, "body": {"prompt": ["a", "b"]}}, "unsupported_prompt"),  # was "needs a
    ({"custom_id": "x", "url": COMPLETION, "body": {"prompt": [504, 3]}}, "unsupported_prompt"),  # non-empty prompt"
])
def test_a_bad_line_is_an_error_with_its_line_number(line, code):
    rows = read_jsonl(lines({"prompt": "fine"}, line, {"prompt": "fine too"}))
    assert isinstance(rows[0], Row) and isinstance(rows[2], Row)
    err = rows[1]
    assert isinstance(err, RowError) and err.code == code and err.line == 2
    assert err.message.startswith("line 2:")


def test_messages_say_what_the_line_got_in_jsons_words():
    # NaN was taken (Python's json reads it; JSON has no NaN), "[1, 2]" said only "expected a
    # JSON object", and a completion row with messages was told to give "a prompt or messages".
    nan, array, msgs = read_jsonl(lines('{"prompt": "x", "temperature": NaN}', "[1, 2]",
                                        {"custom_id": "x", "url": COMPLETION,
                                         "body": {"messages": [{"role": "user", "content": "hi"}]}}))
    assert nan.code == "invalid_json" and "NaN is not a JSON value" in nan.message
    assert array.message == "line 2: expected a JSON object, got an array"
    assert msgs.code == "missing_prompt"
    assert msgs.message == "line 3: the line needs a non-empty prompt string (a completion body takes no messages)"
    [plain] = read_jsonl(lines({"prompt": ""}))
    assert plain.message == "line 1: the line needs a non-empty prompt string or messages"
    # Token ids were told to "put each prompt on a line of its own", which the line already was.
    ids, many = read_jsonl(lines({"custom_id": "x", "url": COMPLETION, "body": {"prompt": [504, 3]}},
                                 {"custom_id": "y", "url": COMPLETION, "body": {"prompt": ["a", "b"]}}))
    assert ids.message.endswith("the prompt is token ids; a batch line takes one prompt as text: give the prompt "
                                "as text (the server's /v1/completions route takes token ids)")
    assert many.message.endswith("a list of 2 prompts; a batch line takes one prompt as text: put each prompt on "
                                 "a line of its own")


def test_an_empty_custom_id_is_named_as_empty():
    # It said "needs a string custom_id", of an id that is a string.
    [err] = read_jsonl(lines({"custom_id": "", "url": CHAT, "body": {}}))
    assert err.code == "missing_custom_id"
    assert err.message == "line 1: an OpenAI batch line needs a custom_id, a non-empty string (it is empty)"


def test_body_fields_and_command_defaults():
    opts = JobOptions("in", "out", max_tokens=5, temperature=0.0, seed=3)
    row = read_jsonl(lines({"custom_id": "a", "url": CHAT, "body": {
        "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 9, "temperature": 0.5,
        "stop": "\n", "n": 2, "top_p": 0.9, "logprobs": True}}))[0]
    params, n = row_params(row, opts)
    assert (params.max_tokens, params.temperature, params.stop, params.seed, params.top_p, params.logprobs, n) == \
        (9, 0.5, ("\n",), 3, 0.9, True, 2)
    plain = read_jsonl(lines({"prompt": "x"}))[0]
    params, n = row_params(plain, opts)
    assert (params.max_tokens, params.temperature, n) == (5, 0.0, 1)
    bad = read_jsonl(lines({"custom_id": "a", "url": CHAT, "body": {
        "messages": [{"role": "user", "content": "x"}], "temperature": -1}}))[0]
    with pytest.raises(ValueError, match="temperature"):
        row_params(bad, opts)


def test_tables_need_a_column(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("id,text\n1,hello\n2,\n3,bye\n")
    with pytest.raises(InputError, match="needs --column.*id, text"):
        read_input(str(p))
    with pytest.raises(InputError, match="no column 'txt'"):
        read_input(str(p), "txt")
    table = read_input(str(p), "text")
    assert [type(r) for r in table.rows] == [Row, RowError, Row]
    assert table.rows[1].line == 2 and "empty" in table.rows[1].message


def test_missing_and_unknown_inputs(tmp_path):
    with pytest.raises(InputError, match="no such input file"):
        read_input(str(tmp_path / "nope.jsonl"))
    (tmp_path / "x.txt").write_text("hello\n")
    with pytest.raises(InputError, match="unknown input format '.txt'.*or give JSON lines on standard input as -"):
        read_input(str(tmp_path / "x.txt"))
    (tmp_path / "batch.jsonl").mkdir()  # was "no such input file"
    with pytest.raises(InputError, match="batch.jsonl: is a folder, not an input file"):
        read_input(str(tmp_path / "batch.jsonl"))


def chat(body_extra=None, **line):
    return {"custom_id": "a", "url": CHAT, "body": {"messages": [{"role": "user", "content": "x"}],
                                                       **(body_extra or {})}, **line}


@pytest.mark.parametrize("body, code, match", [
    ({"n": 0}, "invalid_parameter", r"n must be an integer from 1 to 128, got 0"),
    ({"n": -1}, "invalid_parameter", r"n must be an integer from 1 to 128"),
    ({"n": 129}, "invalid_parameter", r"n must be an integer from 1 to 128"),
    ({"best_of": 1000000}, "invalid_parameter", r"best_of must be an integer from 1 to 128, got 1000000"),
    ({"max_tokens": 0}, "invalid_parameter", r"max_tokens must be an integer >= 1, got 0"),
    # A value of the wrong type: the endpoint's 422, as the server answers the same body
    ({"n": 1.5}, "invalid_type", r"n: Input should be a valid integer, got 1.5"),
    ({"n": True}, "invalid_type", r"n: Input should be a valid integer, got true"),
    ({"max_completion_tokens": "5"}, "invalid_type",
     r'max_completion_tokens: Input should be a valid integer, got "5"'),
])
def test_bad_counts_are_row_errors_not_defaults(body, code, match):
    rows = read_jsonl(lines({"prompt": "fine"}, chat(body)))
    err = rows[1]
    # the server's code for the same body sent alone (it was invalid_request)
    assert isinstance(err, RowError) and err.code == code and err.line == 2, err
    assert re.search(match, err.message) and err.message.startswith("line 2:")


def test_an_infinite_or_nan_temperature_fails_the_row():
    opts = JobOptions("in", "out")
    for text in ('{"temperature": 1e400}', '{"temperature": NaN}', '{"top_p": Infinity}'):
        raw = json.dumps(chat()).replace('"body": {', '"body": ' + text[:-1] + ", ")
        row = read_jsonl(raw.encode())[0]
        if "1e400" not in text:  # not JSON at all: the line's error, as OpenAI refuses it
            assert isinstance(row, RowError) and row.code == "invalid_json", row
            continue
        assert isinstance(row, Row)  # JSON, read as infinity
        with pytest.raises(ValueError, match="must be a"):  # _prepare sends it to the errors file
            row_params(row, opts)


def test_messages_use_the_shared_checks():
    rows = read_jsonl(lines(
        chat(custom_id="parts", body_extra={"messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}),
        chat(custom_id="wizard", body_extra={"messages": [{"role": "wizard", "content": "x"}]}),
        chat(custom_id="image", body_extra={"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}),
        chat(custom_id="empty", body_extra={"messages": []}),
    ))
    assert rows[0].messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb"}]
    assert [r.code for r in rows[1:]] == ["invalid_messages"] * 3
    assert "unknown role 'wizard'" in rows[1].message
    assert "type 'image_url' is not supported" in rows[2].message
    assert "empty list of messages" in rows[3].message


def test_a_byte_order_mark_is_skipped(tmp_path):
    bom = b"\xef\xbb\xbf"
    rows = read_jsonl(bom + lines({"prompt": "first"}, {"prompt": "second"}))
    assert [type(r) for r in rows] == [Row, Row] and rows[0].messages[0]["content"] == "first"
    p = tmp_path / "t.csv"
    p.write_bytes(bom + b"text,label\nhello,1\n")
    assert read_input(str(p), "text").rows[0].messages[0]["content"] == "hello"


def test_every_csv_column_is_text_as_written(tmp_path):
    """--format table gives the other columns back: they were typed by pyarrow's guess (zip
    00501 came back 501, 1.50 as 1.5, FALSE as false, NA and NaN empty, a date with :00 added),
    and a column of numbers with a word after the first read block failed the whole file."""
    p = tmp_path / "t.csv"
    p.write_text("zip,price,flag,note,when,text\n00501,1.50,FALSE,NA,2024-01-05 10:00,hi\n"
                 "02134,2.0e3,true,NaN,,yo\n")
    table = read_input(str(p), "text").table
    assert table.to_pydict() == {"zip": ["00501", "02134"], "price": ["1.50", "2.0e3"], "flag": ["FALSE", "true"],
                                 "note": ["NA", "NaN"], "when": ["2024-01-05 10:00", ""], "text": ["hi", "yo"]}
    p.write_text("n,text\n" + "".join(f"{i},hello {i}\n" for i in range(200_000)) + "many,last\n")
    rows = read_input(str(p), "text")
    assert rows.table.column("n").to_pylist()[-1] == "many" and len(rows.rows) == 200_001


def test_an_empty_cells_error_body_is_worded_as_a_lines_without_its_place(tmp_path):
    """A table row's error body said "row 2: column 'text' is empty", where a JSONL line's body
    leaves its place to `error.line` (and `error.message`)."""
    p = tmp_path / "t.csv"
    p.write_text("id,text\n1,hi\n2,\n")
    err = read_input(str(p), "text").rows[1]
    written = openai_io.row_error_line(err)
    assert written["response"]["body"]["error"]["message"] == "column 'text' is empty"
    assert (written["error"]["line"], written["error"]["message"]) == (2, "row 2: column 'text' is empty")


@pytest.mark.parametrize("header, message", [
    ("text,,", "columns 2 and 3 of the header have no name"),
    ("a,a,text", "columns 1 and 2 of the header have the name 'a'"),
    ("text,text", "columns 1 and 2 of the header have the name 'text'"),
])
def test_a_header_that_names_a_column_twice_is_one_error(tmp_path, header, message):
    """It failed in pyarrow's words, with a traceback (KeyError: 'Field "" exists 2 times in schema')."""
    p = tmp_path / "t.csv"
    p.write_text(header + "\n" + ",".join(["hi"] * (header.count(",") + 1)) + "\n")
    with pytest.raises(InputError, match=message + ": give each column a name of its own"):
        read_input(str(p), "text")


def test_an_upper_case_tsv_is_read_with_tabs(tmp_path):
    p = tmp_path / "IN.TSV"
    p.write_text("text\tzip\nhi\t007\n")
    assert read_input(str(p), "text").table.to_pydict() == {"text": ["hi"], "zip": ["007"]}


def test_a_tsv_is_read_without_quoting(tmp_path):
    """A cell that starts with '"' was read as CSV quoting: it swallowed the lines after it into
    one prompt (the SMS set's 5,574 rows read as 5,572), and a cell's quotes were dropped."""
    p = tmp_path / "in.tsv"
    p.write_text('label\ttext\nham\t"Wen u miss someone..." gdeve..\nham\t"unclosed, it took the next line\n'
                 'spam\tWin a "prize"\n')
    rows = read_input(str(p), "text").rows
    assert [r.messages[0]["content"] for r in rows] == ['"Wen u miss someone..." gdeve..',
                                                       '"unclosed, it took the next line', 'Win a "prize"']


def test_a_csv_quote_that_never_closes_is_refused_naming_its_line(tmp_path):
    """A stray quote on line 3 made the rest of the file one cell: 5 rows read as 2, silently."""
    p = tmp_path / "in.csv"
    p.write_text('text\nfirst\n"oops a stray quote\nthird\nfourth\nfifth\n')
    with pytest.raises(InputError, match=r"in.csv: line 3 opens a quoted cell that is never closed"):
        read_input(str(p), "text")
    # Text after a closing quote earlier in the file ("a"b, which a strict CSV reader refuses)
    # turned the check off; a quote opening the header after a BOM was pyarrow's "Empty CSV file".
    for text, line in (('id,text\n1,"a"b\n2,hello\n3,"unclosed\n4,x\n', 4), ('\ufeff"id,text\n1,a\n', 1)):
        p.write_text(text)
        with pytest.raises(InputError, match=rf"in.csv: line {line} opens a quoted cell that is never closed"):
            read_input(str(p), "text")
    # Quotes that close, a quoted cell over lines, a doubled quote and a quote inside a cell are read.
    p.write_text('id,text\n1,"two\r\nlines"\n2,"say ""hi"""\n3,5" tall\n4,"a"b\n5,""\n6,"x,""y"""\n')
    rows = read_input(str(p), "text").rows
    assert [r.messages[0]["content"] if isinstance(r, Row) else r.code for r in rows] == [
        "two\r\nlines", 'say "hi"', '5" tall', "ab", "invalid_prompt", 'x,"y"']


@pytest.mark.parametrize("name, text, message", [
    ("q.csv", "id,text,x\n1,a,b\n3,short\n", "record 3 of the file (the header is record 1) has 2 cells where the "
     "header has 3: give every record the header's columns (an empty cell is nothing between two commas)"),
    ("w.csv", "id,text\n1,a,b\n", "record 2 of the file (the header is record 1) has 3 cells where the header has "
     "2: give every record the header's columns (a comma in a cell splits it in two: quote such a cell)"),
    ("q.tsv", "id\ttext\tx\n3\tshort\n", "record 2 of the file (the header is record 1) has 2 cells"),
])
def test_a_record_of_other_width_than_the_header_is_named_in_words(tmp_path, name, text, message):
    """It said "cannot read it as csv: CSV parse error: Row #4: Expected 3 columns, got 2" (of a
    .tsv too), its row counting the header."""
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(InputError) as e:
        read_input(str(p), "text")
    assert str(e.value).startswith(f"{p}: {message}"), str(e.value)
    assert "as csv" not in str(e.value)


def test_a_jsonl_of_which_no_line_is_json_is_refused_as_a_file(tmp_path):
    """Plain text in a .jsonl (or piped to -) failed every line as invalid_json, exit 1, with no
    word of what the input should be. One broken line among others still fails alone."""
    p = tmp_path / "in.jsonl"
    p.write_text("Say hi\nSay ho\n")
    with pytest.raises(InputError, match=r"in.jsonl: no line is JSON \(line 1: not valid JSON .*\): the input is "
                                         r"JSON lines, one request each"):
        read_input(str(p))
    p.write_text('Say hi\n{"prompt": "Say ho"}\n')
    rows = read_input(str(p)).rows
    assert isinstance(rows[0], RowError) and rows[0].code == "invalid_json" and isinstance(rows[1], Row)


def test_a_tsv_is_written_as_one_is_read(tmp_path):
    """Each row one line and each cell as it came; the tabs and line breaks TSV cannot hold
    (in an answer, or in a CSV cell) are written as \\t, \\n and \\r."""
    import pyarrow as pa

    from batchprompt.jobs.run import write_tsv

    table = pa.table({"text": ['say "hi"', "a\tb", None], "n": [1, 2, 3], "result": ["x\ny\r", "", "ok"]})
    out = tmp_path / "out.tsv"
    with open(out, "wb") as f:
        write_tsv(table, f)
    assert out.read_text() == 'text\tn\tresult\nsay "hi"\t1\tx\\ny\\r\na\\tb\t2\t\n\t3\tok\n'
    assert read_input(str(out), "text").table.num_rows == 3


def test_a_csv_cell_larger_than_a_read_block_is_read(tmp_path):
    # A 2 MB cell stopped the whole job: "straddling object straddles two block boundaries".
    big = "hello world " * 175_000
    p = tmp_path / "t.csv"
    p.write_text(f'id,text\n1,"{big}"\n2,hi\n')
    rows = read_input(str(p), "text").rows
    assert [r.messages[0]["content"] for r in rows] == [big, "hi"]


def test_invalid_utf8_is_replaced_and_counted(tmp_path):
    raw = lines({"prompt": "ok"}, {"prompt": "caf\udce9"}, {"prompt": "fine"}).replace(b"\\udce9", b"\xe9")
    rows = read_jsonl(raw)
    assert [type(r) for r in rows] == [Row] * 3
    assert rows[1].messages[0]["content"] == "caf\ufffd" and rows[1].warnings == (INVALID_UTF8,)
    assert rows[0].warnings == rows[2].warnings == ()
    assert Table(rows, "jsonl", raw).notes() == ["1 row had invalid UTF-8 (replaced with U+FFFD)"]
    # CSV: one bad byte must not turn the whole column into "empty" rows.
    p = tmp_path / "t.csv"
    p.write_bytes(b"text,label\nhello,1\ncaf\xe9,2\nbye,3\n")
    table = read_input(str(p), "text")
    assert [r.messages[0]["content"] for r in table.rows] == ["hello", "caf\ufffd", "bye"]
    assert table.invalid_utf8_rows == 1 and table.rows[1].warnings == (INVALID_UTF8,)
    assert table.table.column("text").to_pylist() == ["hello", "caf\ufffd", "bye"]  # --format table writes it


def test_an_id_with_bytes_that_are_not_utf8_fails_its_row_and_no_other():
    """It became U+FFFD: the id in the output no longer matched the input's, and two ids that
    differ only in their bad bytes refused the whole file as duplicates of "a\ufffd"."""
    from batchprompt.jobs.ids import check_ids

    def line(cid: bytes, content: str) -> bytes:
        return (b'{"custom_id": "' + cid + b'", "url": "/v1/chat/completions", "body": {"messages": '
                b'[{"role": "user", "content": "' + content.encode() + b'"}]}}')

    raw = b"\n".join([line(b"a\xff", "one"), line(b"a\xfe", "two"), line(b"ok", "three"), line(rb"a\ufffd", "four")])
    rows = check_ids(read_jsonl(raw), "in.jsonl")  # no duplicate
    assert [(type(r).__name__, getattr(r, "code", None)) for r in rows] == [
        ("RowError", "invalid_custom_id"), ("RowError", "invalid_custom_id"), ("Row", None), ("Row", None)]
    assert rows[3].custom_id == "a\ufffd"  # a U+FFFD the file holds as text is an id like any other
    written = openai_io.row_error_line(rows[0])
    assert json.loads(json.dumps(written))["custom_id"] == "a\udcff" and "not valid Unicode text" in rows[0].message


def test_unknown_body_fields_are_ignored_and_counted():
    rows = read_jsonl(lines(
        chat({"model": "gpt-4o", "foo": 1, "presence_penalty": 0.5}),
        chat({"foo": 2, "bar": None}),
        {"prompt": "plain", "id": 3, "foo": 3},
        chat({"foo": 4, "n": 0}),  # a failed row is not counted
    ))
    assert [type(r) for r in rows] == [Row, Row, Row, RowError]
    assert rows[0].unknown_fields == ("foo",) and rows[2].unknown_fields == ("foo",)
    table = Table(rows, "jsonl", b"")
    assert table.unknown_fields == {"foo": 3, "bar": 1}
    assert table.notes() == ["ignored unknown body fields: bar (1 row), foo (3 rows)"]


def test_a_chat_field_in_a_completions_body_is_named_as_ignored():
    # top_logprobs is chat's (completions say logprobs: k): it was ignored without a word.
    rows = read_jsonl(lines({"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "x", "top_logprobs": 2}},
                            chat({"logprobs": True, "top_logprobs": 2}, custom_id="d")))
    assert [r.unknown_fields for r in rows] == [("top_logprobs",), ()]


def test_a_plain_lines_null_id_is_no_id_and_prompt_beside_messages_is_refused():
    # "id": null became the id "None" (two of them: a duplicate, the whole file refused); a line
    # with both prompt and messages ran the messages and dropped the prompt without a word.
    rows = read_jsonl(lines({"id": None, "prompt": "a"}, {"id": None, "prompt": "b"}, {"id": 7, "prompt": "c"},
                            {"id": True, "prompt": "d"},
                            {"prompt": "e", "messages": [{"role": "user", "content": "f"}]},
                            {"prompt": "g", "messages": None}, {"prompt": None, "messages": [{"role": "user",
                                                                                             "content": "h"}]}))
    assert [r.custom_id for r in rows] == ["line-1", "line-2", "7", "true", "line-5", "line-6", "line-7"]
    assert [type(r).__name__ for r in rows[5:]] == ["Row", "Row"]  # a null is no prompt, no messages
    assert isinstance(rows[4], RowError) and rows[4].code == "invalid_request" and "both prompt and messages" in (
        rows[4].message)


def test_rows_that_ask_to_stream_run_whole_and_the_summary_says_so():
    # They ran unstreamed without a word.
    rows = read_jsonl(lines(chat({"stream": True}), chat({"stream": False}), chat({"stream": True, "n": 2})))
    assert [type(r) for r in rows] == [Row, Row, Row]
    assert Table(rows, "jsonl", b"").notes() == [
        "2 rows asked for stream: true; a job writes whole results, so they run unstreamed"]
    assert Table(rows[:1], "jsonl", b"").notes() == [
        "1 row asked for stream: true; a job writes whole results, so it runs unstreamed"]


@pytest.mark.parametrize("line, message", [
    ('{"custom_id": "a', "line 3: not valid JSON (Unterminated string starting at column 15)"),
    ("{not json", "line 3: not valid JSON (Expecting property name enclosed in double quotes at column 2)"),
])
def test_invalid_json_names_the_column_once(line, message):
    err = parse_line(3, line)
    assert err.message == message


@pytest.mark.parametrize("line, param", [
    ('{"custom_id": "a", "url": "/v1/chat/completions", "body": {"messages": [], "max_tokens": 2}}', "messages"),
    ('{"custom_id": "a", "url": "/v1/chat/completions", "body": {"max_tokens": 2}}', "messages"),
    ('{"messages": [{"role": "user", "content": "hi"}], "n": 0}', "n"),
    ('{"prompt": "hi", "max_tokens": 0}', "max_tokens"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": ["a", "b"]}}', "prompt"),
    ('{"custom_id": "a", "url": "/v1/embeddings", "body": {}}', "url"),
    ('{"custom_id": "a", "url": "/v1/completions"}', "body"),
    ('{"url": "/v1/completions", "body": {"prompt": "hi"}}', "custom_id"),
])
def test_a_rows_error_names_its_field(line, param):
    """As the endpoint fills `param` (errors found while reading a row had param null)."""
    err = parse_line(3, line)
    assert isinstance(err, RowError) and err.param == param, err
    assert openai_io.row_error_line(err)["response"]["body"]["error"]["param"] == param


def test_a_byte_order_mark_on_any_line_is_skipped_as_on_the_first():
    """Files saved with a BOM and joined with cat: the later BOMs failed their rows with
    Python's words ("Unexpected UTF-8 BOM (decode using utf-8-sig)"), in run and on the server."""
    from batchprompt.server.batch_input import check_input

    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": "hi"}]}})
    assert isinstance(parse_line(3, "\ufeff" + line), Row)
    raw = ("\ufeff" + line + "\n" + "\ufeff" + line.replace('"a"', '"b"') + "\n").encode()
    checked = check_input(raw, "/v1/chat/completions", "m", {"m"})
    assert checked.ok and len(checked.rows) == 2, checked.errors


def test_an_input_without_a_known_suffix_is_read_as_json_lines_when_it_is(tmp_path):
    """`batchprompt run <(zcat in.jsonl.gz)` (/dev/fd/63) and a file named `requests` were an
    "unknown input format ''"."""
    p = tmp_path / "requests"
    p.write_text('{"prompt": "hi"}\n{"prompt": "there"}\n')
    table = read_input(str(p))
    assert table.format == "jsonl" and [r.messages[0]["content"] for r in table.rows] == ["hi", "there"]


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le"])
def test_a_utf16_input_is_named_as_such(tmp_path, encoding):
    """What Windows PowerShell's > writes: it failed as "no line is JSON ... write a CSV"."""
    p = tmp_path / "in.jsonl"
    p.write_bytes('{"prompt": "hi"}\n'.encode(encoding))
    with pytest.raises(InputError, match="in.jsonl is UTF-16.*save it as UTF-8"):
        read_input(str(p))
    c = tmp_path / "in.csv"
    c.write_bytes("text\nhi\n".encode(encoding))
    with pytest.raises(InputError, match=" is UTF-16 .*not UTF-8"):
        read_input(str(c), "text")
    bare = tmp_path / "requests"  # no suffix: it was "unknown input format"
    bare.write_bytes('{"prompt": "hi"}\n'.encode(encoding))
    with pytest.raises(InputError, match=" is UTF-16 .*not UTF-8"):
        read_input(str(bare))
    wide = tmp_path / "in32.jsonl"  # UTF-32 was named UTF-16, with an iconv hint that garbled it
    wide.write_bytes('{"prompt": "hi"}\n'.encode("utf-32"))
    with pytest.raises(InputError, match=" is UTF-32, not UTF-8.*iconv -f UTF-32"):
        read_input(str(wide))


def test_json_lines_that_end_with_cr_alone_are_named_as_such(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_bytes(b'{"prompt": "hi"}\r{"prompt": "there"}\r')
    with pytest.raises(InputError, match="end with a carriage return alone"):
        read_input(str(p))
    crlf = tmp_path / "crlf.jsonl"
    crlf.write_bytes(b'{"prompt": "hi"}\r\n{"prompt": "there"}\r\n')
    assert len(read_input(str(crlf)).rows) == 2
