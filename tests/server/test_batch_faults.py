"""Batches under faults injected into a real server process (tests/server/faulty_server.py):
one that a bug ends mid-run fails with the reason and keeps what finished; one whose window
runs out after all its requests ran is completed."""
from __future__ import annotations

from .batch_util import completion_line, lines_of, upload, wait_ended
from .conftest import start_server, stop_server

ROWS, FAIL_AT = 12, 6


def test_a_batch_failing_mid_run_keeps_its_finished_requests_in_its_output(tmp_path):
    # The output file of such a batch was never written: its content was a 404 saying the file
    # had been "removed by hand", and the requests that had finished could not be read.
    server = start_server(tmp_path, module="tests.server.faulty_server", env={"FAIL_AT_ROW": str(FAIL_AT)})
    try:
        client = server.openai()
        f = upload(client, [completion_line(f"r{i}", f"Count to {i}:") for i in range(ROWS)])
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        batch = wait_ended(client, batch.id)
        assert batch.status == "failed"
        assert [(e.code, "injected fault" in e.message) for e in batch.errors.data] == [("internal_error", True)]
        kept = lines_of(client, batch.output_file_id)
        assert len(kept) == FAIL_AT - 1 == batch.request_counts.completed
        assert {x["custom_id"] for x in kept} < {f"r{i}" for i in range(ROWS)}
        assert all(x["response"]["status_code"] == 200 and x["response"]["body"]["choices"][0]["text"] for x in kept)
        assert batch.error_file_id is None  # no request failed
        # the server goes on
        assert client.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=2).choices[0].text
    finally:
        assert stop_server(server) == 0, server.output()


def test_a_batch_whose_window_ends_after_all_its_requests_ran_is_completed(tmp_path):
    # It ended 'expired' (with every request in its output and none in its error file): the
    # expiry came between the last request and the writing of the outputs.
    server = start_server(tmp_path, module="tests.server.faulty_server", env={"HOLD_AFTER_COMPUTE": "1"})
    try:
        client = server.openai()
        f = upload(client, [completion_line(f"r{i}", f"Count to {i}:", max_tokens=2) for i in range(2)])
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="20s")
        batch = wait_ended(client, batch.id)
        assert (batch.status, batch.request_counts.completed, batch.request_counts.failed) == ("completed", 2, 0)
        assert batch.completed_at is not None and batch.expired_at is None
        assert [x["custom_id"] for x in lines_of(client, batch.output_file_id)] == ["r0", "r1"]
        assert batch.error_file_id is None  # no request failed
    finally:
        assert stop_server(server) == 0, server.output()


def test_files_expire_as_expires_after_and_output_expires_after_ask(tmp_path):
    """Both were taken and ignored: expires_at stayed null and nothing was ever deleted. (The
    sweep here sees the time two hours ahead, so an hour's expiry has come.)"""
    import time

    import openai
    import pytest

    from .batch_util import jsonl

    server = start_server(tmp_path, module="tests.server.faulty_server", env={"SWEEP_AHEAD_S": "7200"})
    try:
        client = server.openai()
        lines = jsonl([completion_line(f"r{i}", f"Count to {i}:", max_tokens=2) for i in range(2)])
        kept = client.files.create(file=("kept.jsonl", lines), purpose="batch")
        assert kept.expires_at is None
        hour = {"anchor": "created_at", "seconds": 3600}
        brief = client.files.create(file=("brief.jsonl", lines), purpose="batch", expires_after=hour)
        assert brief.expires_at == brief.created_at + 3600
        for bad in ({"anchor": "created_at", "seconds": 10}, {"anchor": "last_active_at", "seconds": 3600}):
            with pytest.raises(openai.BadRequestError, match="expires_after"):
                client.files.create(file=("x.jsonl", lines), purpose="batch", expires_after=bad)
            with pytest.raises(openai.BadRequestError, match="output_expires_after"):
                client.batches.create(input_file_id=kept.id, endpoint="/v1/completions", completion_window="24h",
                                      output_expires_after=bad)
        # Another shape of the form field was taken and ignored: the file never expired.
        with server.client() as c:
            for field in ({"expires_after": '{"anchor": "created_at", "seconds": 3600}'}, {"expires_after[x]": "1"}):
                r = c.post("/v1/files", data={"purpose": "batch", **field}, files={"file": ("a.jsonl", lines)})
                assert r.status_code == 400 and "expires_after[anchor]=created_at" in r.text, r.text
        batch = client.batches.create(input_file_id=kept.id, endpoint="/v1/completions", completion_window="24h",
                                      output_expires_after=hour)
        batch = wait_ended(client, batch.id)
        assert batch.status == "completed" and batch.output_file_id
        deadline = time.monotonic() + 30
        gone = set()
        while gone != {brief.id, batch.output_file_id}:
            assert time.monotonic() < deadline, f"not deleted within 30s: {gone}"
            for file_id in {brief.id, batch.output_file_id} - gone:
                try:
                    client.files.retrieve(file_id)
                except openai.NotFoundError:
                    gone.add(file_id)
            time.sleep(0.2)
        assert client.files.retrieve(kept.id).expires_at is None  # no expiry asked: kept
        assert f"file {brief.id} expired" in server.output()
    finally:
        assert stop_server(server) == 0, server.output()
