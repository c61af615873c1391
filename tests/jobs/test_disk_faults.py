"""A full disk, in the journal or at the final write: one message, exit 3, no temp file left, and
the next run finishes the job. Outputs are fsynced (the table too) and the job is marked
complete only once they are in place."""
from __future__ import annotations

import csv
import errno
import os
import re
import subprocess
import sys
import textwrap

import pytest

from batchprompt.cli import EXIT_STORAGE, main
from batchprompt.jobs.storage import StorageError, write_atomic

from ..conftest import SPAM_SYSTEM, sms_rows
from .test_cli import _journaled, _start, parse_outputs, write_sms_batch


def _leftovers(folder) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.endswith((".tmp", ".lock"))]


def _no_space(*a):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_failed_write_removes_its_temp_file_and_keeps_the_old_output(tmp_path):
    dest = tmp_path / "out.jsonl"
    dest.write_text("old\n")

    def fill(f):
        f.write(b"x" * 65536)
        _no_space()
    with pytest.raises(StorageError) as e:
        write_atomic(dest, fill)
    assert e.value.no_space and "no space left on the device holding" in str(e.value)
    assert dest.read_text() == "old\n" and os.listdir(tmp_path) == ["out.jsonl"]


def test_two_writers_of_one_output_use_their_own_temp_files(tmp_path):
    dest = tmp_path / "out.jsonl"

    def outer(f):
        f.write(b"outer\n")
        write_atomic(dest, lambda g: g.write(b"inner\n"))  # a second writer, meanwhile
    write_atomic(dest, outer)
    assert dest.read_text() == "outer\n" and os.listdir(tmp_path) == ["out.jsonl"]


# A run whose journal may grow to 12 pages: SQLite itself answers "database or disk is full".
FULL_JOURNAL = textwrap.dedent("""
    import sqlite3, sys
    connect = sqlite3.connect
    def small(*a, **k):
        db = connect(*a, **k)
        db.execute("PRAGMA max_page_count = 12")
        return db
    sqlite3.connect = small
    from batchprompt.cli import main
    raise SystemExit(main(sys.argv[1:]))
""")


@pytest.mark.slow
def test_a_full_disk_mid_run_gives_one_message_and_the_rerun_finishes(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = write_sms_batch(inp, 160)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", FULL_JOURNAL, "run", str(inp), "-o", str(out), "--no-progress"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == EXIT_STORAGE, proc.stderr
    err = proc.stderr
    assert "Traceback" not in err and "terminate called" not in err and err.count("batchprompt: error:") == 1
    m = re.search(rf"no space left on the device holding {re.escape(str(out))}\.journal; (\d+) of 160 rows are safe "
                  rf"in the journal {re.escape(str(out))}\.journal\. Free some space, then run the same command "
                  rf"again to resume", err)
    assert m, err
    assert int(m.group(1)) == _journaled(out) < 160
    assert not out.exists() and not _leftovers(tmp_path)
    proc = _start(inp, out)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert [o["custom_id"] for o in parse_outputs(out)] == ids


@pytest.mark.slow
def test_a_full_disk_at_the_final_write_is_finished_by_the_next_run(tmp_path, monkeypatch, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    args = ["run", str(inp), "-o", str(out), "--max-tokens", "3", "--no-progress"]
    write_sms_batch(inp, 2)
    assert main(args) == 0  # an earlier job: its outputs are there
    earlier = out.read_text()
    write_sms_batch(inp, 3)
    with monkeypatch.context() as m:
        m.setattr(os, "fsync", _no_space)
        assert main(args + ["--restart"]) == EXIT_STORAGE
    err = capsys.readouterr().err
    assert err.count("batchprompt: error:") == 1
    assert f"no space left on the device holding {out}; 3 of 3 rows are safe in the journal {out}.journal" in err
    assert out.read_text() == earlier and not _leftovers(tmp_path)
    # not marked complete: the next run writes the outputs from the journal, running nothing
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "already complete" not in err and "outputs written from the journal" in err and "tok/s" not in err
    assert [o["custom_id"] for o in parse_outputs(out)] == ["sms-0", "sms-1", "sms-2"]


@pytest.mark.slow
def test_the_table_output_and_its_folder_are_fsynced(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def fsync(fd):
        st = os.fstat(fd)
        synced.append((st.st_dev, st.st_ino))
        real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    csv_in, out = tmp_path / "in.csv", tmp_path / "out.csv"
    with open(csv_in, "w", newline="") as f:
        csv.writer(f).writerows([["text"], *([t] for _, t in sms_rows(2))])
    assert main(["run", str(csv_in), "-o", str(out), "--column", "text", "--format", "table",
                 "--system", SPAM_SYSTEM, "--max-tokens", "3", "--no-progress"]) == 0
    for path in (out, tmp_path):
        st = os.stat(path)
        assert (st.st_dev, st.st_ino) in synced, path


def test_temp_files_of_a_run_killed_as_it_wrote_are_removed_by_the_next(tmp_path):
    """kill -9 between writing the output's temp file and renaming it left a whole copy of the
    output (`OUT.1a2b3c4d.tmp`) that no later run removed. The run that takes the output's lock
    removes its and its errors file's; a file of another name stays."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_sms_batch(inp, 2)
    stale = [tmp_path / "out.jsonl.1a2b3c4d.tmp", tmp_path / "out.jsonl.errors.jsonl.00ff00ff.tmp"]
    kept = [tmp_path / "out.jsonl.notours.tmp", tmp_path / "other.jsonl.1a2b3c4d.tmp"]
    for f in stale + kept:
        f.write_text("half a copy")
    assert main(["run", str(inp), "-o", str(out), "--max-tokens", "2", "--no-progress"]) == 0
    assert not any(f.exists() for f in stale) and all(f.exists() for f in kept)
    assert [o["custom_id"] for o in parse_outputs(out)] == ["sms-0", "sms-1"]
