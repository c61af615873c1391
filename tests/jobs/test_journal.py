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


def test_a_read_sees_the_rows_not_yet_committed(tmp_path):
    # A batch whose every request failed its check read done_lines before the rows were
    # committed, took them as not run, and never ended.
    j = Journal(tmp_path / "j.sqlite", "fp", commit_every=64, commit_seconds=3600)
    j.record(1, "a", False, {"x": 1})
    j.record(2, "b", True, {"x": 2}, 5, 3)
    assert j.done_lines() == {1, 2}
    j.record(3, "c", True, {"x": 3}, 1, 1)
    assert j.counts() == (2, 3)
    j.record(4, "d", True, {"x": 4}, 1, 1)
    assert j.token_counts() == (7, 5)
    j.record(5, "e", False, {"x": 5})
    assert [line for line, _, _ in j.records()] == [1, 2, 3, 4, 5]
    j.close()


def test_pending_rows_are_committed_once_due_without_another_row(tmp_path, monkeypatch):
    """flush_due commits what waits once the last commit is commit_seconds old, not before."""
    clock = [100.0]
    monkeypatch.setattr("batchprompt.jobs.journal.time.monotonic", lambda: clock[0])
    path = tmp_path / "j.sqlite"
    j = Journal(path, "fp", commit_every=64, commit_seconds=0.5)
    j.flush()  # the last commit is now
    j.record(1, "a", True, {})
    j.flush_due()
    reader = Journal(path, "fp")
    assert reader.done_lines() == set()  # pending: due at 100.5
    clock[0] = 100.6
    j.flush_due()
    assert reader.done_lines() == {1}
    reader.close()
    j.close()


def test_a_changed_input_is_refused_unless_restarted(tmp_path):
    path = tmp_path / "j.sqlite"
    j = Journal(path, "fp1")
    j.record(1, "a", True, {})
    j.close()
    with pytest.raises(JournalMismatch, match="--restart") as e:
        Journal(path, "fp2")
    assert "or an option such as --model, --system" in str(e.value)  # not only "the input file changed"
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


def test_a_job_keeps_its_id_across_resumes_and_scopes_its_lines_ids(tmp_path):
    """Output ids are unique per job, as OpenAI's are per request (they were a hash of custom_id
    and line only: the same in every job over the same file), and stable within one job."""
    from batchprompt.jobs import openai_io

    a = Journal(tmp_path / "a.sqlite", "fp")
    job_a = a.job_id
    a.close()
    a = Journal(tmp_path / "a.sqlite", "fp")
    assert a.job_id == job_a  # a resume writes what the first run would have
    b = Journal(tmp_path / "b.sqlite", "fp")
    assert b.job_id != job_a
    line = lambda job: openai_io.error_line(1, "r0", "request_failed", "m", job)  # noqa: E731
    assert line(a.job_id)["id"] == line(job_a)["id"] != line(b.job_id)["id"]
    restarted = Journal(tmp_path / "b.sqlite", "fp", restart=True)
    assert restarted.job_id != b.job_id
    given = Journal(tmp_path / "c.sqlite", "fp", job_id="batch_abc")  # the server's: its batch id
    assert given.job_id == "batch_abc" and given.get("job_id") == "batch_abc"
    for j in (a, b, restarted, given):
        j.close()


def test_an_empty_journal_of_other_options_is_taken_over_one_with_rows_is_not(tmp_path):
    """A run stopped before any row (a bad --max-model-len found as the model loaded) left a
    journal that refused the corrected command ("belongs to ... different options"): it held
    nothing to lose. One with a row still refuses."""
    path = tmp_path / "j.sqlite"
    j = Journal(path, "fp1")
    first_id = j.job_id
    j.close()
    j = Journal(path, "fp2")  # other options: taken over, as a new job
    assert j.get("fingerprint") == "fp2" and j.job_id != first_id
    j.record(1, "a", False, {})
    j.close()
    with pytest.raises(JournalMismatch):
        Journal(path, "fp1")


def test_a_file_that_is_not_a_journal_is_refused_not_written_into(tmp_path):
    """A text file gave a sqlite3.DatabaseError traceback; another program's database got the
    journal's tables added to it; a journal whose meta table was lost was taken for any job."""
    import sqlite3

    text = tmp_path / "notes.jsonl.journal"
    text.write_text("my notes\n")
    with pytest.raises(JournalMismatch, match=r"notes.jsonl.journal is not a batchprompt journal \(file is not a "
                                              r"database\): give another --journal"):
        Journal(text, "fp")
    assert text.read_text() == "my notes\n"
    theirs = tmp_path / "theirs.sqlite"
    with sqlite3.connect(theirs) as db:
        db.execute("CREATE TABLE customers (name TEXT)")
    db.close()
    with pytest.raises(JournalMismatch, match=r"is a database with other tables \(customers\), not a batchprompt "
                                              r"journal"):
        Journal(theirs, "fp")
    with sqlite3.connect(theirs) as db:
        assert [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")] == ["customers"]
    db.close()
    damaged = tmp_path / "damaged.journal"
    j = Journal(damaged, "job-a")
    j.record(1, "a", True, {"x": 1})
    j.close()
    with sqlite3.connect(damaged) as db:
        db.execute("DROP TABLE meta")
    db.close()
    with pytest.raises(JournalMismatch, match="holds rows but no record of the job they belong to"):
        Journal(damaged, "job-b")
    assert Journal(damaged, "job-b", restart=True).empty()


def test_a_default_no_row_takes_does_not_change_the_jobs_fingerprint(tmp_path):
    """--max-tokens blocked a resume ("changed since the job began") where every row sets its own
    max_tokens, though the option changed no answer; likewise --temperature, and --seed where
    each row sets its own or runs greedy. A default some row takes still counts."""
    from batchprompt.jobs.rows import read_input
    from batchprompt.jobs.run import JobOptions, fingerprint

    def rows(*bodies):
        inp = tmp_path / "in.jsonl"
        inp.write_text("".join(json.dumps({"custom_id": str(i), "method": "POST", "url": "/v1/completions",
                                           "body": {"prompt": "hi", **b}}) + "\n" for i, b in enumerate(bodies))
                       + "this line is not JSON\n")
        return read_input(str(inp), None)

    def fp(table, **opts):
        return fingerprint(table.raw, JobOptions("in", "out", **opts), table.rows)[0]

    own = rows({"max_tokens": 3, "temperature": 0.7, "seed": 1}, {"max_completion_tokens": 4, "temperature": 0})
    assert fp(own, max_tokens=10) == fp(own, max_tokens=20)
    assert fp(own, temperature=0.0) == fp(own, temperature=0.9)
    assert fp(own, seed=1) == fp(own, seed=2)
    assert fp(own) != fp(own, model="other")

    some = rows({"max_tokens": 3}, {"temperature": 0.5})  # the first row takes --temperature, the second --max-tokens
    assert fp(some, max_tokens=10) != fp(some, max_tokens=20)
    assert fp(some, temperature=0.0) != fp(some, temperature=0.9)
    assert fp(some, seed=1) != fp(some, seed=2)  # the second row samples, with the job's seed
    greedy = rows({"max_tokens": 3}, {"max_tokens": 3, "temperature": 0})
    assert fp(greedy, seed=1) == fp(greedy, seed=2)
    assert fp(greedy, seed=1, temperature=0.5) != fp(greedy, seed=2, temperature=0.5)


def test_a_system_prompt_no_row_takes_does_not_change_the_jobs_fingerprint(tmp_path):
    """--system blocked a resume of a finished job whose every row begins with its own system
    message (the option changed no answer), as --max-tokens did before it joined the rule."""
    from batchprompt.jobs.rows import read_input
    from batchprompt.jobs.run import JobOptions, fingerprint

    def rows(*messages, url="/v1/chat/completions"):
        inp = tmp_path / "in.jsonl"
        key = "messages" if url.endswith("chat/completions") else "prompt"
        inp.write_text("".join(json.dumps({"custom_id": str(i), "method": "POST", "url": url, "body": {key: m}})
                               + "\n" for i, m in enumerate(messages)))
        return read_input(str(inp), None)

    def fp(table, **opts):
        return fingerprint(table.raw, JobOptions("in", "out", **opts), table.rows)

    sys_msg = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}]
    dev_msg = [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "yo"}]
    own = rows(sys_msg, dev_msg)
    assert fp(own, system="hi")[0] == fp(own, system="bye")[0] == fp(own)[0]
    # A journal of this job begun by the version that counted --system is still this job's.
    assert fp(own, system="hi")[2][1] != fp(own)[0] and fp(own, system="hi")[2][1] != fp(own, system="bye")[2][1]
    completions = rows("hi", "yo", url="/v1/completions")
    assert fp(completions, system="hi")[0] == fp(completions, system="bye")[0]
    some = rows(sys_msg, [{"role": "user", "content": "no system"}])
    assert fp(some, system="hi")[0] != fp(some, system="bye")[0]


def test_a_journal_begun_under_the_older_fingerprint_is_taken_over(tmp_path):
    """A job begun by a batchprompt that counted every option resumes under the new fingerprint
    (given as `legacy`), its rows kept; a journal of another job is still refused."""
    path = tmp_path / "j.sqlite"
    j = Journal(path, "old")
    j.record(1, "a", True, {"x": 1})
    j.close()
    j = Journal(path, "new", legacy="old")
    assert j.done_lines() == {1} and j.get("fingerprint") == "new"
    j.close()
    assert Journal(path, "new", legacy="unrelated").done_lines() == {1}
    with pytest.raises(JournalMismatch):
        Journal(path, "other", legacy="old")
    assert Journal(path, "newer", legacy=("older", "new")).done_lines() == {1}  # any of several


def test_a_json_schema_with_its_properties_reordered_is_another_job(tmp_path):
    """The answers keep a schema's property order, but the fingerprint sorted its keys: a job
    rerun with the properties reordered said "already complete" and kept the old order. A journal
    begun under the sorted fingerprint (earlier versions) still resumes."""
    from batchprompt.jobs.rows import read_input
    from batchprompt.jobs.run import JobOptions, fingerprint

    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    table = read_input(str(tmp_path / "in.jsonl"))
    ab = {"type": "object", "properties": {"a": {"enum": ["x"]}, "b": {"enum": ["y"]}}, "required": ["a", "b"]}
    ba = {"type": "object", "properties": {"b": {"enum": ["y"]}, "a": {"enum": ["x"]}}, "required": ["a", "b"]}

    def fp(schema):
        return fingerprint(table.raw, JobOptions("in", "out", structured={"json_schema": schema}), table.rows)

    (first, _, first_legacy), (second, _, second_legacy) = fp(ab), fp(ba)
    assert first != second and second not in first_legacy
    assert first_legacy[-1] == second_legacy[-1]  # the sorted form: what an earlier version's journal holds
    path = tmp_path / "j.sqlite"
    j = Journal(path, first_legacy[-1])  # begun by an earlier version
    j.record(1, "line-1", True, {"x": 1})
    j.close()
    assert Journal(path, first, legacy=first_legacy).done_lines() == {1}
    with pytest.raises(JournalMismatch):
        Journal(path, second, legacy=second_legacy)
