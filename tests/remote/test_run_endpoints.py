"""`batchprompt run --endpoints HOSTFILE`: the job runner on a pool (journal, resume, errors file)."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from ..conftest import sigint_default
from .conftest import pool_of
from .fault_proxy import FaultProxy


def _write_input(path: Path, n: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"messages": [{"role": "user", "content": f"Count to {i}."}],
                                         "max_tokens": 24}}) + "\n")
        f.write("this line is not JSON\n")


def _run(*args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONFAULTHANDLER": "1"}  # SIGABRT prints every thread's stack
    return subprocess.Popen([sys.executable, "-m", "batchprompt", "run", *args, "--no-progress"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default, **kw)


def _journal_rows(path: Path) -> int:
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5) as db:
            return db.execute("SELECT COUNT(*) FROM rows").fetchone()[0]
    except sqlite3.Error:
        return 0


def test_run_on_endpoints_is_interrupted_and_resumed(two_servers, tmp_path):
    rows = 80
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_input(inp, rows)
    slow = FaultProxy(two_servers[1].url)
    # The first run is interrupted with rows done and rows in flight: the endpoint gets its whole
    # share at once, in two requests (initial_in_flight); the first is answered, the second held.
    slow.plan("delay:0")
    slow.plan("delay:600")
    try:
        hosts = tmp_path / "hosts"
        hosts.write_text(f"# one slow endpoint\n{slow.url.removeprefix('http://')}\n")
        first = _run(str(inp), "-o", str(out), "--endpoints", str(hosts), "--model", "smollm2-135m")
        deadline = time.monotonic() + 300
        while _journal_rows(Path(str(out) + ".journal")) < 2:  # the bad line, and some rows
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "no row journaled within 300s"
            time.sleep(0.2)
        first.send_signal(signal.SIGINT)
        try:
            _, err1 = first.communicate(timeout=120)
        except subprocess.TimeoutExpired:  # where it hangs: every thread's stack, from faulthandler
            first.send_signal(signal.SIGABRT)
            _, err1 = first.communicate(timeout=60)
            raise AssertionError(f"no exit within 120s of Ctrl-C; its threads:\n{err1[-20000:]}") from None
        assert first.returncode == 130, err1
        assert "Run the same command again to resume" in err1
    finally:
        slow.close()
    hosts.write_text("\n".join(s.url for s in two_servers) + "\n")
    second = _run(str(inp), "-o", str(out), "--endpoints", str(hosts))
    _, err2 = second.communicate(timeout=600)
    assert second.returncode == 1, err2  # EXIT_ROWS_FAILED: the line that is not JSON
    assert "resuming:" in err2
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(x["custom_id"] for x in lines) == sorted(f"r{i}" for i in range(rows))
    assert all(x["response"]["body"]["choices"][0]["message"]["content"] for x in lines)
    assert all(x["response"]["body"]["model"] == "smollm2-135m" for x in lines)
    errors = [json.loads(x) for x in Path(str(out) + ".errors.jsonl").read_text().splitlines()]
    assert [e["error"]["line"] for e in errors] == [rows + 1]


def test_ctrl_c_keeps_the_rows_a_request_finished_while_its_long_row_ran(two_servers, tmp_path):
    """Rows are journaled as each finishes on the server: Ctrl-C while one long row of the
    request still runs keeps the short ones (a request's rows were journaled only when the whole
    request ended, so an interrupt lost them all)."""
    from .test_pool import SHORT_AND_LONG

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    with open(inp, "w") as f:
        for i, prompt in enumerate(SHORT_AND_LONG):
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"messages": [{"role": "user", "content": prompt}], "max_tokens": 200}}) + "\n")
    # the 4 rows (prompt + 200 tokens each) fit in one request: the pool sends at least 1,024 tokens
    run = _run(str(inp), "-o", str(out), "--endpoints", two_servers[0].url)
    journal = Path(str(out) + ".journal")
    deadline = time.monotonic() + 300
    while _journal_rows(journal) < 1:
        assert run.poll() is None, run.communicate()
        assert time.monotonic() < deadline, "no row journaled within 300s"
        time.sleep(0.1)
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 130, err
    with sqlite3.connect(f"file:{journal}?mode=ro", uri=True) as db:
        kept = {row[0] for row in db.execute("SELECT custom_id FROM rows")}
    assert kept and kept <= {"r0", "r1", "r2"}, kept  # short rows kept; the long one was still running


def test_run_with_an_unserved_model_fails_before_any_work(two_servers, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_input(inp, 2)
    hosts = tmp_path / "hosts"
    hosts.write_text(f"{two_servers[0].url}\n")
    p = _run(str(inp), "-o", str(out), "--endpoints", str(hosts), "--model", "llama-70b")
    _, err = p.communicate(timeout=300)
    assert p.returncode == 2, err
    assert "does not serve the model 'llama-70b'" in err and not out.exists()


def test_give_up_after_needs_endpoints(tmp_path):
    """--give-up-after is the pool's: without --endpoints it is a bad option, named before any work."""
    _write_input(tmp_path / "in.jsonl", 2)
    p = _run(str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--give-up-after", "5")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2, err
    assert "--give-up-after needs --endpoints" in err
    assert not (tmp_path / "out.jsonl").exists()


def test_endpoints_with_ray_are_refused_before_waiting_for_the_servers(tmp_path):
    """--ray was ignored: the run waited give_up_after (120 s) for the endpoints, then failed."""
    _write_input(tmp_path / "in.jsonl", 2)
    p = _run(str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--ray", "--endpoints",
             "http://127.0.0.1:9")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 2 and "give --endpoints or --ray, not both" in err, err


def test_choice_mode_score_with_endpoints_is_refused_before_waiting_for_the_servers(tmp_path):
    """It waited for the servers, then failed every row alone."""
    _write_input(tmp_path / "in.jsonl", 2)
    p = _run(str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--choices", "yes,no",
             "--choice-mode", "score", "--endpoints", "http://127.0.0.1:9")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 2 and "--choice-mode score needs the engine's label scoring" in err, err
    assert not (tmp_path / "out.jsonl").exists()


def test_a_row_asking_for_label_scoring_on_a_pool_fails_alone_before_it_is_sent(two_servers, tmp_path):
    """The row was sent to the pool's backend and failed there, with the engine's code, not the
    option's: now it is refused as a bad option is, naming its line."""
    from batchprompt.jobs.run import JobOptions, run_job

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    body = {"messages": [{"role": "user", "content": "Is the sky blue?"}], "max_tokens": 4}
    rows = [{"custom_id": "plain", "method": "POST", "url": "/v1/chat/completions", "body": body},
            {"custom_id": "scored", "method": "POST", "url": "/v1/chat/completions",
             "body": {**body, "guided_choice": ["yes", "no"], "choice_mode": "score"}}]
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pool_of([two_servers[0].url]) as pool:
        summary = run_job(JobOptions(input=str(inp), output=str(out), progress=False, cluster=pool))
    assert (summary.ok, summary.failed) == (1, 1), summary
    [error] = [json.loads(x) for x in Path(str(out) + ".errors.jsonl").read_text().splitlines()]
    assert error["custom_id"] == "scored" and error["error"]["code"] == "invalid_parameter", error
    assert error["error"]["message"].startswith("line 2: choice_mode='score' needs the engine's label scoring")


def test_ctrl_c_while_waiting_for_the_endpoints_is_one_line(tmp_path):
    """It printed a KeyboardInterrupt traceback from the pool's wait."""
    from batchprompt.server.process import free_port

    _write_input(tmp_path / "in.jsonl", 2)
    p = _run(str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--endpoints",
             f"http://127.0.0.1:{free_port()}")
    deadline = time.monotonic() + 120
    err = ""
    while "waiting up to" not in err:  # the pool's warning: no endpoint answers yet
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        err += p.stderr.readline()
    p.send_signal(signal.SIGINT)
    rest = p.communicate(timeout=60)[1]
    assert p.returncode == 130, err + rest
    assert "interrupted before any row ran (while waiting for the endpoints)" in rest and "Traceback" not in rest


def test_rows_no_endpoint_answered_for_are_not_journaled_and_run_when_the_job_runs_again(proxy, tmp_path):
    """Every endpoint down past give_up_after: the rows fail (errors file, code not_run), but
    they are not the rows' fault: the journal keeps none of them, and the same job run again
    once a server answers runs them (it used to say 'already complete', with the rows lost
    unless --restart threw away every finished row)."""
    from batchprompt.jobs.run import JobOptions, run_job

    rows = 4
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_input(inp, rows)
    opts = dict(input=str(inp), output=str(out), progress=False)
    with pool_of([proxy.url], give_up_after=2, max_retries=10) as pool:
        proxy.set_down(True)
        first = run_job(JobOptions(**opts, cluster=pool))
    assert (first.ok, first.failed, first.not_run) == (0, rows + 1, rows)
    assert "run the same command again to run them" in str(first)
    errors = [json.loads(x) for x in Path(str(out) + ".errors.jsonl").read_text().splitlines()]
    assert [e["error"]["line"] for e in errors] == list(range(1, rows + 2))  # in input order
    assert [e["error"]["code"] for e in errors[:rows]] == ["not_run"] * rows
    assert all("no endpoint of the pool answered for 2s" in e["error"]["message"] for e in errors[:rows])
    assert _journal_rows(Path(str(out) + ".journal")) == 1  # the line that is not JSON, only
    proxy.set_down(False)
    with pool_of([proxy.url]) as pool:
        second = run_job(JobOptions(**opts, cluster=pool))
    assert (second.resumed, second.ok, second.failed, second.not_run) == (1, rows, 1, 0)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == [f"r{i}" for i in range(rows)]
    errors = [json.loads(x) for x in Path(str(out) + ".errors.jsonl").read_text().splitlines()]
    assert [e["error"]["line"] for e in errors] == [rows + 1]


def test_give_up_after_that_never_ends_is_a_bad_option(tmp_path):
    """--give-up-after nan was taken and the run never gave up (inf: the same, on purpose or not)."""
    _write_input(tmp_path / "in.jsonl", 2)
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1:9\n")  # never contacted: the option is refused first
    for value in ("nan", "inf", "0"):
        p = _run(str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--endpoints", str(hosts),
                 "--give-up-after", value)
        out, err = p.communicate(timeout=120)
        assert p.returncode == 2, err
        assert f"--give-up-after must be a finite number of seconds > 0, got {value}" in err
        assert not (tmp_path / "out.jsonl").exists()


def test_local_engine_options_with_endpoints_are_refused_before_waiting(tmp_path, capsys):
    """They were ignored (--device cuda ran on a machine with no GPU), yet --dtype locked the journal."""
    from batchprompt.cli import main

    _write_input(tmp_path / "in.jsonl", 2)
    for flag, value in (("--dtype", "bfloat16"), ("--device", "cuda"), ("--kv-cache-memory", "1GiB"),
                        ("--max-num-seqs", "2")):
        code = main(["run", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--no-progress",
                     "--endpoints", "http://127.0.0.1:9", flag, value])
        err = capsys.readouterr().err
        assert code == 2 and f"{flag} sets up a local engine; with --endpoints the servers run the model" in err, err
    for flag, value in (("--request-timeout", "5"), ("--tokenizer", "smollm2-135m")):
        code = main(["run", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), flag, value])
        assert code == 2 and f"{flag} needs --endpoints" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_request_timeout_and_tokenizer_reach_the_pool(two_servers, tmp_path, capsys):
    """A server that never answered held each try for the pool's 300 s with no way to shorten it
    from the command line; a tokenizer that could not load was a PoolError traceback, exit 1."""
    from batchprompt.cli import _endpoint_pool, build_parser, main

    inp = tmp_path / "in.jsonl"
    _write_input(inp, 2)
    args = build_parser().parse_args(["run", str(inp), "-o", "x", "--endpoints", two_servers[0].url,
                                      "--request-timeout", "7", "--tokenizer", "smollm2-135m"])
    pool = _endpoint_pool(args)
    try:
        assert pool.timeout == 7.0 and pool.tokenizer is not None
    finally:
        pool.close()
    missing = tmp_path / "no-such-model.gguf"
    code = main(["run", str(inp), "-o", str(tmp_path / "out.jsonl"), "--no-progress", "--endpoints",
                 two_servers[0].url, "--tokenizer", str(missing)])
    err = capsys.readouterr().err
    assert code == 2 and "cannot load the tokenizer" in err and "batchprompt run --tokenizer" in err, err
    assert "Traceback" not in err and not (tmp_path / "out.jsonl").exists()


def test_the_embedded_models_hub_id_takes_the_embedded_tokenizer_offline(monkeypatch):
    """A server started with --served-model-name HuggingFaceTB/SmolLM2-135M-Instruct (as the README
    shows for vLLM users) could not be used offline: the pool looked for that tokenizer on the hub."""
    from batchprompt.remote.tokenizer import load_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok, ctx = load_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct")
    embedded, embedded_ctx = load_tokenizer("smollm2-135m")
    assert tok.encode("Hello, world") == embedded.encode("Hello, world") and ctx == embedded_ctx


def _completion_requests(server) -> float:
    import re as _re

    import httpx

    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(float(v) for v in _re.findall(r'batchprompt_http_requests_total\{[^}]*route="/v1/completions"[^}]*\} '
                                             r'([0-9.e+]+)', text))


def test_greedy_rows_with_a_seed_each_share_requests(two_servers, tmp_path, capsys):
    """A greedy row's seed changes nothing, but rows share a request only where their parameters are
    equal: a seed per row sent each row in a request of its own (one request per row, 3x slower)."""
    from batchprompt.cli import main

    inp = tmp_path / "in.jsonl"
    with open(inp, "w") as f:
        for i in range(12):
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"messages": [{"role": "user", "content": f"Count to {i}."}],
                                         "max_tokens": 4, "temperature": 0, "seed": i}}) + "\n")
    before = _completion_requests(two_servers[0])
    assert main(["run", str(inp), "-o", str(tmp_path / "out.jsonl"), "--no-progress",
                 "--endpoints", two_servers[0].url]) == 0, capsys.readouterr().err
    sent = _completion_requests(two_servers[0]) - before
    assert 1 <= sent <= 4, sent
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 12
