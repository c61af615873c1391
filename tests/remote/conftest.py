"""Real `batchprompt serve` processes on loopback ports (the embedded model in float32, where
batching changes no greedy token, so the pool's answers can be compared with a local engine's),
started through tests/server/conftest.py's helpers; and fault proxies in front of them."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from tests.server.conftest import start_server, stop_server

from .fault_proxy import FaultProxy

SERVER_ARGS = ("--dtype", "float32", "--max-num-seqs", "32", "--max-model-len", "512", "--log-level", "warning")


def start_servers(tmp: Path, n: int, *args: str):
    servers = []
    try:
        for i in range(n):
            d = tmp / f"server{i}"
            d.mkdir(parents=True, exist_ok=True)
            servers.append(start_server(d, *SERVER_ARGS, *args))
    except BaseException:
        for s in servers:
            stop_server(s)
        raise
    return servers


@pytest.fixture(scope="package")
def two_servers(tmp_path_factory):
    """Two servers shared by the tests that do not kill one."""
    servers = start_servers(tmp_path_factory.mktemp("remote"), 2)
    yield servers
    for s in servers:
        stop_server(s)


@pytest.fixture
def proxy(two_servers):
    """A fault proxy in front of the second server (faults cleared after each test)."""
    p = FaultProxy(two_servers[1].url)
    yield p
    p.close()


@contextlib.contextmanager
def pool_of(urls, **kwargs):
    import batchprompt as bp

    pool = bp.EndpointPool(urls, **kwargs)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="package")
def reference():
    """What the local engine answers (the same weights, float32, greedy), per prompt list."""
    import batchprompt as bp
    from batchprompt import LLMEngine

    engine = LLMEngine.from_pretrained(dtype="float32", max_num_batched_tokens=1024)
    cache: dict = {}

    def answers(prompts, system=None, **options):
        key = json.dumps([list(prompts), system, options], sort_keys=True)
        if key not in cache:
            lm = bp.LanguageModel.create(system=system, model=engine, **options)
            cache[key] = [r.text for r in lm.batch_prompt(list(prompts))]
            lm.destroy()
        return cache[key]

    yield answers
    bp.shutdown(engine)
