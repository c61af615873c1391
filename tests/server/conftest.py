"""A real server process per test module: `python -m batchprompt.server` on 127.0.0.1 and a
free port, the embedded model, waited for (bounded) through /ready, stopped at the end. Its
--data-dir is in the test's temp directory unless the test gives one."""
from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from batchprompt.server.process import ServerNotReady, ServerProcess

READY_TIMEOUT_S = 600  # loading the model on a busy 2-core machine; a broken build fails, never hangs
STOP_TIMEOUT_S = 60


class Server(ServerProcess):
    """The server process (batchprompt.server.process), with the tests' clients."""

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


def start_server(tmp_path: Path, *args: str, api_key: str | None = None, module: str = "batchprompt.server",
                 env: dict[str, str] | None = None) -> Server:
    if "--data-dir" not in args:
        args = (*args, "--data-dir", str(tmp_path / "data"))
    try:
        return Server(args, log=tmp_path / "server.log", api_key=api_key, env={"HF_HUB_OFFLINE": "1", **(env or {})},
                      ready_s=READY_TIMEOUT_S, stop_s=STOP_TIMEOUT_S, module=module)
    except ServerNotReady as e:
        pytest.fail(str(e))


def stop_server(server: Server) -> int:
    """SIGTERM, then SIGKILL if it has not exited in time; its exit status."""
    return server.stop()


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
