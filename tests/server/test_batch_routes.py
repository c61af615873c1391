"""The batch endpoints on a real server: /v1/batch/sync, /v1/batch/async with a webhook (a
small HTTP server in the test, on 127.0.0.1), status, cancel and stats."""
from __future__ import annotations

import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from .conftest import error_of, start_server, stop_server

pytestmark = pytest.mark.slow

WAIT_S = 300  # bounded waits: a broken build fails instead of hanging


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("server"))
    yield srv
    assert stop_server(srv) == 0, srv.output()


class Receiver:
    """A webhook receiver on 127.0.0.1: answers each POST with the next of `statuses` (200 once
    they run out) and hands over (status answered, JSON body)."""

    def __init__(self, statuses=()):
        self.statuses = list(statuses)
        self.posts: queue.Queue = queue.Queue()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()
                receiver.posts.put((status, self.headers.get("X-Batchprompt-Batch-Id"), body))

            def log_message(self, *args):  # quiet
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def next_post(self):
        return self.posts.get(timeout=WAIT_S)

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture()
def receiver():
    r = Receiver([500])  # the first delivery fails: the server retries
    yield r
    r.close()


def test_sync_results_in_input_order_with_item_errors(server):
    # Prompts of growing length: each result's prompt_tokens shows which prompt it answers. A
    # null or a number (a bad cell) is its item's error: it was a 422 that refused every prompt.
    prompts = ["Hi", "Hi " * 8, [{"role": "wizard", "content": "x"}], None, "Hi " * 20, 7]
    with server.client() as c:
        r = c.post("/v1/batch/sync", json={"prompts": prompts, "system": "Be brief.", "max_tokens": 4})
    assert r.status_code == 200, r.text
    out = r.json()
    results = out["results"]
    assert [x["index"] for x in results] == [0, 1, 2, 3, 4, 5]
    assert results[2]["finish_reason"] == "error" and "unknown role 'wizard'" in results[2]["error"]
    for i, got in ((3, "NoneType: None"), (5, "int: 7")):
        assert results[i]["finish_reason"] == "error", results[i]
        assert "a prompt is a string or a list of chat messages, got " + got in results[i]["error"], results[i]
    ok = [results[i] for i in (0, 1, 4)]
    assert all(x["error"] is None and x["text"] for x in ok)
    lengths = [x["usage"]["prompt_tokens"] for x in ok]
    assert lengths == sorted(lengths) and len(set(lengths)) == 3
    assert out["progress"]["done"] == out["progress"]["total"] == 6 and out["progress"]["failed"] == 3


def test_sync_refuses_a_huge_prompt_by_its_length(server):
    # It was tokenized whole (6 prompts of 2 MB: 6.7 s of the tokenizer every request waits
    # for) before its refusal; now its length alone tells, as on the OpenAI routes.
    huge = "word " * 400_000
    with server.client() as c:
        r = c.post("/v1/batch/sync", json={"prompts": [huge, "Hi"], "max_tokens": 2})
    assert r.status_code == 200, r.text
    bad, fine = r.json()["results"]
    assert bad["finish_reason"] == "error" and "the prompt has at least " in bad["error"], bad
    assert "shorten the prompt" in bad["error"] and bad["usage"]["prompt_tokens"] == 0
    assert fine["error"] is None


def test_sync_usage_counts_only_the_prompts_that_ran(server):
    """A prompt refused for the context (tokenized first: not too long by its characters alone)
    had its tokens counted in the batch's usage, though it never ran."""
    with server.client() as c:
        r = c.post("/v1/batch/sync", json={"prompts": ["Hi " * 9000, "Hi"], "max_tokens": 2})
    assert r.status_code == 200, r.text
    out = r.json()
    bad, fine = out["results"]
    assert bad["error"] is not None and fine["error"] is None, bad
    assert out["usage"] == {"prompt_tokens": fine["usage"]["prompt_tokens"],
                            "completion_tokens": fine["usage"]["completion_tokens"]}, (out["usage"], bad["usage"])


def test_sync_takes_the_batch_apis_structured_options(server):
    with server.client() as c:
        r = c.post("/v1/batch/sync", json={"prompts": ["WIN a prize now!!!", "See you at lunch"],
                                           "choices": ["spam", "ham"], "choice_mode": "score"})
    results = r.json()["results"]
    assert [x["text"] in ("spam", "ham") for x in results] == [True, True]
    assert all(abs(sum(x["choice_probs"].values()) - 1) < 1e-6 for x in results)


@pytest.mark.parametrize("body, status, param", [
    ({"prompts": ["x"], "colour": "red"}, 400, "colour"),  # not an option of the batch API
    ({"prompts": ["x"], "max_tokens": 0}, 400, "max_tokens"),  # param was null
    ({"prompts": ["x"], "regex": "("}, 400, "regex"),
    ({"prompts": ["x"], "regex": "a", "choices": ["a"]}, 400, "regex"),  # two constraints: param was null
    ({"prompts": ["x"], "grammar": "start: \"a\"", "regex": "a"}, 400, "grammar"),
    ({"prompts": "x"}, 422, None),
    ({"prompts": ["x"], "model": "other"}, 404, None),
    ({"prompts": ["x"], "callback_url": "ftp://example.com/x"}, 400, None),
    ({"prompts": ["x"], "callback_url": "not a url"}, 400, None),
    # A 500 with a traceback (urlsplit's ValueError), or accepted and then pending for ever:
    ({"prompts": ["x"], "callback_url": "http://[::1"}, 400, "callback_url"),
    ({"prompts": ["x"], "callback_url": "http://127.0.0.1:99999/"}, 400, "callback_url"),
    ({"prompts": ["x"], "callback_url": "http://999.1.1.1/"}, 400, "callback_url"),
    ({"prompts": ["x"], "callback_url": "http://127.0.0.1:9/\u0000x"}, 400, "callback_url"),
    # Accepted (202), then failed only at delivery, after every retry:
    ({"prompts": ["x"], "callback_url": "http://exa mple.com/"}, 400, "callback_url"),
    ({"prompts": ["x"], "callback_url": "http://a_b..c/"}, 400, "callback_url"),
    ({"prompts": ["x"], "callback_url": "http://-bad-.com/"}, 400, "callback_url"),
    ({"prompts": ["x"], "callback_url": "http://127.0.0.1:0/"}, 400, "callback_url"),
    # As /v1/completions: it took 1,000 samples (29 s of engine for one 2-token prompt).
    ({"prompts": ["x"], "best_of": 1000}, 400, "best_of"),
    ({"prompts": ["x"], "callback_url": "http://127.0.0.1:9/hook", "sync": True}, 400, "callback_url"),
])
def test_batch_request_errors(server, body, status, param):
    body = dict(body)
    sync = body.pop("sync", False) or "callback_url" not in body  # a webhook is for /async: ignored on /sync
    with server.client() as c:
        r = c.post("/v1/batch/sync" if sync else "/v1/batch/async", json=body)
    assert r.status_code == status, r.text
    error = error_of(r)
    if param is not None:
        assert error["param"] == param, error


def test_sync_names_a_bad_response_format_as_json(server):
    # It said "... or a pydantic model class; got {'type': 'xml'}", a Python repr.
    with server.client() as c:
        r = c.post("/v1/batch/sync", json={"prompts": ["x"], "response_format": {"type": "xml"}})
    assert r.status_code == 400 and 'got {"type": "xml"}' in error_of(r)["message"], r.text


def test_async_batch_reports_progress_and_posts_its_results_to_the_webhook(server, receiver):
    prompts = ["Say one word.", "Name a colour.", "Count to three."]
    url = receiver.url.replace("http://", "http://hook:secret@")  # its password was shown in the status and logs
    with server.client() as c:
        r = c.post("/v1/batch/async", json={"prompts": prompts, "max_tokens": 6, "callback_url": url})
        assert r.status_code == 202, r.text
        batch_id = r.json()["batch_id"]
        status, header_id, first = receiver.next_post()
        assert status == 500  # refused once ...
        status, header_id, body = receiver.next_post()  # ... and delivered again
        assert status == 200 and header_id == batch_id
        assert body["id"] == batch_id and body["status"] == "completed"
        assert "webhook" not in body  # it said "pending": the delivery the receiver was reading
        assert [x["index"] for x in body["results"]] == [0, 1, 2]
        assert all(x["error"] is None and x["text"] for x in body["results"])
        progress = body["progress"]
        assert progress["done"] == progress["total"] == 3 and progress["failed"] == 0 and progress["eta_s"] == 0
        assert first["results"] == body["results"]
        # The receiver hands the POST over before the server has read its 200: wait (bounded)
        # until the server has recorded the delivery.
        deadline = time.monotonic() + 30
        while True:
            got = c.get(f"/v1/batch/{batch_id}").json()
            if got["webhook"]["status"] != "pending" or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert got["results"] == body["results"] and got["status"] == "completed"
    assert got["webhook"] == {"url": receiver.url.replace("http://", "http://hook:***@"), "status": "delivered",
                              "attempts": 2, "last_error": None}
    assert "secret" not in server.output()


def test_async_batch_can_be_cancelled(server):
    with server.client() as c:
        r = c.post("/v1/batch/async", json={"prompts": ["Letters:", "Letters, again:"], "max_tokens": 3000,
                                            "regex": "[ab]{3000}"})
        batch_id = r.json()["batch_id"]
        server.wait_until(lambda s: s["engine"]["running"] >= 1, "the batch reached the engine")
        assert c.get(f"/v1/batch/{batch_id}").json()["status"] == "running"
        out = c.post(f"/v1/batch/{batch_id}/cancel").json()
    assert out["status"] == "cancelled"
    assert [x["finish_reason"] for x in out["results"]] == ["cancelled", "cancelled"]
    progress = out["progress"]  # a cancelled prompt is not a failed one
    assert (progress["done"], progress["failed"], progress["cancelled"]) == (2, 0, 2)
    stats = server.wait_until(lambda s: s["engine"]["running"] == 0 and s["engine"]["waiting"] == 0,
                              "the engine dropped the cancelled batch")
    assert stats["server"]["async_batches_running"] == 0


def test_unknown_batch_is_404(server):
    with server.client() as c:
        r = c.get("/v1/batch/batch_nope")
    assert r.status_code == 404 and error_of(r)["code"] == "batch_not_found"


def test_a_batch_api_id_asked_of_the_async_route_is_pointed_to_v1_batches(server):
    # The ids look alike; it said the batch was unknown, dropped or made before a restart.
    from .batch_util import completion_line, upload, wait_ended

    client = server.openai()
    batch = client.batches.create(input_file_id=upload(client, [completion_line("a", "Hi", 1)]).id,
                                  endpoint="/v1/completions", completion_window="24h")
    with server.client() as c:
        for r in (c.get(f"/v1/batch/{batch.id}"), c.post(f"/v1/batch/{batch.id}/cancel")):
            assert r.status_code == 404 and f"GET /v1/batches/{batch.id}" in error_of(r)["message"]
    assert wait_ended(client, batch.id).status == "completed"


def test_stats(server):
    stats = server.stats()
    assert stats["model"] == "smollm2-135m"
    engine = stats["engine"]
    for key in ("running", "waiting", "finished", "prefix_cache_hit_rate", "generation_tokens_per_s",
                "kv_blocks_used", "kv_blocks_total", "kv_cache_usage"):
        assert key in engine, key
    assert engine["kv_blocks_total"] > 0 and 0 <= engine["kv_cache_usage"] <= 1


def test_a_stop_posts_each_running_async_batch_as_cancelled(tmp_path):
    """Async batches live in memory. A SIGTERM cancelled a running one without a word: its
    receiver waited forever, and after a restart the id was a 404 saying "finished and dropped".
    Now its webhook is sent once, as "cancelled" with every result, and the 404 says why."""
    receiver = Receiver([500])  # a failing receiver is not retried at a stop: the first post is the last
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    srv = start_server(tmp_path / "a")
    try:
        with srv.client() as c:
            r = c.post("/v1/batch/async", json={"prompts": ["Letters:", "Letters, again:"], "max_tokens": 3000,
                                                "regex": "[ab]{3000}", "callback_url": receiver.url})
            batch_id = r.json()["batch_id"]
            srv.wait_until(lambda s: s["engine"]["running"] >= 1, "the batch reached the engine")
        assert stop_server(srv) == 0, srv.output()
        assert receiver.posts.qsize() == 1, "the webhook was not posted exactly once"
        status, header_id, body = receiver.next_post()
        assert (status, header_id, body["id"], body["status"]) == (500, batch_id, batch_id, "cancelled")
        assert [x["finish_reason"] for x in body["results"]] == ["cancelled", "cancelled"]
        srv = start_server(tmp_path / "b", "--data-dir", str(tmp_path / "a" / "data"))
        with srv.client() as c:
            r = c.get(f"/v1/batch/{batch_id}")
        assert r.status_code == 404 and "async batches live in memory" in error_of(r)["message"], r.text
    finally:
        stop_server(srv)
        receiver.close()
