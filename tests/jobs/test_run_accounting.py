"""What `batchprompt run` counts and writes: the progress bar and the dry run count every row as
the run answers it, and scored labels come with their probabilities."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from batchprompt.cli import main
from batchprompt.jobs import JobOptions
from batchprompt.jobs.run import JobRun

from .test_cli import chat_line, parse_outputs


def _refused_rows(path: Path) -> None:
    """One row that runs; four the run refuses as it prepares them (echo, tools, a prompt longer
    than the context, a max_tokens that does not fit beside its prompt); one unreadable line."""
    path.write_text("\n".join([
        chat_line(0, "Hello", max_tokens=1), chat_line(1, "Hello", echo=True),
        chat_line(2, "Hello", tools=[{"type": "function", "function": {"name": "f"}}]),
        chat_line(3, "word " * 10_000), chat_line(4, "Hello", max_tokens=10**6), "{broken"]) + "\n")


@pytest.mark.slow
def test_the_bar_and_the_dry_run_count_the_rows_refused_as_they_are_prepared(tmp_path):
    """The bar ended at 2/6 with "1 errors" while the summary said 5 failed; the dry run said
    "2 that cannot run", counted the refused rows' tokens and timed them in its calibration."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    _refused_rows(inp)
    dry_out = io.StringIO()
    dry = JobRun(JobOptions(str(inp), str(out), dry_run=True, progress=False), dry_out).run()
    shown = io.StringIO()
    real = JobRun(JobOptions(str(inp), str(out)), shown).run()
    assert (real.ok, real.failed) == (1, 5)
    bar = shown.getvalue().replace("\r", "\n").splitlines()
    last = [line for line in bar if "row" in line and "/" in line][-1]
    assert "6/6" in last and "5 errors" in last, last
    assert (dry.rows, dry.failed, dry.prompt_tokens) == (6, 5, real.prompt_tokens)
    assert "calibration: 1 row in" in dry_out.getvalue()


@pytest.mark.slow
def test_scored_labels_come_with_their_probabilities(tmp_path, capsys):
    """--choice-mode score wrote the labels' probabilities nowhere: they are a choice_probs field
    of the choice (an extra field, as vLLM adds its own; the line still parses as OpenAI's) and
    a column of a table."""
    csv_in = tmp_path / "in.csv"
    csv_in.write_text("text\nWIN a FREE prize now\nSee you at lunch\n")
    flags = ["--column", "text", "--choices", "spam,ham", "--choice-mode", "score", "--no-progress"]
    assert main(["run", str(csv_in), "-o", str(tmp_path / "o.jsonl"), *flags]) == 0
    for line in parse_outputs(tmp_path / "o.jsonl"):
        choice = line["response"]["body"]["choices"][0]
        assert set(choice["choice_probs"]) == {"spam", "ham"}
        assert abs(sum(choice["choice_probs"].values()) - 1) < 1e-6
        assert choice["message"]["content"] == max(choice["choice_probs"], key=choice["choice_probs"].get)
    assert main(["run", str(csv_in), "-o", str(tmp_path / "o.csv"), "--format", "table", *flags]) == 0
    import pyarrow.csv

    table = pyarrow.csv.read_csv(tmp_path / "o.csv").to_pylist()
    assert [set(json.loads(r["choice_probs"])) for r in table] == [{"spam", "ham"}] * 2
    assert main(["run", str(csv_in), "-o", str(tmp_path / "d.csv"), "--format", "table", "--column", "text",
                 "--max-tokens", "1", "--no-progress"]) == 0
    assert "choice_probs" not in pyarrow.csv.read_csv(tmp_path / "d.csv").column_names  # no labels scored


@pytest.mark.slow
def test_a_warning_while_the_bar_shows_gets_a_line_of_its_own(tmp_path, monkeypatch):
    """A warning (an endpoint down, a replica lost) was written onto the end of the bar's line."""
    import logging
    import re
    import sys

    from batchprompt.jobs import openai_io

    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(chat_line(i, "Hello", max_tokens=1) + "\n" for i in range(3)))
    shown = io.StringIO()
    monkeypatch.setattr(sys, "stderr", shown)
    handler = logging.StreamHandler(sys.stderr)  # as logging.basicConfig makes it for the command
    handler.setFormatter(logging.Formatter("batchprompt: %(levelname)s: %(message)s"))
    real_answer = openai_io.answer

    def answer(*args, **kwargs):  # a warning as each row finishes, while the bar is shown
        logging.getLogger("batchprompt.remote").warning("endpoint http://127.0.0.1:9 is down")
        return real_answer(*args, **kwargs)

    monkeypatch.setattr(openai_io, "answer", answer)
    logging.root.addHandler(handler)
    try:
        assert JobRun(JobOptions(str(inp), str(tmp_path / "o.jsonl")), shown).run().ok == 3
    finally:
        logging.root.removeHandler(handler)
    text = shown.getvalue()
    starts = [m.start() for m in re.finditer("batchprompt: WARNING: endpoint", text)]
    assert len(starts) == 3, text
    assert all(text[i - 1] in "\r\n" for i in starts), text  # the bar's line was cleared first
    assert "3/3" in text[starts[-1]:], text  # then the bar again, to its end


@pytest.mark.slow
def test_the_bar_ends_on_the_runs_own_rate_not_a_stale_live_one(tmp_path, monkeypatch):
    """Rows that all end together left the bar on the live rate of a snapshot taken early (40 tok/s
    on the bar, 204 in the summary). Here the live rate is stuck at 1 tok/s: the bar's last line
    gives the run's rate instead, the very figure of the summary (they timed from different
    starts: 71 against 48 tok/s for one row)."""
    import re

    import batchprompt.jobs.run as run_module

    class Stuck:
        def __init__(self, backend):
            pass

        def rate(self):
            return 1.0

        def close(self):
            pass

    monkeypatch.setattr(run_module, "LiveRate", Stuck)
    inp, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    inp.write_text("".join(chat_line(i, f"Count to {i + 3}.", max_tokens=8) + "\n" for i in range(3)))
    shown = io.StringIO()
    real = JobRun(JobOptions(str(inp), str(out)), shown).run()
    assert real.ok == 3 and real.run_completion_tokens > 3
    last = [line for line in shown.getvalue().replace("\r", "\n").splitlines() if "3/3" in line][-1]
    shown_rate = re.search(r"([\d,.]+) tok/s", last).group(1)
    assert shown_rate != "1", last
    assert f"({shown_rate} tok/s)" in str(real), (last, str(real))  # the summary's own figure


def test_an_answer_that_breaks_its_schema_is_the_server_s_fault_with_its_text():
    """It was a 400 invalid_request ("your request is wrong") with its text dropped: the request
    was fine, the grammar engine let the answer through. Still a 400 (a 500 is retried to the
    same answer, and a pool never finished such a row), with its own code and the text."""
    from batchprompt import Result
    from batchprompt.jobs import openai_io
    from batchprompt.jobs.rows import CHAT, Row

    row = Row(3, "r3", CHAT, messages=[{"role": "user", "content": "p?"}], body={})
    failed = Result(0, '{"p": 0}', "stop",
                    error="the output breaks its schema at p: 0 is less than or equal to the minimum of 0 (the "
                          "grammar engine let it through)")
    line = openai_io.answer(row, [failed], "m", 0, None).record
    assert line["error"]["code"] == "invalid_output" and line["response"]["status_code"] == 400
    assert line["error"]["message"].endswith('(the grammar engine let it through); the output: {"p": 0}')


def test_of_a_rows_n_choices_one_that_breaks_its_schema_carries_its_error_and_the_row_is_answered():
    """n = 2, one answer good and one that broke its schema: the whole row went to the errors
    file, the good answer with it. Now the row is answered, the bad choice with its `error`; a
    choice that failed otherwise (the engine's fault) still fails the row."""
    from batchprompt import Result
    from batchprompt.jobs import openai_io
    from batchprompt.jobs.rows import CHAT, Row

    row = Row(3, "r3", CHAT, messages=[{"role": "user", "content": "p?"}], body={"n": 2})
    good = Result(0, '{"p": 0.3}', "stop")
    bad = Result(1, '{"p": 0}', "stop", error="the output breaks its schema at p: 0 is less than or equal to the "
                                               "minimum of 0 (the grammar engine let it through)")
    line = openai_io.answer(row, [good, bad], "m", 0, None).record
    choices = line["response"]["body"]["choices"]
    assert line["error"] is None and [c["message"]["content"] for c in choices] == ['{"p": 0.3}', '{"p": 0}']
    assert "error" not in choices[0] and choices[1]["error"]["code"] == "invalid_output", choices
    broken = Result(1, "", "error", error="the model failed on this step: RuntimeError: boom")
    line = openai_io.answer(row, [good, broken], "m", 0, None).record
    assert line["error"]["code"] == "engine_error", line


def test_rows_asking_for_n_choices_with_the_greedy_default_are_told_why_they_repeat():
    """A file written for OpenAI (which samples at 1.0 by default) with n = 2 got two copies of
    one text from `run`'s greedy default, and nothing said why."""
    from batchprompt.jobs.rows import CHAT, Row

    def rows(**body):
        return [Row(i + 1, f"r{i}", CHAT, messages=[{"role": "user", "content": "p?"}], body=dict(body))
                for i in range(2)]

    said = io.StringIO()
    JobRun(JobOptions("in", "out"), said)._note_greedy_samples(rows(n=1) + rows(n=3)[1:] + rows(n=2))
    assert "note: 3 rows (the first on line 2) ask for n > 1 choices with no temperature" in said.getvalue(), said
    assert "--temperature 1" in said.getvalue()
    for opts, todo in ((JobOptions("in", "out", temperature=1.0), rows(n=2)),
                       (JobOptions("in", "out"), rows(n=2, temperature=0.0) + rows(n=1))):
        quiet = io.StringIO()
        JobRun(opts, quiet)._note_greedy_samples(todo)
        assert quiet.getvalue() == "", quiet.getvalue()
