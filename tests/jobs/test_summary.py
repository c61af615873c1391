"""The job summary says what happened in this run."""
from batchprompt.jobs.run import JobSummary


def test_an_interrupted_run_that_finished_nothing_does_not_claim_written_outputs():
    # Stopped (SIGTERM, Ctrl-C) before any row finished: no output file was written.
    text = str(JobSummary(rows=60, interrupted=True, interrupted_by=15))
    assert "outputs written" not in text
    assert "nothing finished in this run" in text


def test_a_complete_rerun_says_its_outputs_come_from_the_journal():
    text = str(JobSummary(rows=60, ok=60, resumed=60))
    assert "outputs written from the journal" in text


def test_notes_follow_the_headline():
    text = str(JobSummary(rows=2, ok=2, run_rows=2, run_completion_tokens=10, seconds=1.0,
                          notes=["ignored unknown body fields: foo (1 row)"]))
    assert text.splitlines()[1] == "ignored unknown body fields: foo (1 row)"
    assert "10 tok/s" in text.splitlines()[0]


def test_a_dry_run_does_not_call_rows_too_long_unreadable():
    # A row refused for its length was counted as "unreadable".
    text = str(JobSummary(rows=3, failed=1, prompt_tokens=40, estimate_seconds=2.0))
    assert text.startswith("dry run: 3 rows (1 that cannot run), 40 prompt tokens")


def test_an_interrupted_run_says_how_many_rows_did_not_run_yet():
    # It read "80 rows: 16 ok, 0 failed", as if the job were over.
    text = str(JobSummary(rows=80, ok=15, failed=1, run_rows=16, run_completion_tokens=80, seconds=2.0,
                          interrupted=True, interrupted_by=2))
    assert text.startswith("80 rows: 15 ok, 1 failed, 64 not run yet (run the same command again to resume)")
    assert "not run yet" not in str(JobSummary(rows=80, ok=79, failed=1, run_rows=80, seconds=2.0))


def test_a_first_run_that_computed_nothing_does_not_speak_of_a_journal():
    # Every row failed as it was read: it said "outputs written from the journal", as of a resume.
    text = str(JobSummary(rows=2, failed=2))
    assert text.endswith("; no row reached the model") and "journal" not in text
    assert str(JobSummary(rows=2, ok=2, resumed=2)).endswith("; outputs written from the journal")
    # Rows refused as the resume read them are not "this run"'s computed rows: it read "this run 48 rows".
    text = str(JobSummary(rows=300, ok=147, failed=153, resumed=99, run_rows=48, run_completion_tokens=96, seconds=2))
    assert "; this run computed 48 rows, 96 generated tokens in 2.0s" in text
