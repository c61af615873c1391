"""The journal: rows written once, kept across reopenings, refused for a changed input; ids that are
not valid text stored escaped; a full disk rolls back and keeps what was committed."""
from __future__ import annotations

import json

import pytest

from batchprompt.jobs import Journal, JournalMismatch
from batchprompt.jobs.storage import StorageError


def test_rows_survive_reopening_and_are_never_doubled(tmp_path):
    path = tmp_path / "j.sqlite"
    j = Journal(path, "fp", commit_every=2)
    j.record(3, "c", True, {"x": 3})
    j.record(1, "a", False, {"x": 1})  # commits (2 pending)
    j.record(2, "b", True, {"x": 2})  # pending only
    j.db.close()  # a crash: the pending row is lost, the committed ones stay
    j = Journal(path, "fp")
    assert j.done_lines() == {1, 3}
    j.record(3, "c", True, {"x": "again"})
    j.record(2, "b", True, {"x": 2})
    j.flush()
    assert [(line, ok) for line, ok, _ in j.records()] == [(1, False), (2, True), (3, True)]
    assert j.counts() == (2, 3)
    assert '"x": 3' in [rec for line, _, rec in j.records() if line == 3][0]  # first write kept
    j.close()


def test_a_changed_input_is_refused_unless_restarted(tmp_path):
    path = tmp_path / "j.sqlite"
    j = Journal(path, "fp1")
    j.record(1, "a", True, {})
    j.close()
    with pytest.raises(JournalMismatch, match="--restart") as e:
        Journal(path, "fp2")
    assert "or an option such as --system" in str(e.value)  # not only "the input file changed"
    j = Journal(path, "fp2", restart=True)
    assert j.done_lines() == set()
    j.close()


def test_an_id_with_a_lone_surrogate_is_stored_escaped(tmp_path):
    j = Journal(tmp_path / "j.sqlite", "fp")
    j.record(1, "b\ud800", False, {"custom_id": "b\ud800", "error": {"message": "m"}})
    j.record(2, "ok-é", True, {"custom_id": "ok-é"})
    j.flush()
    recs = {line: rec for line, _, rec in j.records()}
    assert json.loads(recs[1])["custom_id"] == "b\ud800" and "\\ud800" in recs[1]
    assert "ok-é" in recs[2]  # valid text stays readable, unescaped
    j.close()


def test_a_full_disk_rolls_back_keeps_the_committed_rows_and_says_so(tmp_path):
    path = tmp_path / "j.sqlite"
    j = Journal(path, "fp", commit_every=1)
    j.db.execute("PRAGMA max_page_count = 8")  # SQLite's own SQLITE_FULL once the file has 8 pages
    with pytest.raises(StorageError) as e:
        for i in range(1, 1000):
            j.record(i, f"r{i}", True, {"text": "x" * 1000})
    assert e.value.no_space and e.value.path == str(path)
    kept = j.counts()[1]
    assert 0 < kept < i
    j.close()  # nothing left to commit: no second error
    j = Journal(path, "fp")
    assert j.done_lines() == set(range(1, kept + 1))
    j.close()
