"""`batchprompt run` end to end: OpenAI shapes, bad rows, resume after SIGKILL, Ctrl-C and SIGTERM."""
from __future__ import annotations

import io
import json
import re
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from batchprompt.cli import main
from batchprompt.jobs import JobOptions, run_job

from ..conftest import SPAM_SYSTEM, sigint_default, sms_rows

CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"


def chat_line(i: int, text: str, **body) -> str:
    return json.dumps({"custom_id": f"sms-{i}", "method": "POST", "url": CHAT, "body": {
        "model": "any", "messages": [{"role": "system", "content": SPAM_SYSTEM}, {"role": "user", "content": text}],
        "max_tokens": 6, **body}})


def write_sms_batch(path: Path, n: int) -> list[str]:
    rows = sms_rows(n)
    path.write_text("".join(chat_line(i, t) + "\n" for i, (_, t) in enumerate(rows)))
    return [f"sms-{i}" for i in range(n)]


def refused_before_any_work(capsys, inp: Path, out: Path, *options: str, message: str) -> None:
    """`run inp -o out options` exits 2 with `message`, writing neither the output nor a journal."""
    assert main(["run", str(inp), "-o", str(out), *options]) == 2, inp
    assert message in capsys.readouterr().err
    assert not out.exists() and not Path(f"{out}.journal").exists()


def test_an_empty_input_is_refused_as_the_server_refuses_it(tmp_path, capsys):
    """It exited 0 with an empty output and a journal, 'outputs written from the journal'."""
    for name, text in (("empty.jsonl", ""), ("blank.jsonl", "\n  \n"), ("header.csv", "text\n")):
        inp = tmp_path / name
        inp.write_text(text)
        column = ["--column", "text"] if name.endswith(".csv") else []
        refused_before_any_work(capsys, inp, tmp_path / f"{name}.out.jsonl", *column,
                                message=f"{inp} holds no requests")


def test_a_table_with_a_column_the_output_adds_is_refused_before_any_work(tmp_path, capsys):
    """--format table wrote two columns named result (the input's and the answers')."""
    inp = tmp_path / "in.csv"
    inp.write_text("id,text,result\n1,hi,spam\n")
    refused_before_any_work(capsys, inp, tmp_path / "out.csv", "--column", "text", "--format", "table",
                            message=f"{inp} has a column named 'result', which --format table adds to the output: "
                                    f"rename that column, or write OpenAI lines (--format openai)")


def test_a_parquet_column_a_csv_cannot_hold_is_refused_before_any_work(tmp_path, capsys):
    """A list column ran every row, then failed the CSV write with pyarrow's traceback, exit 1,
    and the same again on every run: the output could never be written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": ["hi", "yo"], "tags": [[1, 2], []]}), inp)
    refused_before_any_work(capsys, inp, tmp_path / "out.csv", "--column", "text", "--format", "table",
                            message=f"{inp}: column 'tags' (list<element: int64>) cannot be written to a CSV "
                                    f"table: name the output .parquet")


def test_jsonl_output_named_as_a_table_is_refused_before_any_work(tmp_path, capsys):
    """-o out.csv without --format table wrote OpenAI's JSONL into out.csv."""
    inp = tmp_path / "in.csv"
    inp.write_text("text\nhi\n")
    out = tmp_path / "out.csv"
    refused_before_any_work(capsys, inp, out, "--column", "text",
                            message=f"{out}: the output is OpenAI's JSONL (--format openai): name it .jsonl, or add "
                                    f"--format table for a table")


def test_table_output_delimiters():
    """A TSV input's table went to stdout or out.txt with commas; IN.TSV was read with commas."""
    from batchprompt.jobs.run import _table_delimiter

    assert _table_delimiter("-", "in.tsv") == _table_delimiter("out.txt", "IN.TSV") == "\t"
    assert _table_delimiter("out.TSV", "in.csv") == "\t"
    assert _table_delimiter("out.csv", "in.tsv") == _table_delimiter("-", "in.csv") == ","


def parse_outputs(path: Path) -> list[dict]:
    out = [json.loads(line) for line in path.read_text().splitlines()]
    for o in out:
        assert o["error"] is None and o["response"]["status_code"] == 200
        body = o["response"]["body"]
        (ChatCompletion if body["object"] == "chat.completion" else Completion).model_validate(body)
    return out


# ---- bad input: one clear error before any work --------------------------------------------------
def test_missing_input_unwritable_output_unknown_model(tmp_path, capsys):
    assert main(["run", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "o.jsonl")]) == 2
    assert "nope.jsonl: no such input file" in capsys.readouterr().err
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hi"}\n')
    assert main(["run", str(inp), "-o", str(tmp_path / "no" / "dir" / "o.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "folder").mkdir()  # a folder as the output: refused before the model loads, no journal left
    assert main(["run", str(inp), "-o", str(tmp_path / "folder")]) == 2
    assert "it is a folder; give a file name" in capsys.readouterr().err
    # Under a file: it said "the folder .../in.jsonl does not exist", which exists
    assert main(["run", str(inp), "-o", str(inp / "o.jsonl")]) == 2
    assert f"{inp} is a file, not a folder" in capsys.readouterr().err
    assert not (tmp_path / "folder.journal").exists()
    assert main(["run", str(inp), "-o", str(tmp_path / "o.jsonl"), "--model", "no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
    assert main(["run", str(inp), "-o", str(tmp_path / "o.jsonl"), "--max-tokens", "0"]) == 2
    assert not (tmp_path / "o.jsonl").exists()


def test_a_job_whose_files_are_one_file_is_refused_before_any_work(tmp_path, capsys):
    """Output over the input, errors over the output (both written at the end: the output's rows
    were lost), or the journal over the output: exit 2, naming both, every file untouched."""
    inp = tmp_path / "in.jsonl"
    write_sms_batch(inp, 3)
    before = inp.read_bytes()
    out = tmp_path / "o.jsonl"
    (tmp_path / "link.jsonl").hardlink_to(inp)
    cases = [
        (["-o", str(inp)], "the output (-o) and the input"),
        (["-o", str(out), "--errors", str(out)], "the errors file (--errors) and the output (-o)"),
        (["-o", str(out), "--errors", str(inp)], "the errors file (--errors) and the input"),
        (["-o", str(out), "--journal", str(out)], "the journal (--journal) and the output (-o)"),
        (["-o", str(tmp_path / "sub" / ".." / "o.jsonl"), "--journal", str(out)], "are the same file"),
        (["-o", str(tmp_path / "link.jsonl")], "the output (-o) and the input"),
    ]
    (tmp_path / "sub").mkdir()
    for flags, message in cases:
        assert main(["run", str(inp), *flags, "--no-progress"]) == 2, flags
        err = capsys.readouterr().err
        assert message in err and "give each a path of its own" in err, (flags, err)
        assert inp.read_bytes() == before and not out.exists(), flags


def test_rows_the_server_refuses_fail_alone_with_its_codes(tmp_path, capsys):
    """A row with tools, or an explicit max_tokens that does not fit beside its prompt, fails
    with the code the server answers the same body with (it ran as plain text, and cut short,
    before); best_of = n is a no-op, as there. The other rows run."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    inp.write_text("".join(chat_line(i, "Win a prize now", **body) + "\n" for i, body in enumerate([
        {}, {"tools": [{"type": "function", "function": {"name": "f"}}]}, {"max_tokens": 10**6},
        {"n": 2, "best_of": 2, "temperature": 0.7, "seed": 1}, {"tools": []}])))
    assert main(["run", str(inp), "-o", str(out), "--no-progress"]) == 1
    capsys.readouterr()
    assert [o["custom_id"] for o in parse_outputs(out)] == ["sms-0", "sms-3", "sms-4"]
    errors = {e["custom_id"]: e["error"] for e in map(json.loads, Path(str(out) + ".errors.jsonl").read_text()
                                                       .splitlines())}
    assert errors.keys() == {"sms-1", "sms-2"}
    assert errors["sms-1"]["code"] == "unsupported_parameter" and "tools: [" in errors["sms-1"]["message"]
    assert errors["sms-2"]["code"] == "context_length_exceeded"
    assert "lower max_tokens to at most" in errors["sms-2"]["message"]


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "nan"], "--temperature nan: temperature must be a finite number >= 0, got nan"),
    (["--seed", str(2**70)], f"--seed {2**70}: seed must be a 64-bit integer"),
])
def test_a_bad_temperature_or_seed_names_that_flag_alone(tmp_path, capsys, flags, message):
    inp, out = _one_row_job(tmp_path)
    assert main(["run", str(inp), "-o", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and ("--seed" in flags) == ("--seed" in err), err


def test_help_explains_formats_and_resuming(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = capsys.readouterr().out
    assert "custom_id" in text and "--column" in text and "resume" in text.lower() and "--dry-run" in text


def test_version_answers(capsys):
    """`batchprompt --version` said "the following arguments are required: command"."""
    import batchprompt

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"batchprompt {batchprompt.__version__}"


def _one_row_job(tmp_path: Path) -> tuple[Path, Path]:
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hi"}\n')
    return inp, tmp_path / "o.jsonl"


@pytest.mark.parametrize("flags, message", [
    (["--kv-cache-memory", "4 gigs"], "--kv-cache-memory '4 gigs': unknown unit 'gigs'; give bytes with a unit"),
    (["--kv-cache-memory", "100%"], "--kv-cache-memory '100%' reads as a share of free memory"),
    (["--kv-cache-memory", "0"], "must be above 0"),
    (["--kv-cache-memory", "1.5"], "plain bytes are a whole number"),
    (["--device", "gpu"], "--device gpu: not a device; give auto, cpu, cuda, or cuda:N"),
    (["--device", "cuda:99"], "--device cuda:99: "),  # no CUDA here, or no GPU 99
    (["--max-model-len", "0"], "--max-model-len must be >= 2"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),  # was a traceback after the journal opened
    (["--journal", "-"], "--journal '-': the journal is a SQLite file, not a stream"),  # made a file named "-"
    (["--replicas", "2"], "--replicas needs --ray"),
])
def test_bad_hardware_options_fail_before_any_work(tmp_path, capsys, flags, message):
    inp, out = _one_row_job(tmp_path)
    assert main(["run", str(inp), "-o", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("batchprompt: error:") == 1 and message in err
    # The journal opens before the model loads: without it, nothing was started.
    assert not out.exists() and not Path(str(out) + ".journal").exists()


@pytest.mark.slow
def test_a_system_prompt_longer_than_the_context_is_a_bad_option(tmp_path, capsys):
    """Every row failed alone with "the messages have N tokens ... shorten it", which did not say
    that --system was what to shorten; the job then refused the fixed command (another --system)."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    inp.write_text('{"prompt": "hi"}\n{"prompt": "there"}\n')
    # (The process's engine, as the other tests here share it: its context of 8,192 tokens.)
    assert main(["run", str(inp), "-o", str(out), "--no-progress", "--system", "word " * 9000]) == 2
    err = capsys.readouterr().err
    assert err.count("batchprompt: error:") == 1, err
    assert re.search(r"--system is (at least )?[\d,]+ tokens, more than the model's context of 8,192 tokens", err), err
    assert not out.exists() and not Path(str(out) + ".journal").exists()
    # A row with a system message of its own does not take --system: it runs.
    inp.write_text(json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "hi"}], "max_tokens": 2}) + "\n")
    assert main(["run", str(inp), "-o", str(out), "--no-progress", "--system", "word " * 9000]) == 0


def test_a_kv_cache_too_small_for_one_full_context_request_is_one_error(tmp_path, capsys):
    """It was a traceback (exit 1) once the engine refused the budget."""
    import batchprompt as bp

    inp, out = _one_row_job(tmp_path)
    bp.shutdown()  # an engine of this process's earlier tests, with other options, is not this run's
    assert main(["run", str(inp), "-o", str(out), "--kv-cache-memory", "1000", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("batchprompt: error:") == 1 and "the KV cache holds 4 tokens" in err, err
    assert "--kv-cache-memory" in err and "Traceback" not in err


def test_options_other_than_the_running_engines_are_one_error_in_process(tmp_path, capsys):
    """`run` called in a process whose engine for the model runs with other options (a notebook,
    a test): one error, exit 2, not a traceback, and the running engine is left alone."""
    import batchprompt as bp

    inp, out = _one_row_job(tmp_path)
    bp.shutdown()
    try:
        assert bp.batch_prompt(["hi"], max_tokens=2, engine_options={"max_model_len": 1024})[0].ok
        assert main(["run", str(inp), "-o", str(out), "--max-model-len", "2048", "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.count("batchprompt: error:") == 1 and "call bp.shutdown() first" in err, err
        assert bp.batch_prompt(["hi"], max_tokens=2)[0].ok
    finally:
        bp.shutdown()


def test_a_context_longer_than_the_models_is_one_error(tmp_path, capsys):
    """Was a traceback and exit 1: the engine refuses it (as vLLM), and `run` says so once."""
    import batchprompt as bp

    inp, out = _one_row_job(tmp_path)
    bp.shutdown()
    assert main(["run", str(inp), "-o", str(out), "--max-model-len", "999999", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("batchprompt: error:") == 1 and "longer than the model's context of 8192 tokens" in err, err
    assert "Traceback" not in err


def test_unknown_dtype_is_a_usage_error(tmp_path, capsys):
    inp, out = _one_row_job(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["run", str(inp), "-o", str(out), "--dtype", "half"])
    assert e.value.code == 2
    assert "--dtype: invalid choice: 'half'" in capsys.readouterr().err
    assert not Path(str(out) + ".journal").exists()


def test_device_cuda_without_a_gpu_fails_before_any_work(tmp_path):
    inp, out = _one_row_job(tmp_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}  # no GPU, on any machine
    proc = subprocess.run([sys.executable, "-m", "batchprompt", "run", str(inp), "-o", str(out), "--device", "cuda"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "batchprompt: error: --device cuda: " in proc.stderr and "use --device cpu" in proc.stderr
    assert "Traceback" not in proc.stderr and not Path(str(out) + ".journal").exists()


@pytest.mark.parametrize("text, options", [
    ("64MiB", {"kv_cache_memory": 64 << 20}), ("4294967296", {"kv_cache_memory": 4294967296}),
    ("30%", {"kv_memory_fraction": 0.3}), ("0.5", {"kv_memory_fraction": 0.5}),
])
def test_kv_cache_memory_reaches_the_engine_config_as_bytes_or_a_share(text, options):
    from batchprompt.cli import _engine_options, build_parser

    args = build_parser().parse_args(["run", "in.jsonl", "-o", "o.jsonl", "--kv-cache-memory", text,
                                      "--max-model-len", "512", "--max-num-seqs", "8"])
    assert _engine_options(args, "cpu") == {"max_num_seqs": 8, "max_model_len": 512, **options}


def test_help_documents_the_hardware_options_with_examples(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # an example may wrap between its words
    for example in ("--device cuda:1", "--dtype float32", "--max-model-len 4096", "--kv-cache-memory 8GiB",
                    "30%", "--max-num-seqs 64", ".tsv"):
        assert example in text, example


# ---- in-process runs on the embedded model -------------------------------------------------------
pytestmark_slow = pytest.mark.slow


@pytest.mark.slow
def test_a_completion_row_with_echo_and_max_tokens_0_is_its_prompt_alone(tmp_path):
    """A row `echo: true, max_tokens: 0` (a text's log-likelihood, as HELM asks it) failed as
    "max_tokens must be an integer >= 1". As OpenAI and vLLM: the prompt, its log-probs, nothing
    generated."""
    body = {"prompt": "SMS: hello there", "max_tokens": 0, "echo": True, "logprobs": 1}
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"custom_id": "c", "method": "POST", "url": COMPLETION, "body": body}) + "\n"
                   + json.dumps({"custom_id": "d", "method": "POST", "url": COMPLETION,
                                 "body": {**body, "echo": False}}) + "\n"
                   + json.dumps({"custom_id": "e", "method": "POST", "url": CHAT,  # vLLM's prompt_logprobs too
                                 "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                          "prompt_logprobs": 1}}) + "\n")
    s = run_job(JobOptions(str(inp), str(out), progress=False))
    assert (s.ok, s.failed) == (2, 1)
    # read as JSON: the openai client's model types have no null for the prompt's first log-prob
    # (vLLM's and OpenAI's answers give one), so parse_outputs' strict check would refuse it
    got, chat = [json.loads(line) for line in out.read_text().splitlines()]
    plp = chat["response"]["body"]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == chat["response"]["body"]["usage"]["prompt_tokens"]
    assert all(1 <= len(e) <= 2 and min(x["rank"] for x in e.values()) == 1 or len(e) == 2 for e in plp[1:])
    choice = got["response"]["body"]["choices"][0]
    assert choice["text"] == body["prompt"] and choice["finish_reason"] == "length"
    assert "".join(choice["logprobs"]["tokens"]) == body["prompt"] and choice["logprobs"]["token_logprobs"][0] is None
    assert got["response"]["body"]["usage"]["completion_tokens"] == 0
    [err] = [json.loads(x) for x in Path(str(out) + ".errors.jsonl").read_text().splitlines()]
    assert "0 only with echo: true" in err["error"]["message"]


@pytest.mark.slow
def test_mixed_file_gives_openai_bodies_and_an_errors_file(tmp_path):
    rows = sms_rows(6)
    lines = [chat_line(0, rows[0][1]),
             "{broken",
             json.dumps({"custom_id": "c", "method": "POST", "url": COMPLETION,
                         "body": {"prompt": "SMS: hello\nLabel:", "max_tokens": 3, "logprobs": 1}}),
             chat_line(3, rows[3][1], logprobs=True),
             chat_line(4, rows[4][1], n=2, temperature=0.8, seed=5),
             json.dumps({"custom_id": "long", "method": "POST", "url": CHAT,
                         "body": {"messages": [{"role": "user", "content": "x " * 9000}]}}),
             json.dumps({"prompt": rows[5][1], "id": "plain"})]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    s = run_job(JobOptions(str(inp), str(out), system=SPAM_SYSTEM, max_tokens=4, progress=False))
    assert (s.rows, s.ok, s.failed) == (7, 5, 2)
    got = parse_outputs(out)
    assert [o["custom_id"] for o in got] == ["sms-0", "c", "sms-3", "sms-4", "plain"]
    by_id = {o["custom_id"]: o["response"]["body"] for o in got}
    assert by_id["c"]["object"] == "text_completion" and len(by_id["c"]["choices"][0]["logprobs"]["tokens"]) == \
        by_id["c"]["usage"]["completion_tokens"]
    assert by_id["sms-3"]["choices"][0]["logprobs"]["content"]
    assert len(by_id["sms-4"]["choices"]) == 2
    assert by_id["sms-0"]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    errs = [json.loads(x) for x in Path(str(out) + ".errors.jsonl").read_text().splitlines()]
    assert [(e["error"]["line"], e["error"]["code"]) for e in errs] == [(2, "invalid_json"),
                                                                        (6, "context_length_exceeded")]
    # a job already complete does nothing
    said = io.StringIO()
    s2 = run_job(JobOptions(str(inp), str(out), system=SPAM_SYSTEM, max_tokens=4, progress=False), said)
    assert s2.already_complete and s2.ok == 5
    # where the rows are (it said "7 rows in out.jsonl", 2 of them being in the errors file)
    assert f"already complete: 7 rows (5 in {out}, 2 in {out}.errors.jsonl)" in said.getvalue(), said.getvalue()
    # ... but an output overwritten since is written again from the journal (it said "already
    # complete" and left the other text there)
    written = out.read_text()
    out.write_text("junk\n")
    s3 = run_job(JobOptions(str(inp), str(out), system=SPAM_SYSTEM, max_tokens=4, progress=False))
    assert not s3.already_complete and (s3.ok, s3.failed, s3.run_rows) == (5, 2, 0)
    assert out.read_text() == written
    # ... and one with as many lines, a row twice and another gone (it said "already complete")
    lines_written = written.splitlines(keepends=True)
    out.write_text("".join(lines_written[:1] + lines_written[:1] + lines_written[2:]))
    s4 = run_job(JobOptions(str(inp), str(out), system=SPAM_SYSTEM, max_tokens=4, progress=False))
    assert not s4.already_complete and s4.run_rows == 0 and out.read_text() == written
    s5 = run_job(JobOptions(str(inp), str(out), system=SPAM_SYSTEM, max_tokens=4, progress=False))
    assert s5.already_complete
    # a changed input is refused, unless --restart
    inp.write_text("\n".join(lines[:3]) + "\n")
    assert main(["run", str(inp), "-o", str(out), "--system", SPAM_SYSTEM, "--max-tokens", "4"]) == 2
    assert main(["run", str(inp), "-o", str(out), "--system", SPAM_SYSTEM, "--max-tokens", "4",
                 "--restart", "--no-progress"]) == 1  # one row (the broken line) fails
    assert len(out.read_text().splitlines()) == 2


@pytest.mark.slow
def test_identical_greedy_bodies_run_once(tmp_path):
    from batchprompt.api.service import get_service

    text = sms_rows(1)[0][1]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(chat_line(i, text) + "\n" for i in range(8)) +
                   "".join(chat_line(10 + i, text, temperature=1.0) + "\n" for i in range(2)))
    engine = get_service(None).engine
    before = engine.stats.finished
    s = run_job(JobOptions(str(inp), str(tmp_path / "o.jsonl"), progress=False))
    assert s.ok == 10
    assert engine.stats.finished - before == 1 + 2  # 8 identical greedy rows once; sampled rows each
    texts = {o["response"]["body"]["choices"][0]["message"]["content"] for o in parse_outputs(tmp_path / "o.jsonl")[:8]}
    assert len(texts) == 1


@pytest.mark.slow
def test_csv_and_parquet_tables(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = sms_rows(4)
    table = pa.table({"label": [r[0] for r in rows], "text": [r[1] for r in rows]})
    pq.write_table(table, tmp_path / "in.parquet")
    out = tmp_path / "out.parquet"
    assert main(["run", str(tmp_path / "in.parquet"), "-o", str(out), "--column", "text", "--format", "table",
                 "--system", SPAM_SYSTEM, "--max-tokens", "4", "--no-progress"]) == 0
    result = pq.read_table(out)
    assert result.column_names == ["label", "text", "result", "finish_reason", "error"]
    assert all(isinstance(x, str) for x in result.column("result").to_pylist())
    assert set(result.column("finish_reason").to_pylist()) <= {"stop", "length"}
    csv_in = tmp_path / "in.csv"
    csv_in.write_text("id,text\n007,Win a prize now\n1.50,\n")
    assert main(["run", str(csv_in), "-o", str(tmp_path / "o.jsonl"), "--column", "text",
                 "--max-tokens", "3", "--no-progress"]) == 1
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 1
    # The table is written in the format the output's name says (Parquet bytes went to out.csv)
    args = ["--column", "text", "--format", "table", "--max-tokens", "2", "--no-progress"]
    assert main(["run", str(tmp_path / "in.parquet"), "-o", str(tmp_path / "t.csv"), *args]) == 0
    assert (tmp_path / "t.csv").read_text().splitlines()[0] == '"label","text","result","finish_reason","error"'
    # A finished table emptied or cut since is written again (it was "already complete")
    written = (tmp_path / "t.csv").read_text()
    for edited in ("", "\n".join(written.splitlines()[:3]) + "\n"):
        (tmp_path / "t.csv").write_text(edited)
        assert main(["run", str(tmp_path / "in.parquet"), "-o", str(tmp_path / "t.csv"), *args]) == 0
        assert (tmp_path / "t.csv").read_text() == written
    assert main(["run", str(csv_in), "-o", str(tmp_path / "t.parquet"), *args]) == 1  # its empty row fails
    assert pq.read_table(tmp_path / "t.parquet").column_names == ["id", "text", "result", "finish_reason", "error"]
    assert pq.read_table(tmp_path / "t.parquet").column("id").to_pylist() == ["007", "1.50"]  # were 7 and 1.5
    assert main(["run", str(csv_in), "-o", str(tmp_path / "t2.csv"), *args]) == 1
    assert [line.split(",")[0] for line in (tmp_path / "t2.csv").read_text().splitlines()[1:]] == ['"007"', '"1.50"']
    assert main(["run", str(csv_in), "-o", str(tmp_path / "t.jsonl"), *args]) == 2  # refused before any work
    assert not (tmp_path / "t.jsonl").exists()


@pytest.mark.slow
def test_dry_run_counts_and_estimates_without_running(tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    write_sms_batch(inp, 40)
    assert main(["run", str(inp), "-o", str(tmp_path / "o.jsonl"), "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert "dry run: 40 rows" in err and "prompt tokens" in err and "estimated run time" in err
    assert not (tmp_path / "o.jsonl").exists() and not (tmp_path / "o.jsonl.journal").exists()
    assert "calibration: 4 rows in" in err  # a tenth of them, at least 4 (it ran all 40: the whole job)


def test_a_dry_run_names_rows_whose_n_choices_greedy_makes_one_text(tmp_path, capsys):
    """Where a job is checked before it runs: only the run itself said it."""
    inp = tmp_path / "in.jsonl"
    inp.write_text(chat_line(0, "Name a colour.", max_tokens=2, n=2) + "\n")
    assert main(["run", str(inp), "-o", str(tmp_path / "o.jsonl"), "--dry-run", "--no-progress"]) == 0
    assert "note: 1 row (line 1) asks for n > 1 choices with no temperature" in capsys.readouterr().err


def test_a_dry_run_whose_calibration_rows_all_fail_gives_no_estimate(tmp_path, capsys):
    """Every calibration row failed (an endpoint answering 500, retried with backoff), and the dry
    run gave their retries' time as the estimate, with nothing said of the failures. It exits 1,
    as the run would end (it exited 0, so `--dry-run && run` went on with a pool of failing servers)."""
    inp = tmp_path / "in.jsonl"
    write_sms_batch(inp, 8)
    args = ["run", str(inp), "-o", str(tmp_path / "o.jsonl"), "--dry-run", "--no-progress"]
    assert main(args + ["--regex", "[ab]{40}", "--max-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert "calibration: all 4 rows failed in" in err and "the first: the output reached max_tokens" in err, err
    assert "no estimate: every calibration row failed (the output reached max_tokens" in err
    assert "estimated run time" not in err


@pytest.mark.slow
def test_a_dry_run_of_a_finished_job_counts_its_failed_rows(tmp_path, capsys):
    """A fresh dry run of a file with a bad row exited 1; once the job had run, its dry run said
    "0 that cannot run, 3 already done" and exited 0, though a row had failed."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    inp.write_text('{"prompt": "Hi"}\n{"prompt": "Hello"}\n{"prompt": ""}\n')
    args = ["run", str(inp), "-o", str(out), "--max-tokens", "2", "--no-progress"]
    assert main(args + ["--dry-run"]) == 1
    assert main(args) == 1
    capsys.readouterr()
    assert main(args + ["--dry-run"]) == 1
    err = capsys.readouterr().err
    assert "dry run: 3 rows (0 that cannot run, 3 already done (the journal, 1 of them failed))" in err, err


@pytest.mark.slow
def test_a_dry_run_reads_the_jobs_journal_as_the_run_would(tmp_path, capsys):
    """It ignored the journal: it estimated every row of a job half done, and estimated a job
    whose journal the run then refused (other options) with exit 0. It never writes the journal."""
    import sqlite3

    inp, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    write_sms_batch(inp, 8)
    args = ["run", str(inp), "-o", str(out), "--max-tokens", "2", "--no-progress"]
    assert main(args) == 0
    db = sqlite3.connect(f"{out}.journal")  # as a run killed after its first 5 rows
    db.execute("DELETE FROM rows WHERE line > 5")
    db.commit()
    db.close()
    before = (tmp_path / "o.jsonl.journal").read_bytes()
    capsys.readouterr()
    assert main(args + ["--dry-run"]) == 0
    err = capsys.readouterr().err
    assert "dry run: 8 rows (0 that cannot run, 5 already done (the journal))" in err, err
    assert "calibration: 3 rows in" in err, err
    assert main(args + ["--dry-run", "--temperature", "0.5"]) == 2
    assert "changed since the job began: --temperature (0.0 → 0.5)" in capsys.readouterr().err
    assert main(args + ["--dry-run", "--temperature", "0.5", "--restart"]) == 0  # the restart would run them all
    assert "dry run: 8 rows (0 that cannot run), " in capsys.readouterr().err
    assert (tmp_path / "o.jsonl.journal").read_bytes() == before
    assert sorted(p.name for p in tmp_path.glob("o.jsonl.journal*")) == ["o.jsonl.journal"]  # no -wal, -shm left


@pytest.mark.slow
def test_dtype_context_and_kv_size_reach_the_engine(tmp_path):
    import torch

    from batchprompt.api import service as svc
    from batchprompt.models import resolve_model
    from batchprompt.runner.kv_tensors import KVTensors

    key = (str(resolve_model(None).path), "cpu", "torch.float32")
    stale = svc._services.get(key)  # another test's engine under these settings would be shared
    if stale is not None:
        stale.shutdown()
    rows = sms_rows(2)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(chat_line(0, rows[0][1]) + "\n" + chat_line(1, rows[1][1]) + "\n" +
                   json.dumps({"custom_id": "long", "method": "POST", "url": COMPLETION,
                               "body": {"prompt": "word " * 700, "max_tokens": 4}}) + "\n" +
                   json.dumps({"custom_id": "huge", "method": "POST", "url": COMPLETION,  # refused unread
                               "body": {"prompt": "word " * 20_000, "max_tokens": 4}}) + "\n")
    rc = main(["run", str(inp), "-o", str(out), "--device", "cpu", "--dtype", "float32", "--max-model-len", "512",
               "--kv-cache-memory", "64MiB", "--max-tokens", "4", "--no-progress"])
    service = svc._services[key]  # the engine this run built
    try:
        assert rc == 1  # the long row fails alone
        assert [o["custom_id"] for o in parse_outputs(out)] == ["sms-0", "sms-1"]
        err, huge = [json.loads(x) for x in Path(str(out) + ".errors.jsonl").read_text().splitlines()]
        assert err["error"]["code"] == "context_length_exceeded" and "the context holds 512" in err["error"]["message"]
        assert huge["error"]["code"] == "context_length_exceeded"
        assert "the prompt has at least " in huge["error"]["message"], huge
        engine = service.engine
        param = next(engine.model.parameters())
        assert (param.dtype, param.device.type) == (torch.float32, "cpu")
        assert engine.max_model_len == 512 and engine.config.kv_cache_memory == 64 << 20
        per_block = KVTensors.bytes_per_block(engine.model.args, engine.config.block_size, torch.float32)
        assert engine.pool.max_blocks == (64 << 20) // per_block
    finally:
        service.shutdown()  # later tests with these settings get an engine of their own


# ---- crashes: a real SIGKILL, and Ctrl-C ---------------------------------------------------------
def _start(inp: Path, out: Path) -> subprocess.Popen:
    """The job in a process of its own, on the CPU: these tests stop it part way, and on a GPU
    (an H100) a 160-row job ended before a poll saw its 20th row."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "batchprompt", "run", str(inp), "-o", str(out), "--no-progress",
                             "--device", "cpu"],
                            stderr=subprocess.PIPE, text=True, env=env, preexec_fn=sigint_default)


def _journaled(out: Path) -> int:
    path = Path(str(out) + ".journal")
    if not path.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            return db.execute("SELECT COUNT(*) FROM rows").fetchone()[0]
    except sqlite3.Error:
        return 0


def _wait_for_rows(proc, out: Path, n: int, timeout: float = 300) -> int:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout and proc.poll() is None:
        k = _journaled(out)
        if k >= n:
            return k
        time.sleep(0.05)
    raise AssertionError(f"the job did not journal {n} rows in time (rc={proc.poll()})")


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", ["loading", "mid-run"])
def test_resume_after_sigkill_gives_each_row_once(tmp_path, kill_at):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = write_sms_batch(inp, 160)
    proc = _start(inp, out)
    if kill_at == "loading":
        time.sleep(2.0)
    else:
        _wait_for_rows(proc, out, 20)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    kept = _journaled(out)
    assert kill_at == "loading" or 20 <= kept < 160
    proc = _start(inp, out)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    if kept:
        assert f"resuming: {kept} of 160 rows" in err
    got = parse_outputs(out)
    assert [o["custom_id"] for o in got] == ids  # every row once, in input order
    assert out.with_name("out.jsonl.errors.jsonl").read_text() == ""


@pytest.mark.slow
def test_rows_that_finish_before_a_long_one_are_durable_while_it_runs(tmp_path):
    """Seven short rows finish at once; the eighth generates 600 tokens. The seven are committed
    while it runs (a journal committed only when the next row finished left them pending until
    the long row ended, and a SIGKILL then cost all seven)."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = sms_rows(8)
    inp.write_text("".join(chat_line(i, t, max_tokens=1) + "\n" for i, (_, t) in enumerate(rows[:7]))
                   + chat_line(7, rows[7][1], max_tokens=600, min_tokens=600) + "\n")
    proc = _start(inp, out)
    try:
        _wait_for_rows(proc, out, 7)
        assert proc.poll() is None  # the long row is still running
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _journaled(out) == 7
    proc = _start(inp, out)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert "resuming: 7 of 8 rows" in err
    got = parse_outputs(out)
    assert [o["custom_id"] for o in got] == [f"sms-{i}" for i in range(8)]
    assert got[7]["response"]["body"]["usage"]["completion_tokens"] == 600


# Rows enough that a signal sent once 10 are journaled lands long before the last one: with
# 160, on a loaded machine, the job finished before a Ctrl-C sent at 10 rows took effect.
SIGNAL_ROWS = 640


@pytest.mark.slow
def test_ctrl_c_stops_cleanly_and_says_how_to_resume(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = write_sms_batch(inp, SIGNAL_ROWS)
    proc = _start(inp, out)
    _wait_for_rows(proc, out, 10)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Run the same command again to resume" in err
    kept = _journaled(out)
    assert kept >= 10 and not out.exists()
    proc = _start(inp, out)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert [o["custom_id"] for o in parse_outputs(out)] == ids


@pytest.mark.slow
def test_sigterm_stops_like_ctrl_c_and_the_resume_gives_each_row_once(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = write_sms_batch(inp, SIGNAL_ROWS)
    proc = _start(inp, out)
    _wait_for_rows(proc, out, 10)
    proc.send_signal(signal.SIGTERM)  # what schedulers and `docker stop` send
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "stopped by SIGTERM" in err and "Run the same command again to resume" in err
    kept = _journaled(out)
    assert 10 <= kept < SIGNAL_ROWS and not out.exists()
    proc = _start(inp, out)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert f"resuming: {kept} of {SIGNAL_ROWS} rows" in err
    assert [o["custom_id"] for o in parse_outputs(out)] == ids


@pytest.mark.slow
@pytest.mark.parametrize("first, gap, exit_status", [(signal.SIGINT, 0.001, 130), (signal.SIGTERM, 0.02, 143),
                                                     (signal.SIGINT, 0.4, 130)])
def test_a_second_signal_at_once_leaves_the_first_ones_summary_whole(tmp_path, first, gap, exit_status):
    """Ctrl-C pressed twice (or SIGTERM then Ctrl-C): the second escaped the job's cleanup, and it
    said "interrupted before any row ran", with no summary, where rows were kept in the journal;
    one that came as the summary printed ended the process by the signal."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_sms_batch(inp, SIGNAL_ROWS)
    proc = _start(inp, out)
    _wait_for_rows(proc, out, 10)
    proc.send_signal(first)
    time.sleep(gap)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == exit_status, err
    assert "before any row ran" not in err and "Run the same command again to resume" in err, err
    assert "unfinished" not in err  # the Python API's exit warning, which means nothing here
    assert _journaled(out) >= 10


@pytest.mark.slow
def test_stdin_to_stdout(tmp_path):
    rows = sms_rows(3)
    data = "".join(json.dumps({"prompt": t, "id": f"p{i}"}) + "\n" for i, (_, t) in enumerate(rows))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "BATCHPROMPT_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "batchprompt", "run", "-", "-o", "-", "--max-tokens", "4", "--no-progress"]
    first = subprocess.run(cmd, input=data, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    assert [json.loads(x)["custom_id"] for x in lines] == ["p0", "p1", "p2"]
    again = subprocess.run(cmd, input=data, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0 and again.stdout == first.stdout  # from the journal, nothing rerun
    assert "already complete" in again.stderr


@pytest.mark.slow
def test_with_output_to_stdout_nothing_else_prints_there(tmp_path, capsys, monkeypatch):
    """With --ray, Ray's replica logs ("(raylet) A worker died ...") went to stdout, the first
    line of the JSONL there. Here a print during the job stands in for them."""
    from batchprompt.jobs import run as run_module

    original = run_module.JobRun.run

    def noisy(self):
        print("(raylet) A worker died or was killed")
        return original(self)

    monkeypatch.setattr(run_module.JobRun, "run", noisy)
    inp = tmp_path / "in.jsonl"
    write_sms_batch(inp, 2)
    assert main(["run", str(inp), "-o", "-", "--max-tokens", "2", "--no-progress",
                 "--journal", str(tmp_path / "j.sqlite")]) == 0
    out, err = capsys.readouterr()
    assert [json.loads(line)["custom_id"] for line in out.splitlines()] == ["sms-0", "sms-1"], out
    assert "(raylet) A worker died or was killed" in err
    print("after")  # stdout is itself again
    assert capsys.readouterr().out == "after\n"


def test_rows_answer_as_the_server_answers_them(tmp_path):
    """n > 1 with a seed and a constraint ran each choice with params rebuilt through asdict,
    which failed every such row ("unhashable type: 'dict'"); stream_options without stream
    ran, where the endpoint refuses it; a bad option's code was invalid_request, where the
    server says invalid_parameter."""
    rows = [chat_line(0, "Hello", n=2, seed=5, guided_choice=["spam", "ham"]),
            chat_line(1, "Hello", n=2, seed=5, response_format={
                "type": "json_schema", "json_schema": {"name": "g", "schema": {"type": "object", "properties": {
                    "a": {"type": "integer"}}, "required": ["a"]}}}, max_tokens=12),
            chat_line(2, "Hello", stream_options={"include_usage": True}),
            chat_line(3, "Hello", logprobs=True, top_logprobs=21)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(rows) + "\n")
    assert main(["run", str(inp), "-o", str(out), "--no-progress"]) == 1
    outputs = {o["custom_id"]: o["response"]["body"] for o in parse_outputs(out)}
    assert [c["message"]["content"] in ("spam", "ham") for c in outputs["sms-0"]["choices"]] == [True, True]
    assert [isinstance(json.loads(c["message"]["content"])["a"], int) for c in outputs["sms-1"]["choices"]] == [True] * 2
    errors = {e["custom_id"]: e["error"] for e in map(json.loads, Path(str(out) + ".errors.jsonl").read_text()
                                                      .splitlines())}
    assert errors["sms-2"]["code"] == "invalid_parameter" and "stream_options" in errors["sms-2"]["message"]
    assert errors["sms-3"]["code"] == "invalid_parameter" and "top_logprobs" in errors["sms-3"]["message"]
    # Each line holds the endpoint's answer, as OpenAI's error file does, with the field named.
    bodies = {e["custom_id"]: e["response"] for e in map(json.loads, Path(str(out) + ".errors.jsonl").read_text()
                                                         .splitlines())}
    assert [(bodies[c]["status_code"], bodies[c]["body"]["error"]["param"]) for c in ("sms-2", "sms-3")] == [
        (400, "stream_options"), (400, "top_logprobs")]


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_a_table_input_error_exits_2_on_a_busy_machine_never_aborting(tmp_path, fmt):
    """A CSV or Parquet input refused (an unknown --column) printed the right error, then
    "terminate called without an active exception" and exit 134 in about 1 of 3 runs on a busy
    machine: pyarrow's reader threads were still starting as the interpreter finalized. The
    readers run on the calling thread (Parquet's too: read_table still read on pyarrow's IO
    threads, 5 of 10 runs aborted). Bounded: 8 runs beside 2 busy loops of at most 120 s."""
    inp = tmp_path / f"t.{fmt}"
    if fmt == "csv":
        inp.write_text("text\nhello\nworld\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"text": ["hello", "world"]}), inp)
    busy = [subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 120\nwhile time.time() < end: pass"])
            for _ in range(2)]
    try:
        for _ in range(8):
            proc = subprocess.run([sys.executable, "-m", "batchprompt", "run", str(inp), "-o", str(tmp_path / "o.jsonl"),
                                   "--column", "nope"], capture_output=True, text=True, timeout=120)
            assert proc.returncode == 2 and "terminate called" not in proc.stderr, (proc.returncode, proc.stderr)
            assert "no column 'nope'; the columns are: text" in proc.stderr
    finally:
        for p in busy:
            p.kill()
            p.wait()


def test_small_mistakes_get_the_commands_usage_and_say_what_is_wrong(tmp_path, capsys):
    """An unknown option printed the top-level usage ("batchprompt [-h] [--version] {run,serve}"),
    a folder as input was an "unknown input format ''", and the summary said "1 rows"."""
    with pytest.raises(SystemExit) as e:
        main(["run", "in.jsonl", "-o", "out.jsonl", "--frobnicate"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage: batchprompt run" in err and "unrecognized arguments: --frobnicate" in err
    (tmp_path / "odir").mkdir()
    assert main(["run", str(tmp_path / "odir"), "-o", str(tmp_path / "q.jsonl"), "--no-progress"]) == 2
    assert "odir: is a folder, not an input file" in capsys.readouterr().err


def test_one_row_is_one_row():
    from batchprompt.jobs.run import JobSummary as Summary

    assert str(Summary(rows=1, ok=1)).startswith("1 row: 1 ok, 0 failed")
    assert str(Summary(rows=2, ok=2)).startswith("2 rows: 2 ok")


@pytest.mark.slow
def test_an_output_through_a_link_or_a_fifo_is_written_through_not_replaced(tmp_path):
    """write_atomic replaced whatever was at the path: a link to the output became a file of its
    own (the file it pointed to kept its old text), a FIFO's reader got nothing and waited, and
    `-o /dev/null`, as root, made /dev/null a regular file (its journal and errors file in /dev)."""
    import threading

    inp = tmp_path / "in.jsonl"
    ids = write_sms_batch(inp, 3)
    real = tmp_path / "real"
    real.mkdir()
    (real / "target.jsonl").write_text("old\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(real / "target.jsonl")
    assert main(["run", str(inp), "-o", str(link), "--max-tokens", "1", "--no-progress"]) == 0
    assert link.is_symlink() and [o["custom_id"] for o in parse_outputs(real / "target.jsonl")] == ids
    private = tmp_path / "private.jsonl"  # an output replaced keeps its mode (0600 became 0644)
    private.write_text("")
    private.chmod(0o600)
    assert main(["run", str(inp), "-o", str(private), "--max-tokens", "1", "--no-progress"]) == 0
    assert private.stat().st_mode & 0o777 == 0o600 and len(parse_outputs(private)) == 3

    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    assert main(["run", str(inp), "-o", str(fifo), "--max-tokens", "1", "--no-progress"]) == 0
    reader.join(60)
    assert [json.loads(x)["custom_id"] for x in got[0].decode().splitlines()] == ids
    assert fifo.is_fifo()
    # Its journal is kept in the cache, as stdout's is: none beside the stream.
    assert not Path(str(fifo) + ".journal").exists() and not Path(str(fifo) + ".errors.jsonl").exists()


def test_an_input_that_cannot_be_read_is_one_error(tmp_path, capsys, monkeypatch):
    """No read permission gave a PermissionError traceback and exit 1 (root reads any file, so
    the refusal is made here as the file system would make it)."""
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hi"}\n')
    real_read = Path.read_bytes

    def read_bytes(self):
        if self == inp:
            raise PermissionError(13, "Permission denied", str(self))
        return real_read(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    refused_before_any_work(capsys, inp, tmp_path / "o.jsonl", message=f"{inp}: cannot read it (Permission denied)")
    # Standard input closed (`<&-`), or open for writing only: an AttributeError or OSError traceback.
    for stdin in (None, open(tmp_path / "w.txt", "wb")):
        monkeypatch.setattr(sys, "stdin", stdin if stdin is None else io.TextIOWrapper(stdin))
        assert main(["run", "-", "-o", str(tmp_path / "o2.jsonl")]) == 2
        assert "standard input (-): cannot read it" in capsys.readouterr().err


@pytest.mark.slow
def test_a_reader_that_closes_stdout_ends_the_job_quietly(tmp_path):
    """`-o - | head -1` printed a BrokenPipeError traceback and exited 1 ("some rows failed"); a
    FIFO's reader that left early gave exit 3, "cannot write", as a full disk does."""
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": f"r{i}-" + "x" * 400, "method": "POST", "url": CHAT,
                                       "body": {"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 1}})
                           + "\n" for i in range(300)))  # 130 KB of output: more than a pipe holds
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    for output in ("-", str(fifo)):
        err_file = tmp_path / "stderr.txt"
        with open(err_file, "wb") as err_out:
            proc = subprocess.Popen([sys.executable, "-m", "batchprompt", "run", str(inp), "-o", output,
                                     "--no-progress"], stdout=subprocess.PIPE, stderr=err_out,
                                    env={**os.environ, "HF_HUB_OFFLINE": "1"})
            reader = proc.stdout if output == "-" else open(fifo, "rb")  # noqa: SIM115 - closed below
            first = reader.readline()
            reader.close()
            rc = proc.wait(timeout=300)
        err = err_file.read_text()
        assert rc == 141, (output, err)
        assert json.loads(first)["custom_id"] == "r0-" + "x" * 400
        assert "Traceback" not in err and "BrokenPipe" not in err and "cannot write" not in err, err
