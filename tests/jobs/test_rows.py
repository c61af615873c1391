"""Reading job inputs: OpenAI batch lines, plain lines, CSV and Parquet; bad rows become errors."""
from __future__ import annotations

import json

import pytest

from batchprompt.jobs.rows import CHAT, COMPLETION, InputError, Row, RowError, read_input, read_jsonl
from batchprompt.jobs.run import JobOptions, row_params


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
    ("[1, 2]", "invalid_request"),
    ({"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "body": {}}, "invalid_url"),
    ({"custom_id": "x", "method": "GET", "url": CHAT, "body": {}}, "invalid_method"),
    ({"custom_id": "x", "method": "POST", "url": CHAT}, "missing_body"),
    ({"method": "POST", "url": CHAT, "body": {}}, "missing_custom_id"),
    ({"custom_id": "x", "url": CHAT, "body": {"prompt": "p"}}, "missing_messages"),
    ({"custom_id": "x", "url": CHAT, "body": {"messages": [{"role": "user"}]}}, "invalid_messages"),
    ({"custom_id": "x", "url": COMPLETION, "body": {"prompt": ""}}, "missing_prompt"),
])
def test_a_bad_line_is_an_error_with_its_line_number(line, code):
    rows = read_jsonl(lines({"prompt": "fine"}, line, {"prompt": "fine too"}))
    assert isinstance(rows[0], Row) and isinstance(rows[2], Row)
    err = rows[1]
    assert isinstance(err, RowError) and err.code == code and err.line == 2
    assert err.message.startswith("line 2:")


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
    with pytest.raises(InputError, match="unknown input format '.txt'"):
        read_input(str(tmp_path / "x.txt"))
