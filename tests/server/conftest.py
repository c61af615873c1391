"""A real server process per test module: `python -m batchprompt.server` on 127.0.0.1 and a
free port, the embedded model, waited for (bounded) through /ready, stopped at the end. Its
--data-dir is in the test's temp directory unless the test gives one."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

READY_TIMEOUT_S = 600  # loading the model on a busy 2-core machine; a broken build fails, never hangs
STOP_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: Path
    api_key: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kwargs) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=kwargs.pop("timeout", 300), **kwargs)

    def openai(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0,
                             timeout=kwargs.pop("timeout", 300), **kwargs)

    def stats(self) -> dict:
        with self.client() as c:
            r = c.get("/v1/batch/stats")
            assert r.status_code == 200, r.text
            return r.json()

    def wait_until(self, condition, what: str, timeout: float = 120, interval: float = 0.1) -> dict:
        """Poll /v1/batch/stats until `condition(stats)`; fail after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if condition(stats):
                return stats
            assert time.monotonic() < deadline, f"{what}: not within {timeout}s; last stats {json.dumps(stats)}"
            time.sleep(interval)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def start_server(tmp_path: Path, *args: str, api_key: str | None = None) -> Server:
    port = free_port()
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "batchprompt.server", "--port", str(port), "--host", "127.0.0.1", *args]
    if "--data-dir" not in args:
        cmd += ["--data-dir", str(tmp_path / "data")]
    if api_key:
        cmd += ["--api-key", api_key]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("BATCHPROMPT_API_KEY", None)
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, port, log, api_key)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{server.output()}"
        try:
            if httpx.get(server.url + "/ready", timeout=5).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_server(server)
            pytest.fail(f"the server was not ready within {READY_TIMEOUT_S}s:\n{server.output()}")
        time.sleep(0.5)


def stop_server(server: Server) -> int:
    """SIGTERM, then SIGKILL if it has not exited in time; its exit status."""
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(STOP_TIMEOUT_S)
    return server.proc.returncode


#: A request that runs until it is cancelled: 3000 tokens, each one of two letters (the grammar
#: allows no end before that, and no jump-forward), far more than any test waits for.
LONG_COMPLETION = {"prompt": "Letters:", "max_tokens": 3000, "structured_outputs": {"regex": "[ab]{3000}"}}


def error_of(response: httpx.Response) -> dict:
    """The OpenAI-shaped error of a response, checked for its keys."""
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"], body
    return body["error"]
