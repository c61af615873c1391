"""A batchprompt server as a subprocess on a loopback port, for the benchmarks that measure one
(bench_server, bench_priority, bench_pool): started and waited for until GET /ready answers,
stopped with SIGTERM (then SIGKILL), its log in a file."""
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

from common import ROOT

READY_S, STOP_S = 600, 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m batchprompt.server` on 127.0.0.1 with its data under `tmp/name`, its output in
    `tmp/name.log`; ready when made (RuntimeError with the log's end if it exits or is not
    ready within READY_S)."""

    def __init__(self, tmp: Path, name: str = "server", flags: Sequence[str] = (), env: dict | None = None):
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"{name}.log"
        cmd = [sys.executable, "-m", "batchprompt.server", "--host", "127.0.0.1", "--port", str(self.port),
               "--data-dir", str(tmp / name), "--log-level", "warning", *flags]
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), **(env or {})}
        full_env.pop("BATCHPROMPT_API_KEY", None)
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT)
        deadline = time.monotonic() + READY_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {name} exited with {self.proc.returncode}:\n"
                                   f"{self.log.read_text()[-4000:]}")
            try:
                if httpx.get(self.url + "/ready", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server {name} was not ready within {READY_S}s")
            time.sleep(0.5)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss_mib(self) -> float:
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss / 2**20

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after STOP_S; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_S)
        return self.proc.returncode
