"""`python -m tests.server.faulty_server ARGS`: the server with a fault of a test's choosing,
set by environment variables, so a test can see what a batch does then:
- FAIL_AT_ROW=N: the batch journal raises a RuntimeError (a bug's stand-in) when it is asked to
  record its N-th request;
- HOLD_AFTER_COMPUTE=1: a batch whose requests have all run waits until a second after its
  completion window ended before it writes its outputs (a slow machine's stand-in);
- STALL_FILE=PATH: once PATH exists, the engine's next step never returns (a kernel that hangs,
  or a step far longer than any wait, stands in);
- SWEEP_AHEAD_S=N: the sweep of expired files runs every 0.2 s, and sees the time N seconds
  ahead (files made to expire in an hour are expired to it);
- RARE_COMMITS=1: a batch journal commits only when asked to (not every half second nor every
  64 rows), so that what a kill -9 finds uncommitted is a test's choice."""
import asyncio
import os
import time

from pathlib import Path

from batchprompt.engine.engine import LLMEngine
from batchprompt.jobs.journal import Journal
from batchprompt.server.batch_job import BatchJob
from batchprompt.server.command import main

FAIL_AT = int(os.environ.get("FAIL_AT_ROW", "0"))
_record = Journal.record
_compute = BatchJob._compute
_step = LLMEngine.step
STALL_FILE = os.environ.get("STALL_FILE")
_calls = 0


def record(self, *args, **kwargs):
    global _calls
    _calls += 1
    if _calls == FAIL_AT:
        raise RuntimeError(f"injected fault at the journal's row {FAIL_AT}")
    return _record(self, *args, **kwargs)


async def compute_then_hold(self, rows):
    await _compute(self, rows)
    await asyncio.sleep(max(self.batch["expires_at"] - time.time() + 1, 0))


def step_or_stall(self, *args, **kwargs):
    if Path(STALL_FILE).exists():
        time.sleep(24 * 3600)
    return _step(self, *args, **kwargs)


if FAIL_AT:
    Journal.record = record
if os.environ.get("HOLD_AFTER_COMPUTE"):
    BatchJob._compute = compute_then_hold
if STALL_FILE:
    LLMEngine.step = step_or_stall
if os.environ.get("SWEEP_AHEAD_S"):
    from batchprompt.server.batch_api import BatchApi

    AHEAD_S = float(os.environ["SWEEP_AHEAD_S"])

    async def sweep_often_ahead(self):
        while True:
            await self.sweep(time.time() + AHEAD_S)
            await asyncio.sleep(0.2)

    BatchApi._sweep_often = sweep_often_ahead
if os.environ.get("RARE_COMMITS"):
    import batchprompt.server.batch_job as batch_job

    _init = Journal.__init__

    def init_rarely_committed(self, *args, **kwargs):
        _init(self, *args, **kwargs)
        self.commit_every, self.commit_seconds = 10**9, 24 * 3600

    Journal.__init__ = init_rarely_committed
    batch_job.FLUSH_EVERY_S = 24 * 3600
raise SystemExit(main())
