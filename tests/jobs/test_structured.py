"""Structured output in `batchprompt run`: response_format and vLLM's fields in request
bodies, the --choices/--json-schema defaults, and a rejected schema failing its row only."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from batchprompt.cli import main

from ..conftest import SPAM_SYSTEM, sms_rows
from .test_cli import chat_line, parse_outputs

SCHEMA = {"type": "object", "properties": {"spam": {"type": "boolean"}, "reason": {"type": "string", "maxLength": 30}},
          "required": ["spam", "reason"], "additionalProperties": False}


@pytest.mark.slow
def test_bodies_ask_for_structure_each_their_own_way(tmp_path):
    rows = [t for _, t in sms_rows(6)]
    lines = [
        chat_line(0, rows[0], max_tokens=60, response_format={
            "type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}}),
        chat_line(1, rows[1], guided_choice=["spam", "ham"]),
        chat_line(2, rows[2], structured_outputs={"regex": "[0-9]{3}"}),
        chat_line(3, rows[3], max_tokens=60, guided_json={"type": "object", "properties": {"a": {"type": "strin"}}}),
        chat_line(4, rows[4], max_tokens=60, response_format={"type": "json_object"}),
        chat_line(5, rows[5], response_format={"type": "json_schema"}),
        chat_line(6, rows[0], guided_regex=r"(spam|ham)[^\s\S]"),  # nothing matches: an error, not ""
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    assert main(["run", str(inp), "-o", str(out), "--no-progress"]) == 1
    outputs = parse_outputs(out)
    by_id = {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"] for o in outputs}
    finish = {o["custom_id"]: o["response"]["body"]["choices"][0]["finish_reason"] for o in outputs}
    jsonschema.validate(json.loads(by_id["sms-0"]), SCHEMA)
    assert by_id["sms-1"] in ("spam", "ham")
    assert len(by_id["sms-2"]) == 3 and by_id["sms-2"].isdigit()
    if finish["sms-4"] == "stop":  # any JSON object
        assert isinstance(json.loads(by_id["sms-4"]), dict)
    else:  # a small model may also ramble on until max_tokens: the cut text, as the endpoint gives it
        assert finish["sms-4"] == "length" and by_id["sms-4"].startswith("{")
    errors = {e["custom_id"]: e["error"]["message"] for e in map(json.loads, open(f"{out}.errors.jsonl"))}
    assert set(errors) == {"sms-3", "sms-5", "sms-6"}
    assert "strin" in errors["sms-3"] and "line 4" in errors["sms-3"]
    assert "json_schema" in errors["sms-5"] and "line 6" in errors["sms-5"]
    assert "no text can match" in errors["sms-6"] and "line 7" in errors["sms-6"]


@pytest.mark.slow
def test_choices_for_a_whole_table(tmp_path):
    csv_in, out = tmp_path / "in.csv", tmp_path / "out.csv"
    texts = [t.replace('"', "'") for _, t in sms_rows(8)]
    csv_in.write_text("text\n" + "".join(f'"{t}"\n' for t in texts))
    args = ["run", str(csv_in), "-o", str(out), "--column", "text", "--format", "table", "--system", SPAM_SYSTEM,
            "--no-progress"]
    assert main(args + ["--choices", "spam,ham", "--choice-mode", "score"]) == 0
    import pyarrow.csv
    table = pyarrow.csv.read_csv(out).to_pylist()
    assert len(table) == 8 and all(r["result"] in ("spam", "ham") for r in table)


def test_bad_structured_flags_stop_before_any_work(tmp_path, capsys, monkeypatch):
    import batchprompt.jobs

    def no_job(opts):
        raise AssertionError("the job started (and loaded the model) despite a bad flag")

    monkeypatch.setattr(batchprompt.jobs, "run_job", no_job)
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hi"}\n')
    out = tmp_path / "o.jsonl"
    for flags, message in ((["--regex", "(unclosed"], "unclosed group"), (["--regex", r"[^\s\S]"], "no text can match"),
                           (["--json-schema", '{"type": "frobnicate"}'], "frobnicate")):
        assert main(["run", str(inp), "-o", str(out)] + flags) == 2
        err = capsys.readouterr().err
        assert message in err and flags[0].lstrip("-").replace("-", "_") in err
        assert err.startswith(f"batchprompt: error: {flags[0]}: "), err  # named as the command line gave it
    assert main(["run", str(inp), "-o", str(out), "--choices", "[]"]) == 2
    assert "at least one label" in capsys.readouterr().err
    assert main(["run", str(inp), "-o", str(out), "--json-schema", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
    for inline in ("[]", "5"):  # JSON, not an object: it said "cannot read it (No such file or directory)"
        assert main(["run", str(inp), "-o", str(out), "--json-schema", inline]) == 2
        assert f"--json-schema {inline}: a JSON schema is a JSON object" in capsys.readouterr().err
    # JSON Schema's booleans, as the Python API and a row's body take them: false matches nothing.
    assert main(["run", str(inp), "-o", str(out), "--json-schema", "false"]) == 2
    assert "`false`, which no JSON value matches" in capsys.readouterr().err
    assert main(["run", str(inp), "-o", str(out), "--choices", "a,b", "--regex", "x"]) == 2
    assert "one structured-output option" in capsys.readouterr().err
    # Nested 900 and 100,000 levels: a RecursionError's traceback and exit 1 (from the schema's
    # checks, and from json.loads).
    for depth in (900, 100_000):
        deep = tmp_path / f"deep{depth}.json"
        deep.write_text('{"type": "object", "properties": {"a": ' * depth + '{"type": "integer"}' + "}}" * depth)
        assert main(["run", str(inp), "-o", str(out), "--json-schema", str(deep)]) == 2
        assert "nested too deeply" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.slow
def test_a_label_longer_than_max_tokens_is_a_bad_option_not_a_failed_row_each(tmp_path, capsys):
    """Every row failed alone with the same error (exit 1), and the journal it left refused the
    same command with --max-tokens raised (the options differed: --restart was needed). It is
    now one error before any row is journaled, and the fixed command runs."""
    long_label = "x" * 400
    inp, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    inp.write_text('{"prompt": "first"}\n{"prompt": "second", "max_tokens": 300}\n')
    args = ["run", str(inp), "-o", str(out), "--no-progress", "--choices", f"{long_label},b"]
    assert main(args + ["--max-tokens", "8"]) == 2
    err = capsys.readouterr().err
    assert "--choices: the label 'xxxx" in err and "more than --max-tokens (8): raise --max-tokens to at least" in err
    assert "(400 characters)" in err and long_label not in err  # quoted cut short
    assert not out.exists() and not (tmp_path / "o.jsonl.journal").exists()
    assert main(args + ["--max-tokens", "300"]) == 0
    assert len(parse_outputs(out)) == 2
    # Every row sets its own max_tokens: the flag's default is no one's, and the rows run.
    inp.write_text('{"prompt": "first", "max_tokens": 300}\n')
    assert main(["run", str(inp), "-o", str(tmp_path / "own.jsonl"), "--no-progress", "--choices",
                 f"{long_label},b", "--max-tokens", "8"]) == 0


def test_a_label_longer_than_the_context_is_told_to_be_shorter():
    """It was told to raise max_tokens to its length, which no max_tokens could hold."""
    from batchprompt.api.structured import OutputSpec
    from batchprompt.engine import SamplingParams

    class Tok:
        def encode(self, text, add_special_tokens=False):
            return list(range(len(text.split())))

    spec = OutputSpec.from_options(choices=["x " * 9000, "no"])
    with pytest.raises(ValueError, match=r"more than the model's context holds beside a prompt \(8192 tokens\): "
                                         r"shorten the label"):
        spec.sampling_params(SamplingParams(max_tokens=256), Tok(), 8192)
    with pytest.raises(ValueError, match=r"raise max_tokens to at least 9000"):
        spec.sampling_params(SamplingParams(max_tokens=256), Tok(), 10000)


@pytest.mark.slow
def test_rows_are_answered_as_the_endpoint_answers_them(tmp_path):
    """A JSON schema cut by max_tokens is the partial text with finish_reason "length" (it was
    the row's error), and token ids outside the vocabulary are an invalid_parameter (they were a
    request_failed, then an invalid_request): as the server's endpoint answers both, and as
    OpenAI and vLLM do."""
    rows = [t for _, t in sms_rows(2)]
    schema = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
    lines = [chat_line(0, rows[0], max_tokens=3, temperature=0, response_format=schema),
             chat_line(1, rows[1], logit_bias={"99999999": 5})]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    assert main(["run", str(inp), "-o", str(out), "--no-progress"]) == 1
    [o] = parse_outputs(out)
    choice = o["response"]["body"]["choices"][0]
    assert o["custom_id"] == "sms-0" and choice["finish_reason"] == "length"
    assert choice["message"]["content"].startswith("{") and o["response"]["body"]["usage"]["completion_tokens"] == 3
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice["message"]["content"])
    [e] = map(json.loads, open(f"{out}.errors.jsonl"))
    assert e["custom_id"] == "sms-1" and e["error"]["code"] == "invalid_parameter", e
    assert e["response"]["status_code"] == 400 and e["response"]["body"]["error"]["code"] == "invalid_parameter"
    assert "outside the vocabulary" in e["error"]["message"] and e["error"]["message"].startswith("line 2: ")


@pytest.mark.slow
def test_the_summary_does_not_count_a_cut_answer_that_is_a_whole_match(tmp_path, capsys):
    """"100" of an integer and "aaa" of a+, cut by max_tokens 3, are whole matches (kept, no
    error, as vLLM keeps them); the summary said they did not match their constraint."""
    lines = [chat_line(0, "Give a big number.", max_tokens=3, temperature=0, guided_json={"type": "integer"}),
             chat_line(1, "Say aaa.", max_tokens=3, temperature=0, guided_regex="a+"),
             chat_line(2, "Give JSON.", max_tokens=3, temperature=0, guided_json={
                 "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    assert main(["run", str(inp), "-o", str(out), "--no-progress"]) == 0
    err = capsys.readouterr().err
    texts = [o["response"]["body"]["choices"][0]["message"]["content"] for o in parse_outputs(out)]
    assert re.fullmatch(r"-?[0-9]+", texts[0]) and re.fullmatch("a+", texts[1]) and texts[2].startswith("{"), texts
    assert "1 of the ok rows were cut by max_tokens" in err, err


@pytest.mark.slow
def test_a_table_says_which_answers_max_tokens_cut(tmp_path, capsys):
    # A cut structured answer is the partial text (as the endpoint gives it): its finish_reason
    # column says so, where a whole one says "stop". The summary said "2 ok, 0 failed" alone.
    csv_in, out = tmp_path / "in.csv", tmp_path / "out.csv"
    csv_in.write_text("text\n" + "".join(f'"{t}"\n' for t in [t.replace('"', "'") for _, t in sms_rows(2)]))
    assert main(["run", str(csv_in), "-o", str(out), "--column", "text", "--format", "table", "--no-progress",
                 "--json-schema", json.dumps(SCHEMA), "--max-tokens", "3"]) == 0
    assert ("2 of the ok rows were cut by max_tokens before their structured output was complete"
            in capsys.readouterr().err)
    import pyarrow.csv
    rows = pyarrow.csv.read_csv(out).to_pylist()
    assert [(r["finish_reason"], r["error"]) for r in rows] == [("length", None)] * 2
    assert all(r["result"].startswith("{") for r in rows)


def test_a_text_response_format_beside_guided_json_asks_for_nothing_more():
    """response_format {"type": "text"} asks for no constraint (OpenAI's default): beside
    guided_json the row failed ("response_format and guided_json both ask for a constraint"),
    where beside guided_regex it ran."""
    from batchprompt.jobs.rows import CHAT, Row
    from batchprompt.jobs.run import JobOptions, row_spec

    opts = JobOptions(input="in.jsonl", output="out.jsonl")
    schema = {"type": "integer"}
    for field in ("guided_json", "structured_outputs"):
        value = schema if field == "guided_json" else {"json": schema}
        body = {"response_format": {"type": "text"}, field: value}
        spec = row_spec(Row(1, "a", CHAT, messages=[{"role": "user", "content": "hi"}], body=body), opts)
        assert spec is not None and spec.grammar.is_json, field
    both = {"response_format": {"type": "json_object"}, "guided_json": schema}
    with pytest.raises(ValueError, match="both ask for a constraint"):
        row_spec(Row(1, "a", CHAT, messages=[{"role": "user", "content": "hi"}], body=both), opts)
