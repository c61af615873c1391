"""Ray tests: local Ray (ray.init(num_cpus=2)), replicas of the embedded model in float32 with
one torch thread each, so that their greedy answers are the local engine's, token for token.

Skipped where Ray is not installed (`pip install 'batchprompt[ray]'`; `make install` installs it)."""
from __future__ import annotations

import json
import os
import sqlite3
import time

import pytest

pytest.importorskip("ray", reason="Ray is not installed: pip install 'batchprompt[ray]' (make install does)")

from ..conftest import SPAM_SYSTEM, sms_rows  # noqa: E402,F401  (re-exported)

#: Replicas as the tests run them: half a CPU each in Ray's accounting (the driver's jobs and
#: Ray Data's tasks fit beside them in num_cpus=2), one torch thread each, float32.
REPLICA = dict(replica_cpus=0.5, threads=1, start_timeout_s=300, recover_timeout_s=300)


@pytest.fixture(scope="module")
def local_ray(request):
    """A local Ray of two CPUs (a module's RAY_NUM_CPUS, where set) for this module; its
    address lets subprocess drivers join it."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    num_cpus = getattr(request.module, "RAY_NUM_CPUS", 2)
    ctx = ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, logging_level="WARNING")
    yield ctx.address_info["gcs_address"]
    ray.shutdown()


def spam_lines(n: int, bad: tuple[int, ...] = (), long: tuple[int, ...] = ()) -> list[dict]:
    """OpenAI batch lines of the spam workload; rows in `bad` bias a token id beyond the vocabulary,
    which only the engine (on the replica) finds out; rows in `long` generate 300 tokens."""
    lines = []
    for i, (_, text) in enumerate(sms_rows(n)):
        body = {"messages": [{"role": "system", "content": SPAM_SYSTEM}, {"role": "user", "content": text}],
                "max_tokens": 6}
        if i in bad:
            body["logit_bias"] = {"999999": 1}
        if i in long:
            body["max_tokens"] = body["min_tokens"] = 300
        lines.append({"custom_id": f"sms-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    return lines


def write_jsonl(path, lines) -> str:
    with open(path, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    return str(path)


def answers(path) -> list[tuple]:
    """(custom_id, text, completion tokens, finish reason) per output line, in file order."""
    out = []
    with open(path) as f:
        for line in f:
            obj = json.loads(line)
            body = obj["response"]["body"]
            choice = body["choices"][0]
            out.append((obj["custom_id"], choice["message"]["content"], body["usage"]["completion_tokens"],
                        choice["finish_reason"]))
    return out


def journal_rows(path) -> int:
    """Rows recorded so far in a job's journal (0 before it exists)."""
    if not os.path.exists(path):
        return 0
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1)
        try:
            return db.execute("SELECT count(*) FROM rows").fetchone()[0]
        finally:
            db.close()
    except sqlite3.Error:
        return 0


def wait_for(predicate, timeout: float, what: str, every: float = 0.05):
    """Poll `predicate` until it is true; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def pytest_collection_modifyitems(session, config, items):
    """The two-node test runs before the other Ray tests: after this process has used a local
    Ray (and Ray Data) and shut it down, connecting it to the two-node cluster got its actors'
    creation cancelled ("SchedulingCancelled") or never scheduled (Ray 2.60), a state no user
    driver reaches by connecting once."""
    ray_dir = os.path.dirname(__file__)
    first = next((i for i, it in enumerate(items) if str(it.path).startswith(ray_dir)), None)
    if first is None:
        return
    two = [it for it in items if it.path.name == "test_two_nodes.py" and str(it.path).startswith(ray_dir)]
    rest = [it for it in items if it not in two]
    items[:] = rest[:first] + two + rest[first:]
