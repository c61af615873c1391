"""One run per journal: a second run (or a --restart) beside a running one exits 2, naming it."""
from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys

import pytest

from batchprompt.cli import main
from batchprompt.jobs import JobOptions, Journal
from batchprompt.jobs.lock import JobLock, JournalBusy
from batchprompt.jobs.run import fingerprint

from .test_cli import _journaled, _start, _wait_for_rows, parse_outputs, write_sms_batch


@pytest.fixture
def no_model(monkeypatch):
    """A run that gets as far as loading the model fails the test."""
    def refuse(*a, **k):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr("batchprompt.jobs.run.get_backend", refuse)


def test_a_second_lock_names_the_holder_and_the_file_goes_with_the_last(tmp_path):
    journal = tmp_path / "out.jsonl.journal"
    with JobLock(journal):
        with pytest.raises(JournalBusy) as e:
            JobLock(journal).acquire()  # flock: a second open file conflicts even in one process
        assert f"pid {os.getpid()} on {socket.gethostname()}, started " in str(e.value)
        assert str(journal) in str(e.value)
    assert not (tmp_path / "out.jsonl.journal.lock").exists()
    with JobLock(journal):  # free again
        pass


def test_a_run_or_a_restart_beside_a_running_one_exits_2_and_leaves_its_journal(tmp_path, capsys, no_model):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_sms_batch(inp, 3)
    journal = tmp_path / "out.jsonl.journal"
    with JobLock(journal):  # as a run does, for its whole length
        j = Journal(journal, fingerprint(inp.read_bytes(), JobOptions(str(inp), str(out)))[0])
        j.record(1, "sms-0", True, {"kept": True})
        j.close()
        for extra in ([], ["--restart"]):
            assert main(["run", str(inp), "-o", str(out), "--no-progress", *extra]) == 2
            err = capsys.readouterr().err
            assert f"is in use by another batchprompt run (pid {os.getpid()} on {socket.gethostname()}" in err
            assert _journaled(out) == 1  # --restart did not empty it under the running job
    assert not out.exists()


def test_a_run_that_writes_the_same_output_another_way_exits_2(tmp_path, capsys, no_model):
    """Through a link to the output, or with a --journal of its own, a second run wrote the same
    output at once (the last to finish won, and the other's journal then counted itself complete)."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_sms_batch(inp, 3)
    out.touch()
    (tmp_path / "link.jsonl").symlink_to(out)
    with JobLock(tmp_path / "out.jsonl.journal"):  # as a run of `-o out.jsonl` holds it
        for args in (["-o", str(tmp_path / "link.jsonl")], ["-o", str(out), "--journal", str(tmp_path / "j")]):
            assert main(["run", str(inp), *args, "--no-progress"]) == 2
            err = capsys.readouterr().err
            assert "is in use by another batchprompt run" in err and "the output " in err, err
    assert not (tmp_path / "link.jsonl.journal").exists() and not (tmp_path / "j").exists()


@pytest.mark.slow
def test_two_real_runs_of_one_job_the_second_stops_at_once(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = write_sms_batch(inp, 160)
    first = _start(inp, out)
    _wait_for_rows(first, out, 5)
    first.send_signal(signal.SIGSTOP)  # held mid-job (with its lock), however fast the machine
    try:
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        for extra in ([], ["--restart"]):
            second = subprocess.run([sys.executable, "-m", "batchprompt", "run", str(inp), "-o", str(out),
                                     "--no-progress", *extra], capture_output=True, text=True, env=env, timeout=300)
            assert second.returncode == 2, second.stderr
            assert f"(pid {first.pid} on {socket.gethostname()}, started " in second.stderr
    finally:
        first.send_signal(signal.SIGCONT)
    _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err
    assert [o["custom_id"] for o in parse_outputs(out)] == ids
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith((".tmp", ".lock"))]
    with sqlite3.connect(f"file:{out}.journal?mode=ro", uri=True) as db:
        assert db.execute("SELECT COUNT(*) FROM rows").fetchone()[0] == 160
