"""One bad row never stops a job, and bad ids or options are refused with one message.

A row whose chat template raises, or whose id is not valid text, is that row's error; a file
with a duplicated custom_id, or an option that cannot be used, fails before any work.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchprompt.cli import main

from ..conftest import sms_rows
from .test_cli import CHAT, chat_line, parse_outputs

# Llama-2 / Mistral templates refuse a conversation whose roles do not alternate.
ALTERNATING_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}"
    "{%- endif -%}"
    "{{- message['role'] + ': ' + message['content'] + '\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}assistant: {% endif -%}")


@pytest.fixture
def no_model(monkeypatch):
    """A run that gets as far as loading the model fails the test."""
    def refuse(*a, **k):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr("batchprompt.jobs.run.get_backend", refuse)


def _errors(out: Path) -> list[dict]:
    return [json.loads(x) for x in Path(str(out) + ".errors.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_row_whose_chat_template_raises_is_that_rows_error(tmp_path, monkeypatch):
    from batchprompt.api.service import get_service

    hf = get_service(None).engine.tokenizer.hf  # the engine `batchprompt run` uses in this process
    monkeypatch.setattr(hf, "chat_template", ALTERNATING_TEMPLATE)
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    lines = [json.dumps({"custom_id": cid, "method": "POST", "url": CHAT, "body": {"messages": msgs}})
             for cid, msgs in (("good-1", [user("Hello")]), ("two-users", [user("Hello"), user("again")]),
                               ("good-2", [user("Bye")]))]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    args = ["run", str(inp), "-o", str(out), "--max-tokens", "2", "--no-progress"]
    assert main(args) == 1
    assert [o["custom_id"] for o in parse_outputs(out)] == ["good-1", "good-2"]
    [err] = _errors(out)
    assert (err["custom_id"], err["error"]["line"], err["error"]["code"]) == ("two-users", 2, "invalid_prompt")  # as the server answers it
    assert "roles must alternate" in err["error"]["message"]
    assert main(args) == 1  # the rerun finds the job complete, rather than dying on that row


@pytest.mark.slow
def test_a_defect_in_preparing_a_row_is_not_journaled_so_a_rerun_runs_it(tmp_path, monkeypatch):
    """A bug of batchprompt's while rows were prepared (for a while a function called itself:
    a TypeError on every chat row) was journaled as each row's own failure, for good: the fixed
    build, run again, said "already complete ... 60 failed". Such a row's error line is written
    but not journaled, and the same command run again runs it."""
    from batchprompt.jobs import refusals

    real = refusals.check_context

    def broken(*args, **kwargs):
        raise TypeError("check_context() missing 1 required positional argument: 'params'")

    monkeypatch.setattr(refusals, "check_context", broken)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(chat_line(i, t) + "\n" for i, (_, t) in enumerate(sms_rows(2))))
    args = ["run", str(inp), "-o", str(out), "--max-tokens", "2", "--no-progress"]
    assert main(args) == 1
    errors = _errors(out)
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("sms-0", "internal_error"), ("sms-1", "internal_error")]
    assert all("TypeError" in e["error"]["message"] and "run the same command again" in e["error"]["message"]
               for e in errors)
    monkeypatch.setattr(refusals, "check_context", real)  # the fixed build
    assert main(args) == 0
    assert [o["custom_id"] for o in parse_outputs(out)] == ["sms-0", "sms-1"]


@pytest.mark.slow
def test_an_id_with_a_lone_surrogate_is_that_rows_error_written_escaped(tmp_path):
    text = sms_rows(1)[0][1]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    # JSON escapes: the file is valid UTF-8; the ids it decodes to are not valid text
    inp.write_text(chat_line(0, text) + "\n"
                   + chat_line(1, text).replace('"sms-1"', '"b\\ud800"') + "\n"
                   + json.dumps({"prompt": text, "id": "PLACEHOLDER"}).replace("PLACEHOLDER", "p\\udc00") + "\n")
    assert main(["run", str(inp), "-o", str(out), "--max-tokens", "2", "--no-progress"]) == 1
    assert [o["custom_id"] for o in parse_outputs(out)] == ["sms-0"]
    raw = Path(str(out) + ".errors.jsonl").read_bytes()
    raw.decode("utf-8")  # valid UTF-8, with the ids as JSON escapes
    assert b'"b\\ud800"' in raw and b'"p\\udc00"' in raw
    errs = _errors(out)
    assert [(e["custom_id"], e["error"]["line"], e["error"]["code"]) for e in errs] == [
        ("b\ud800", 2, "invalid_custom_id"), ("p\udc00", 3, "invalid_custom_id")]
    assert "not valid Unicode text" in errs[0]["error"]["message"]


def test_duplicate_custom_ids_are_refused_before_any_work(tmp_path, capsys, no_model):
    text = sms_rows(1)[0][1]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(chat_line(i, text) + "\n" for i in (0, 1, 0, 2, 0)))
    assert main(["run", str(inp), "-o", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f'{inp}: duplicate custom_id: "sms-0" on lines 1, 3 and 5' in err and "must be unique" in err
    assert list(tmp_path.iterdir()) == [inp]  # no output, no journal


def test_choices_that_are_not_json_name_the_option(tmp_path, capsys, no_model):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hi"}\n')
    assert main(["run", str(inp), "-o", str(tmp_path / "o.jsonl"), "--choices", "[bad"]) == 2
    err = capsys.readouterr().err
    assert "--choices [bad: not a valid JSON list" in err and "spam,ham" in err


@pytest.mark.parametrize("option", [["--regex", "(unclosed"], ["--json-schema", '{"type": "frobnicate"}']])
def test_a_bad_regex_or_schema_fails_before_the_model_loads(tmp_path, capsys, no_model, option):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hi"}\n')
    assert main(["run", str(inp), "-o", str(tmp_path / "o.jsonl"), *option]) == 2
    err = capsys.readouterr().err
    assert f"batchprompt: error: {option[0]}: " in err  # named by its flag (it said "structured output:")
    assert list(tmp_path.iterdir()) == [inp]


def test_a_duplicate_of_an_automatic_id_says_where_it_came_from(tmp_path, capsys, no_model):
    # The message named "line-2" on lines 2 and 3, while line 2 has no id at all.
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "a", "id": "x"}\n{"prompt": "b"}\n{"prompt": "c", "id": "line-2"}\n')
    assert main(["run", str(inp), "-o", str(tmp_path / "o.jsonl"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert '"line-2" on lines 2 and 3 (line 2 has no id, so it is named line-2: give it an id of its own)' in err


def test_an_option_the_engine_refuses_leaves_no_journal_to_block_the_corrected_command(tmp_path, capsys,
                                                                                     monkeypatch):
    """--max-model-len 100000 (or a --kv-cache-memory too small) is refused as the model loads,
    after the journal was made: that journal then refused the corrected command as "a different
    input or different options". A run that failed before any row leaves none (an unreadable
    line, answered without the model, is not journaled before the model loads), and an empty
    one left by an older version is taken over."""
    from batchprompt.engine.config import EngineConfigError
    from batchprompt.jobs import Journal

    def refuse(*a, **k):
        raise EngineConfigError("max_model_len 100000 is longer than the model's context of 8192 tokens")
    monkeypatch.setattr("batchprompt.jobs.run.get_backend", refuse)
    inp, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    inp.write_text('{"prompt": "hi"}\n{broken\n')
    assert main(["run", str(inp), "-o", str(out), "--system", "Be brief", "--no-progress"]) == 2
    assert "longer than the model's context" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [inp]  # no journal, no -wal, no lock
    Journal(f"{out}.journal", "an older run's options").close()  # empty: nothing to lose
    assert main(["run", str(inp), "-o", str(out), "--system", "Be very brief", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "longer than the model's context" in err and "different options" not in err


@pytest.mark.parametrize("fault", ["EngineConfigError", "KeyboardInterrupt"])
def test_a_restart_whose_model_cannot_load_keeps_the_finished_jobs_journal(tmp_path, capsys, monkeypatch, fault):
    """--restart emptied the journal before the model loaded: a bad option (--max-model-len 9000)
    or a Ctrl-C while loading then cost every finished row, and the next run computed them all
    again. The model now loads first."""
    from batchprompt.engine.config import EngineConfigError
    from batchprompt.jobs import Journal

    def refuse(*a, **k):
        if fault == "KeyboardInterrupt":
            raise KeyboardInterrupt
        raise EngineConfigError("max_model_len 9000 is longer than the model's context of 8192 tokens")
    monkeypatch.setattr("batchprompt.jobs.run.get_backend", refuse)
    inp, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    inp.write_text('{"prompt": "hi"}\n{"prompt": "ho"}\n')
    journal = Journal(f"{out}.journal", "the finished job's")
    journal.record(1, "line-1", True, {"custom_id": "line-1"})
    journal.record(2, "line-2", True, {"custom_id": "line-2"})
    journal.close()
    try:
        code = main(["run", str(inp), "-o", str(out), "--restart", "--max-model-len", "9000", "--no-progress"])
    except KeyboardInterrupt:
        code = 130
    assert code in (2, 130)
    kept = Journal(f"{out}.journal", "the finished job's")
    assert kept.done_lines() == {1, 2}
    kept.close()


def test_a_journal_in_a_missing_folder_is_refused_as_an_output_there_is(tmp_path, capsys, no_model):
    # The folders were made (even at /), while -o into a missing folder is an error.
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hi"}\n')
    journal = tmp_path / "no" / "such" / "j.db"
    assert main(["run", str(inp), "-o", str(tmp_path / "o.jsonl"), "--journal", str(journal)]) == 2
    err = capsys.readouterr().err
    assert f"{journal}: cannot write the journal (--journal) there: the folder {journal.parent} does not exist" in err
    assert list(tmp_path.iterdir()) == [inp]


def test_choice_mode_without_choices_names_both_options(tmp_path, capsys, no_model):
    # It was accepted and did nothing.
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hi"}\n')
    assert main(["run", str(inp), "-o", str(tmp_path / "o.jsonl"), "--choice-mode", "score"]) == 2
    err = capsys.readouterr().err
    assert "--choice-mode score needs --choices" in err
    assert list(tmp_path.iterdir()) == [inp]


def test_a_prompt_column_of_numbers_is_named_so(tmp_path, capsys, no_model):
    """A Parquet column of integers read as "row 1: column 'text' is empty", row after row; a CSV
    column of numbers is text as written (its cells are prompts)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchprompt.jobs.rows import read_input

    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "in.parquet")
    assert main(["run", str(tmp_path / "in.parquet"), "--column", "text", "-o", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "column 'text' holds numbers (int64), not text" in err and "is empty" not in err
    (tmp_path / "in.csv").write_text("id,text\n1,42\n2,007\n")
    rows = read_input(str(tmp_path / "in.csv"), "text").rows
    assert [r.messages[0]["content"] for r in rows] == ["42", "007"]


@pytest.mark.slow
def test_a_job_resumes_under_any_name_of_its_model_and_a_mismatch_names_what_changed(tmp_path, capsys):
    """A job begun without --model was refused with --model smollm2-135m (the same model), and
    on servers that serve it by that name (--endpoints); the message did not say what changed."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(chat_line(i, t) + "\n" for i, (_, t) in enumerate(sms_rows(2))))
    args = ["run", str(inp), "-o", str(out), "--max-tokens", "2", "--no-progress"]
    assert main(args) == 0
    capsys.readouterr()
    assert main(args + ["--model", "smollm2-135m"]) == 0, capsys.readouterr().err  # already complete
    # Every row sets its own max_tokens (6), so --max-tokens changes no answer: it does not block a resume.
    assert main([a if a != "2" else "5" for a in args]) == 0, capsys.readouterr().err
    assert main(args + ["--temperature", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "changed since the job began: --temperature (0.0 → 0.5)" in err, err
    # Another dtype is another job: a resume mixed float32 and bfloat16 rows, and a finished job
    # said "already complete" to a rerun in another dtype.
    assert main(args + ["--dtype", "float32"]) == 2
    err = capsys.readouterr().err
    assert "changed since the job began: --dtype (not given → \"float32\")" in err, err  # not "null"
    # A shorter context is another job: a resume with --max-model-len 100 failed the rows that
    # the first run answered with the model's whole context, and counted both in one output.
    assert main(args + ["--max-model-len", "100"]) == 2
    err = capsys.readouterr().err
    assert "changed since the job began: --max-model-len (not given → 100)" in err, err
