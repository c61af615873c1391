"""The server's API key, its unauthenticated health routes, bad options, and a clean stop:
Ctrl-C with requests in flight cancels them (503, or an error event in a stream) and exits 0."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from .conftest import LONG_COMPLETION, STOP_TIMEOUT_S, error_of, start_server, stop_server

pytestmark = pytest.mark.slow

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("server"), "--allowed-origins", "http://localhost:3000", api_key=KEY)
    yield srv
    stop_server(srv)  # the last test stops it itself


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}])
def test_v1_routes_need_the_key(server, headers):
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/v1/batch/stats"),
                         ("GET", "/v1/no-such-route")):
        r = httpx.request(method, server.url + path, headers=headers, json={}, timeout=60)
        assert r.status_code == 401, (path, r.text)
        assert error_of(r)["code"] == "invalid_api_key"
        # A key without its scheme was "incorrect", which sent its user to check the key itself.
        bearer = headers.get("Authorization", "Bearer").startswith("Bearer")
        assert ("must read Bearer <key>" in error_of(r)["message"]) != bearer, r.text


def test_the_key_opens_them(server):
    client = server.openai()
    assert [m.id for m in client.models.list().data] == ["smollm2-135m"]
    out = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=3)
    assert out.choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_refused_requests_count_under_their_route_and_carry_a_request_id(server):
    """A 401 is answered before routing: it counted under route="unmatched", so a dashboard of
    refused keys per route saw none; and no answer had OpenAI's x-request-id header."""
    r = httpx.post(server.url + "/v1/chat/completions", json={}, headers={"X-Request-Id": "mine-1"}, timeout=60)
    assert r.status_code == 401 and r.headers["x-request-id"] == "mine-1"
    r = httpx.get(server.url + "/v1/files/file-abc", timeout=60)
    assert r.status_code == 401 and len(r.headers["x-request-id"]) == 32
    text = httpx.get(server.url + "/metrics", timeout=60).text
    assert 'batchprompt_http_requests_total{method="POST",route="/v1/chat/completions",status="401"}' in text
    assert 'route="/v1/files/{file_id}",status="401"}' in text  # the template, not the id
    client = server.openai()
    page = client.models.with_raw_response.list(extra_headers={"X-Request-Id": "mine-2"})
    assert page.headers["x-request-id"] == "mine-2" and page.parse().data


def test_a_browser_page_of_an_allowed_origin_may_call_the_api(server):
    """--allowed-origins serves CORS: a preflight (which carries no key) is answered, and the
    answers name the allowed origin; another origin gets no CORS header, so its page cannot read."""
    allowed, other = {"Origin": "http://localhost:3000"}, {"Origin": "http://evil.example"}
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(server.url + "/v1/chat/completions", headers={**allowed, **preflight}, timeout=60)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    r = httpx.get(server.url + "/v1/models", headers={**allowed, "Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "x-request-id" in r.headers["access-control-expose-headers"]
    r = httpx.get(server.url + "/v1/models", headers={**other, "Authorization": f"Bearer {KEY}"}, timeout=60)
    assert "access-control-allow-origin" not in r.headers
    r = httpx.options(server.url + "/v1/chat/completions", headers={**other, **preflight}, timeout=60)
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


def test_health_ready_and_metrics_need_no_key(server):
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(server.url + path, timeout=60).status_code == 200, path


def test_bad_options_exit_2_before_loading(tmp_path):
    env = {**os.environ, "BATCHPROMPT_API_KEY": "  "}  # read when --api-key is not given
    for args, words in ((["--model", str(tmp_path / "missing.gguf")], "no such file or directory"),
                        (["--max-body-bytes", "10"], "--max-body-bytes"),
                        (["--port", "70000"], "--port"),
                        (["--kv-cache-memory", "lots"], "--kv-cache-memory 'lots' is not a memory size"),
                        (["--device", "tpu"], "--device tpu: not a device"),
                        (["--max-model-len", "1"], "--max-model-len must be >= 2"),
                        (["--allowed-origins", "localhost:3000"], "--allowed-origins takes '*' or origins"),
                        (["--api-key", ""], "--api-key (or $BATCHPROMPT_API_KEY) must not be blank"),  # no key at all
                        ([], "$BATCHPROMPT_API_KEY) must not be blank")):
        p = subprocess.run([sys.executable, "-m", "batchprompt.server", *args], capture_output=True, text=True,
                           timeout=300, env=env if not args else None)
        assert p.returncode == 2, p.stderr
        assert words in p.stderr
    # An exported but empty BATCHPROMPT_API_KEY served with no key, without a word.
    p = subprocess.run([sys.executable, "-m", "batchprompt.server"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "BATCHPROMPT_API_KEY": ""})
    assert p.returncode == 2 and "$BATCHPROMPT_API_KEY) must not be blank" in p.stderr, p.stderr


def test_a_port_in_use_exits_2_naming_it(tmp_path):
    """It loaded the model first, then uvicorn failed to bind (exit 3 and uvicorn's own error)."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "batchprompt.server", "--port", str(port), "--data-dir",
                            str(tmp_path / "data")], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in p.stderr and "another --port" in p.stderr, p.stderr
    assert "loading" not in p.stderr, p.stderr


@pytest.mark.parametrize("host", ["999.1.1.1", "192.0.2.1"])  # no address at all; no address of this machine
def test_a_host_that_is_no_address_of_this_machine_is_named_as_such(tmp_path, host):
    """--host 999.1.1.1 said "stop what holds it, or choose another --port"."""
    p = subprocess.run([sys.executable, "-m", "batchprompt.server", "--host", host, "--data-dir",
                        str(tmp_path / "data")], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    assert f"--host {host} is not an address of this machine" in p.stderr and "--port" not in p.stderr, p.stderr
    assert "without --api-key" not in p.stderr, p.stderr  # no warning about a server that never listens


def test_ctrl_c_cancels_requests_in_flight_and_exits_0(server):
    answers: dict = {}

    def plain():
        with server.client() as c:
            answers["plain"] = c.post("/v1/completions", json=LONG_COMPLETION)

    def streamed():
        with server.client() as c, c.stream("POST", "/v1/completions", json={**LONG_COMPLETION, "stream": True}) as r:
            answers["stream"] = [line for line in r.iter_lines() if line]

    threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
    for t in threads:
        t.start()
    server.wait_until(lambda s: s["engine"]["running"] >= 2, "both requests reached the engine")
    server.proc.send_signal(signal.SIGINT)
    assert server.proc.wait(STOP_TIMEOUT_S) == 0, server.output()
    for t in threads:
        t.join(STOP_TIMEOUT_S)
        assert not t.is_alive()
    assert answers["plain"].status_code == 503 and error_of(answers["plain"])["code"] == "shutting_down"
    events = answers["stream"]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "shutting_down"
    assert "Traceback" not in server.output()


def test_a_kv_cache_too_small_for_one_full_context_request_exits_2(tmp_path):
    """It started and answered every request with a 400 that blamed the client ("raise
    kv_cache_memory"); now, as vLLM does, it refuses to start and says which flags to change."""
    p = subprocess.run([sys.executable, "-m", "batchprompt.server", "--port", "0", "--kv-cache-memory", "1000",
                        "--data-dir", str(tmp_path / "data")], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    assert "the KV cache holds 4 tokens" in p.stderr and "--kv-cache-memory" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr, p.stderr


@contextlib.contextmanager
def stuck_with_a_request(tmp_path, path: str, body: dict):
    """A server whose engine's next step never returns, with `body` POSTed to `path` from a
    thread 3 s before this yields (server, answers, thread): answers["r"] once the post ends.
    (stats cannot tell when the request is in: they wait for a step's end.)"""
    stall = tmp_path / "stall"
    srv = start_server(tmp_path, module="tests.server.faulty_server", env={"STALL_FILE": str(stall)})
    try:
        stall.touch()
        answers: dict = {}

        def ask():
            with srv.client(timeout=120) as c:
                answers["r"] = c.post(path, json=body)

        t = threading.Thread(target=ask)
        t.start()
        time.sleep(3)
        yield srv, answers, t
    finally:
        stop_server(srv)


def test_sigterm_exits_while_the_engine_is_stuck_in_a_step(tmp_path):
    """It waited for the engine thread without end: a step that never returned kept a stopped
    server alive until it was killed. Now it exits (0) when its grace period is over, and the
    request in flight gets its 503."""
    with stuck_with_a_request(tmp_path, "/v1/completions", {"prompt": "Hi", "max_tokens": 4}) as (srv, answers, t):
        assert t.is_alive()
        started = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(STOP_TIMEOUT_S) == 0, srv.output()[-3000:]
        took = time.monotonic() - started
        t.join(30)
        assert not t.is_alive()
        assert answers["r"].status_code == 503, answers["r"].text
        assert "did not finish its step" in srv.output(), srv.output()[-3000:]
        assert took < 40, took


def test_a_batch_whose_session_waits_for_a_stuck_engine_is_answered_at_a_stop(tmp_path):
    """/v1/batch/sync's session waits for the engine to compute its system prompt: with the
    engine stuck, a stop waited uvicorn's 30 s for it, answered 500, and the process lived on to
    the 90 s limit (exit 1), its loop waiting for the thread that made the session."""
    body = {"prompts": ["Hi"], "system": "Be brief.", "max_tokens": 4}
    with stuck_with_a_request(tmp_path, "/v1/batch/sync", body) as (srv, answers, t):
        started = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert not t.is_alive()
        assert answers["r"].status_code == 503 and error_of(answers["r"])["code"] == "shutting_down", answers["r"].text
        assert srv.proc.wait(STOP_TIMEOUT_S) == 0, srv.output()[-3000:]
        assert time.monotonic() - started < 40 and "Traceback" not in srv.output(), srv.output()[-3000:]


def test_a_webhook_receiver_that_never_answers_holds_a_stop_for_seconds_at_most(tmp_path):
    """An async batch still running at a stop posts its "cancelled" webhook once; a receiver that
    accepted the connection and never answered held the stop for the whole webhook timeout."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        srv = start_server(tmp_path)
        try:
            with srv.client() as c:
                r = c.post("/v1/batch/async", json={"prompts": ["Letters:"] * 4, "max_tokens": 2000,
                                                    "regex": "[ab]{2000}",
                                                    "callback_url": f"http://127.0.0.1:{silent.getsockname()[1]}/"})
            assert r.status_code == 202, r.text
            srv.wait_until(lambda s: s["engine"]["running"] >= 1, "the batch reached the engine")
            started = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            assert srv.proc.wait(STOP_TIMEOUT_S) == 0, srv.output()[-3000:]
            took = time.monotonic() - started
        finally:
            stop_server(srv)
        silent.settimeout(1)
        silent.accept()[0].close()  # the webhook did come
    assert took < 9, took  # the cancel, then the post's 3 s at most (it waited its whole timeout, 10 s)


def test_a_stop_cuts_requests_whose_body_is_still_coming_with_a_503_at_once(tmp_path):
    """A client still sending its body (a slow upload) held the stop for uvicorn's graceful
    timeout (30 s), then got a text/plain 500, and the log a CancelledError traceback. Now it gets
    the 503 `shutting_down` in OpenAI's shape within a second or two, and the exit is prompt."""
    import socket

    srv = start_server(tmp_path)
    socks = []
    try:
        host, port = srv.url.removeprefix("http://").split(":")
        boundary = "xyzzy"
        upload_head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
                       f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.jsonl\"\r\n"
                       f"Content-Type: application/jsonl\r\n\r\n")
        for path, ctype, start in (("/v1/files", f"multipart/form-data; boundary={boundary}", upload_head),
                                   ("/v1/chat/completions", "application/json", '{"messages": [')):
            sock = socket.create_connection((host, int(port)), timeout=30)
            sock.sendall((f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {ctype}\r\n"
                          f"Content-Length: 100000\r\n\r\n{start}").encode())
            socks.append(sock)
        # A third sends its body steadily, a little every 0.2 s (never blocked for long): it was not cut
        steady = socket.create_connection((host, int(port)), timeout=30)
        steady.sendall((f"POST /v1/files HTTP/1.1\r\nHost: {host}\r\nContent-Type: multipart/form-data; "
                        f"boundary={boundary}\r\nContent-Length: 10000000\r\n\r\n{upload_head}").encode())
        socks.append(steady)
        sending = threading.Event()

        def drip():
            with contextlib.suppress(OSError):
                while not sending.wait(0.2):
                    steady.sendall(b'{"prompt": "x"}\n' * 20)

        threading.Thread(target=drip, daemon=True).start()
        time.sleep(1.0)  # the server is reading the three bodies
        started = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        answers = []
        for sock in socks:
            data = b""
            while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < 20:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
            answers.append(data.decode(errors="replace"))
        took = time.monotonic() - started
        sending.set()
        assert srv.proc.wait(STOP_TIMEOUT_S) == 0, srv.output()[-3000:]
        exited = time.monotonic() - started
    finally:
        for sock in socks:
            sock.close()
        stop_server(srv)
    for answer in answers:
        assert answer.startswith("HTTP/1.1 503"), answer[:300]
        assert json.loads(answer.split("\r\n\r\n", 1)[1])["error"]["code"] == "shutting_down", answer
    assert took < 10 and exited < 20, (took, exited)  # it was 30 s, then a 500
    assert "Traceback" not in srv.output() and "CancelledError" not in srv.output(), srv.output()[-3000:]
    # The log's lines carry the time, batchprompt's and uvicorn's (when the stop came could not be told)
    stamp = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d "
    for line in (r"batchprompt: INFO: loading ", r"INFO: +Shutting down", r"INFO: +127\.0\.0\.1:\d+ - \"GET /ready"):
        assert re.search(stamp + line, srv.output(), re.MULTILINE), (line, srv.output()[-3000:])


def test_a_stop_cuts_a_download_to_a_client_that_does_not_read(tmp_path):
    """A client reading a file's content slowly (here: not at all) held the stop for 30 s, and
    the log got a CancelledError traceback: its answer is now cut where it is."""
    import socket

    srv = start_server(tmp_path)
    try:
        line = json.dumps({"custom_id": "x" * 2000, "method": "POST", "url": "/v1/chat/completions",
                           "body": {"messages": [{"role": "user", "content": "hi"}]}})
        with srv.client() as c:
            r = c.post("/v1/files", data={"purpose": "batch"},
                       files={"file": ("big.jsonl", ("\n".join([line] * 12_000) + "\n").encode())})
        assert r.status_code == 200, r.text
        host, port = srv.url.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)), timeout=30)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(f"GET /v1/files/{r.json()['id']}/content HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        sock.recv(1024)  # the answer has begun; nothing more is read
        time.sleep(1.0)
        started = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(STOP_TIMEOUT_S) == 0, srv.output()[-3000:]
        exited = time.monotonic() - started
        sock.close()
    finally:
        stop_server(srv)
    assert exited < 20, exited  # 30 s and more
    assert "Traceback" not in srv.output() and "CancelledError" not in srv.output(), srv.output()[-3000:]
    assert "ASGI callable returned without completing" not in srv.output()  # the cut is meant: no error line


def test_a_second_ctrl_c_answers_the_requests_in_flight_at_once(tmp_path):
    """uvicorn's force quit, which a second Ctrl-C was, cut the requests still waiting off with a
    500 (text/plain) and logged CancelledError tracebacks. Now they are answered 503 in OpenAI's
    shape at once, without waiting for the engine's step (stuck here), and the exit is 130."""
    body = {"prompt": ["Hi", "Hello"], "max_tokens": 4}
    with stuck_with_a_request(tmp_path, "/v1/completions", body) as (srv, answers, t):
        srv.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        started = time.monotonic()
        srv.proc.send_signal(signal.SIGINT)
        t.join(30)
        assert not t.is_alive()
        assert time.monotonic() - started < 4  # the first Ctrl-C alone waits CANCEL_GRACE_S (5 s)
        assert answers["r"].status_code == 503 and error_of(answers["r"])["code"] == "shutting_down", answers["r"].text
        assert srv.proc.wait(STOP_TIMEOUT_S) == 130, srv.output()[-3000:]
        assert "Traceback" not in srv.output() and "second Ctrl-C" in srv.output(), srv.output()[-3000:]


def test_a_second_ctrl_c_while_the_engine_stops_is_one_line_and_exit_130(monkeypatch, caplog):
    """A second Ctrl-C that came while the server waited for its engine to stop (uvicorn's
    signal handlers are gone by then) printed a KeyboardInterrupt traceback."""
    import logging

    import batchprompt.api as api
    from batchprompt.server import command

    def interrupted(model_key, timeout=None):
        raise KeyboardInterrupt  # as the signal lands in the engine thread's join

    monkeypatch.setattr(api, "shutdown", interrupted)
    with caplog.at_level(logging.WARNING, logger="batchprompt"):
        assert command._stop_engine(("model",), logging.getLogger("batchprompt")) is True
    assert "stopped at once by another Ctrl-C" in caplog.text
