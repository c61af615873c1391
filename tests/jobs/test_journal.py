"""The journal: rows written once, kept across reopenings, refused for a changed input."""
from __future__ import annotations

import pytest

from batchprompt.jobs import Journal, JournalMismatch


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
    with pytest.raises(JournalMismatch, match="--restart"):
        Journal(path, "fp2")
    j = Journal(path, "fp2", restart=True)
    assert j.done_lines() == set()
    j.close()
