"""The Batch API across restarts: a server killed (kill -9) or stopped (SIGTERM) mid-batch and
started again on the same --data-dir resumes the batch and completes it, and computes only
the requests its journal did not hold: the new engine's request count proves it."""
from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchprompt.server.process import free_port

from .batch_util import completion_line, lines_of, long_line, strict_batch, upload, wait_ended
from .conftest import STOP_TIMEOUT_S, start_server, stop_server

pytestmark = pytest.mark.slow

QUICK, LONG = 20, 3
LONG_TOKENS = 256  # long enough to be running when the quick ones are journaled, short enough to finish after


def journaled(journal: Path) -> dict[int, str]:
    """line -> record committed in the batch's journal (read beside the server: WAL)."""
    if not journal.exists():
        return {}
    db = sqlite3.connect(journal.resolve().as_uri() + "?mode=ro", uri=True)
    try:
        return dict(db.execute("SELECT line, record FROM rows"))
    except sqlite3.OperationalError:  # not made yet
        return {}
    finally:
        db.close()


def _dirs(tmp_path: Path) -> tuple[Path, Path, Path]:
    """The --data-dir both servers share, and a working folder for each."""
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    first_dir.mkdir(), second_dir.mkdir()
    return tmp_path / "data", first_dir, second_dir


def _wait_journaled(journal: Path, count: int) -> None:
    deadline = time.monotonic() + 300
    while len(journaled(journal)) < count:
        assert time.monotonic() < deadline, f"{count} requests were not journaled within 300s"
        time.sleep(0.1)


# Restarted under another --served-model-name, the same model resumes the batch (it stayed
# in_progress, never run: the batch kept the name, not the model).
@pytest.mark.parametrize("stop, served", [("kill -9", None), ("SIGTERM", "HuggingFaceTB/SmolLM2-135M-Instruct")])
def test_a_batch_resumes_after_a_restart_and_runs_only_what_was_not_journaled(tmp_path, stop, served):
    data, first_dir, second_dir = _dirs(tmp_path)
    srv = start_server(first_dir, "--data-dir", str(data))
    try:
        client = srv.openai()
        # The rows name the model as served now: resumed under another name, they still run.
        quick = [completion_line(f"q{i:02d}", f"Item {i}:", 2, model="smollm2-135m") for i in range(QUICK)]
        f = upload(client, quick + [long_line(f"long{i}", LONG_TOKENS) for i in range(LONG)])
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        journal = data / "batches" / f"{batch.id}.journal"
        _wait_journaled(journal, QUICK)
        assert strict_batch(client, batch.id).status == "in_progress"
    finally:
        if stop == "kill -9":
            srv.proc.send_signal(signal.SIGKILL)
            srv.proc.wait(STOP_TIMEOUT_S)
        else:
            assert stop_server(srv) == 0, srv.output()
    before = journaled(journal)
    total = QUICK + LONG
    assert QUICK <= len(before) < total, "the server did not stop mid-batch"

    srv = start_server(second_dir, "--data-dir", str(data), *(("--served-model-name", served) if served else ()))
    try:
        client = srv.openai()
        assert client.batches.list().data[0].id == batch.id  # the records outlived the process
        done = wait_ended(client, batch.id, timeout=600)
        # The log says how many requests the journal kept (it said "0 completed": the counts of
        # the batch's last change of state, before any request ran).
        assert f"batch {batch.id} resumes (in_progress)" in srv.output()
        assert (f"batch {batch.id}: {len(before)} requests journaled before the restart ({len(before)} completed, "
                f"0 failed) are kept, not run again") in srv.output(), srv.output()[-3000:]
        assert done.status == "completed", done
        assert done.request_counts.model_dump() == {"total": total, "completed": total, "failed": 0}
        assert done.created_at == batch.created_at and done.input_file_id == f.id
        # The engine of this process ran exactly the requests the journal lacked.
        assert srv.stats()["engine"]["finished"] == total - len(before)
        out = lines_of(client, done.output_file_id)
        assert [x["custom_id"] for x in out] == [f"q{i:02d}" for i in range(QUICK)] + [f"long{i}" for i in range(LONG)]
        assert all(len(x["response"]["body"]["choices"][0]["text"]) == LONG_TOKENS for x in out[QUICK:])
        # Every answer names the model as the batch does (resumed under another name, the rows
        # run after the restart named the new one: one output file, two names).
        assert {x["response"]["body"]["model"] for x in out} == {done.model} == {"smollm2-135m"}
        after = journaled(journal)
        assert {line: after[line] for line in before} == before  # journaled rows were kept, not redone
        assert done.error_file_id is None  # no request failed

        # One server per --data-dir: a second one exits 2 before loading the model, naming the first.
        p = subprocess.run([sys.executable, "-m", "batchprompt.server", "--port", str(free_port()), "--data-dir",
                            str(data)], capture_output=True, text=True, timeout=300)
        assert p.returncode == 2 and "is in use by another batchprompt server" in p.stderr, p.stderr
    finally:
        assert stop_server(srv) == 0, srv.output()


def test_the_requests_a_cancel_counts_as_finished_outlive_a_kill_9(tmp_path):
    """A cancel answered with the requests finished so far, some not committed yet: a kill -9
    just after it lost those, and the batch, cancelled, never ran them again (the error file
    said "cancelled before this request ran"). The cancel now commits before it answers. (The
    journal here commits only when asked, so the old code lost every one of them.)"""
    data, first_dir, second_dir = _dirs(tmp_path)
    srv = start_server(first_dir, "--data-dir", str(data), module="tests.server.faulty_server",
                       env={"RARE_COMMITS": "1"})
    try:
        client = srv.openai()
        quick = [completion_line(f"q{i}", f"Item {i}:", 2) for i in range(4)]
        f = upload(client, quick + [long_line("long0", 3000)])
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        deadline = time.monotonic() + 300
        while strict_batch(client, batch.id).request_counts.completed < 4:
            assert time.monotonic() < deadline, "the quick requests did not finish within 300s"
            time.sleep(0.1)
        answered = client.batches.cancel(batch.id)
        assert answered.status == "cancelling" and answered.request_counts.completed == 4
    finally:
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(STOP_TIMEOUT_S)
    srv = start_server(second_dir, "--data-dir", str(data))
    try:
        client = srv.openai()
        done = wait_ended(client, batch.id, timeout=300)
        assert done.status == "cancelled", done
        assert done.request_counts.model_dump() == {"total": 5, "completed": 4, "failed": 1}
        assert [x["custom_id"] for x in lines_of(client, done.output_file_id)] == [f"q{i}" for i in range(4)]
    finally:
        assert stop_server(srv) == 0, srv.output()


def _killed_after_four_of_five(tmp_path: Path):
    """A server killed (-9) once 4 quick requests of a 5-request batch are journaled (the fifth is
    long): the data dir, a working folder for the next server, the file, the batch, its journal."""
    data, first_dir, second_dir = _dirs(tmp_path)
    srv = start_server(first_dir, "--data-dir", str(data))
    try:
        client = srv.openai()
        f = upload(client, [completion_line(f"q{i}", f"Item {i}:", 2) for i in range(4)] + [long_line("long0", 3000)])
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        journal = data / "batches" / f"{batch.id}.journal"
        _wait_journaled(journal, 4)
    finally:
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(STOP_TIMEOUT_S)
    return data, second_dir, f, batch, journal


def test_a_batch_that_no_longer_validates_on_resume_fails_with_the_rows_it_had_finished(tmp_path):
    """A batch in progress whose input no longer validates when the server starts again (here
    its file was damaged on disk while the server was down) fails, naming the line. It kept the
    ids of output and error files that were never written: files.content(output_file_id)
    answered 404. Its output file now holds the requests finished before the restart, and an
    error file with nothing in it is dropped (its id null), as at any end."""
    data, second_dir, f, batch, _ = _killed_after_four_of_five(tmp_path)
    path = data / "files" / f.id
    path.write_bytes(path.read_bytes() + b"{not json\n")
    srv = start_server(second_dir, "--data-dir", str(data))
    try:
        client = srv.openai()
        done = wait_ended(client, batch.id, timeout=300)
        assert done.status == "failed" and done.failed_at is not None, done
        assert [(e.line, e.code) for e in done.errors.data] == [(6, "invalid_json")]
        assert done.output_file_id is not None and done.error_file_id is None
        assert [x["custom_id"] for x in lines_of(client, done.output_file_id)] == [f"q{i}" for i in range(4)]
        assert done.request_counts.model_dump() == {"total": 5, "completed": 4, "failed": 0}
        assert srv.stats()["engine"]["finished"] == 0  # nothing ran again
    finally:
        assert stop_server(srv) == 0, srv.output()


def test_a_batch_whose_journal_was_damaged_fails_with_no_file_ids_left_over(tmp_path):
    """A journal that is no longer SQLite when the server starts again: the batch failed, as it
    should, but kept the ids of output and error files never written (their content a 404), and
    its message said to "give another --journal", an option of `run`, not of `serve`."""
    data, second_dir, _, batch, journal = _killed_after_four_of_five(tmp_path)
    for side in (journal.with_name(journal.name + "-wal"), journal.with_name(journal.name + "-shm")):
        side.unlink(missing_ok=True)
    journal.write_bytes(b"not a database at all\n" * 100)
    srv = start_server(second_dir, "--data-dir", str(data))
    try:
        client = srv.openai()
        done = wait_ended(client, batch.id, timeout=300)
        assert done.status == "failed", done
        [error] = done.errors.data
        assert error.code == "internal_error" and "journal cannot be read" in error.message, error.message
        assert "--journal" not in error.message and "create the batch again" in error.message
        assert (done.output_file_id, done.error_file_id) == (None, None)
    finally:
        assert stop_server(srv) == 0, srv.output()


def test_an_upload_cut_off_between_its_rename_and_its_record_is_removed_at_start(tmp_path):
    """kill -9 after an upload's file was renamed into place and before it was recorded left a
    whole file (160 MB in the trial) that no call lists or deletes, restart after restart."""
    data = tmp_path / "data"
    srv = start_server(tmp_path, "--data-dir", str(data))
    try:
        kept = upload(srv.openai(), [completion_line("0", "Hi")]).id
    finally:
        stop_server(srv)
    files = data / "files"
    orphan = files / ("file-" + "ab" * 12)
    orphan.write_bytes(b'{"custom_id": "0"}\n' * 1000)
    other = files / "notes.txt"  # not a name the server makes: left alone
    other.write_text("mine")
    srv = start_server(tmp_path, "--data-dir", str(data))
    try:
        listed = [f.id for f in srv.openai().files.list()]
    finally:
        stop_server(srv)
    assert not orphan.exists() and other.exists() and (files / kept).exists()
    assert listed == [kept]
