"""Chat requests go ahead of the server's bulk work (Batch API rows, async batches), on a real
server whose engine runs two sequences at once (--max-num-seqs 2): two long bulk rows fill
both, and a chat request still gets a sequence at once (a bulk row is preempted for it, and
resumes after), or runs inside the rows' step when that step is long (a slow CPU, a busy
machine: the engine pauses between layers for it), instead of waiting for a row's 3000 tokens."""
from __future__ import annotations

import subprocess
import sys

import pytest

from .batch_util import long_line, upload, wait_ended, wait_for
from .conftest import start_server, stop_server

pytestmark = pytest.mark.slow

CHAT_TIMEOUT_S = 120  # first come, the chat would wait for a 3000-token row: minutes on 2 cores


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("server"), "--max-num-seqs", "2")
    yield srv
    assert stop_server(srv) == 0, srv.output()


def chat(server) -> str:
    client = server.openai(timeout=CHAT_TIMEOUT_S)
    out = client.chat.completions.create(model="smollm2-135m", max_tokens=4, temperature=0,
                                         messages=[{"role": "user", "content": "Say hello."}])
    assert out.choices[0].finish_reason in ("stop", "length")
    return out.choices[0].message.content


def both_running(server) -> tuple[int, int]:
    stats = server.wait_until(lambda s: s["engine"]["running"] == 2, "both bulk rows run")
    return went_ahead(stats)


def went_ahead(stats: dict) -> tuple[int, int]:
    """The two ways a chat goes ahead of running rows: a row preempted for it, or a step of its
    own inside theirs."""
    return stats["engine"]["preemptions"], stats["engine"]["inside_steps"]


def made_room(before: tuple[int, int], after: tuple[int, int]) -> bool:
    return after[0] > before[0] or after[1] > before[1]


def test_a_chat_request_goes_ahead_of_an_async_batch(server):
    with server.client() as c:
        r = c.post("/v1/batch/async", json={"prompts": ["Letters:", "Letters, again:"], "max_tokens": 3000,
                                            "regex": "[ab]{3000}"})
        assert r.status_code == 202, r.text
        batch_id = r.json()["batch_id"]
        before = both_running(server)
        assert chat(server)
        progress = c.get(f"/v1/batch/{batch_id}").json()["progress"]
        assert progress["done"] == 0  # the batch's rows were still running
        assert made_room(before, went_ahead(server.stats()))  # a row made room for the chat, or a pause did
        assert c.post(f"/v1/batch/{batch_id}/cancel").json()["status"] == "cancelled"
    server.wait_until(lambda s: s["engine"]["running"] == 0 and s["engine"]["waiting"] == 0,
                      "the engine dropped the cancelled batch")


def test_a_chat_request_goes_ahead_of_batch_api_rows(server):
    client = server.openai()
    f = upload(client, [long_line("long1"), long_line("long2")])
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    before = both_running(server)
    assert chat(server)
    batch = wait_for(client, batch.id, lambda b: True, "the batch")
    assert batch.status == "in_progress" and batch.request_counts.completed == 0
    assert made_room(before, went_ahead(server.stats()))
    client.batches.cancel(batch.id)
    assert wait_ended(client, batch.id).status == "cancelled"


@pytest.mark.parametrize("value", ["1", "0.5", "fast"])
def test_a_bad_priority_slowdown_exits_2_before_loading(value):
    p = subprocess.run([sys.executable, "-m", "batchprompt.server", "--priority-slowdown", value],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    assert f"--priority-slowdown must be a number above 1 (e.g. 2) or 'off', got '{value}'" in p.stderr
