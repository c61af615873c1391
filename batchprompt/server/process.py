"""ServerProcess: `batchprompt serve` as a child process on a loopback port, for scripts,
notebooks, benchmarks and tests that need a real server beside them.

    server = ServerProcess(["--data-dir", "/tmp/bp"], log="/tmp/bp.log")   # returns once /ready answers
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    ...
    server.stop()                                                             # SIGTERM, then SIGKILL

Bounded both ways: a server that exits, or is not ready within `ready_s`, raises ServerNotReady
with the end of its log; `stop` waits `stop_s` for a clean exit, then kills it."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import httpx

READY_S = 600.0  # loading the model on a busy 2-core machine; a broken start fails, never hangs
STOP_S = 60.0


class ServerNotReady(RuntimeError):
    """The server exited, or did not answer /ready in time; the message ends with its log."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pin_to(cpus: set[int] | None):
    """A `preexec_fn` for subprocess.Popen that keeps the child (and every thread it starts) on
    `cpus`; None for None (any CPU)."""
    return None if cpus is None else lambda: os.sched_setaffinity(0, cpus)


class ServerProcess:
    """`python -m batchprompt.server <args>` on 127.0.0.1 and a free port (or `port`), its
    output in the file `log`, environment `os.environ` with `env` over it (HF_HUB_OFFLINE=1
    unless given, and without BATCHPROMPT_API_KEY: give `api_key`). Made once GET /ready
    answers 200. `module`: what `python -m` runs (a test's wrapper of the server). `cpus`: the
    CPUs the process and all its threads may run on (None: any)."""

    def __init__(self, args: Sequence[str] = (), *, log: str | Path, api_key: str | None = None,
                 env: dict[str, str] | None = None, cwd: str | Path | None = None, port: int | None = None,
                 ready_s: float = READY_S, stop_s: float = STOP_S, module: str = "batchprompt.server",
                 cpus: set[int] | None = None):
        self.port = port or free_port()
        self.log = Path(log)
        self.api_key, self.stop_s = api_key, stop_s
        cmd = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        full_env = {"HF_HUB_OFFLINE": "1", **os.environ, **(env or {})}
        full_env.pop("BATCHPROMPT_API_KEY", None)
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=full_env, cwd=cwd,
                                         preexec_fn=pin_to(cpus))
        self._wait_ready(ready_s)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _wait_ready(self, ready_s: float) -> None:
        deadline = time.monotonic() + ready_s
        while True:
            if self.proc.poll() is not None:
                raise ServerNotReady(f"the server exited with {self.proc.returncode}:\n{self.output()[-4000:]}")
            try:
                if httpx.get(self.url + "/ready", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServerNotReady(f"the server was not ready within {ready_s:.0f}s:\n{self.output()[-4000:]}")
            time.sleep(0.5)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def output(self) -> str:
        """What the server has written so far (stdout and stderr)."""
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        """SIGTERM, then SIGKILL if it has not exited within `stop_s`; its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(self.stop_s)
        return self.proc.returncode
