"""The benchmarks' server (bench_server, bench_priority, bench_pool): batchprompt's
ServerProcess with its data under `tmp/name`, its log in `tmp/name.log`, quiet logging, the
checkout's code, and its memory."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from common import ROOT

from batchprompt.server.process import ServerProcess as _ServerProcess


class ServerProcess(_ServerProcess):
    """A server ready when made (ServerNotReady, a RuntimeError, with the log's end if it exits
    or is not ready in time)."""

    def __init__(self, tmp: Path, name: str = "server", flags: Sequence[str] = (), env: dict | None = None,
                 cpus: set[int] | None = None):
        self.name = name
        super().__init__(["--data-dir", str(tmp / name), "--log-level", "warning", *flags], log=tmp / f"{name}.log",
                         env={"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), **(env or {})}, cwd=ROOT, cpus=cpus)

    def rss_mib(self) -> float:
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss / 2**20
