"""The engine's OpenMP threads wait briefly wherever the engine was built (see device.py).

libgomp spins long (milliseconds) while the process's OpenMP threads do not outnumber the
CPUs, and briefly once they do; every thread that enters a parallel region holds a team of its
own until it ends. An engine built on a worker thread that then ended and stepped on the
service's thread left one team in the process, and on a busy machine ran many times slower than
one built on the main thread, whose team stays. What is checked here is the mechanism, by the
OS names of the threads (Linux): the idle team held beside the engine's, and the engine
thread's team of the configured size. Each case runs in a fresh interpreter, where no earlier
test left a team behind, with two intra-op threads, so that there is a team on any machine.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="OS thread names are set with prctl and read from /proc")

ENGINE, IDLE = "bp-engine", "bp-omp-idle"  # the OS names device.py gives the threads
ROOT = Path(__file__).resolve().parents[1]  # the fresh interpreter imports this checkout's batchprompt
TIMEOUT_S = 600  # a bound, so that a build that hangs fails; the slow case loads the 135M model

PRELUDE = """
import json, os, threading
import torch

def thread_names():
    names = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # a thread that ended meanwhile
            continue
        names[name] = names.get(name, 0) + 1
    return names
"""


def run_fresh(code: str, prelude: bool = True, **env: str) -> dict:
    """Run `code` in a fresh interpreter (after PRELUDE, which imports torch first, unless
    `prelude` is False); it prints one JSON object last, returned here."""
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    source = (PRELUDE if prelude else "") + textwrap.dedent(code)
    out = subprocess.run([sys.executable, "-c", source], capture_output=True,
                         text=True, timeout=TIMEOUT_S, cwd=ROOT, env={**environ, "HF_HUB_OFFLINE": "1", **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_an_engine_built_on_a_thread_that_ended_steps_beside_an_idle_team():
    got = run_fresh("""
        import batchprompt as bp
        from batchprompt.api.service import get_service

        torch.set_num_threads(2)
        built = {}
        builder = threading.Thread(target=lambda: built.setdefault(
            "engine", bp.LLMEngine.from_pretrained(kv_cache_memory=64 << 20)))
        builder.start()
        builder.join()  # as asyncio.to_thread's or a server's thread: its OpenMP team is gone
        lm = bp.LanguageModel.create(model=built["engine"], max_tokens=2)
        lm.prompt("Say hi")  # stepped on the service's engine thread, which now has its team
        on_engine = get_service(built["engine"]).call(torch.get_num_threads).result(timeout=60)
        print(json.dumps({"names": thread_names(), "engine_thread_num_threads": on_engine}))
    """)
    names = got["names"]
    # Beside the engine's team, the idle team (its thread and one worker) that keeps libgomp's
    # waits short.
    assert names.get(IDLE) == 2, names
    # The engine thread and its one worker: its team has the configured size.
    assert got["engine_thread_num_threads"] == 2 and names.get(ENGINE) == 2, names


def test_the_idle_team_outlives_the_thread_that_asked_for_it_and_is_made_once():
    got = run_fresh("""
        from batchprompt.device import hold_idle_openmp_team

        torch.set_num_threads(2)
        held = []
        caller = threading.Thread(target=lambda: held.append(hold_idle_openmp_team()))
        caller.start()
        caller.join()
        held.append(hold_idle_openmp_team())
        print(json.dumps({"held": held, "names": thread_names()}))
    """)
    assert got["held"] == [True, True]
    assert got["names"].get(IDLE) == 2, got["names"]


@pytest.mark.parametrize("threads, env", [(1, {}), (2, {"OMP_WAIT_POLICY": "ACTIVE"}),
                                          (2, {"GOMP_SPINCOUNT": "0"})],
                         ids=["one intra-op thread", "OMP_WAIT_POLICY set", "GOMP_SPINCOUNT set"])
def test_no_idle_team_without_a_team_or_where_the_user_chose_the_waiting(threads, env):
    got = run_fresh(f"""
        from batchprompt.device import prepare_engine_thread

        torch.set_num_threads({threads})
        engine_thread = threading.Thread(target=lambda: (prepare_engine_thread(), torch.zeros(1 << 16)))
        engine_thread.start()
        engine_thread.join()
        print(json.dumps({{"names": thread_names()}}))
    """, **env)
    assert IDLE not in got["names"], got["names"]


@pytest.mark.slow
def test_imported_before_torch_the_engine_is_built_on_its_thread_whose_team_is_the_only_one():
    """batchprompt first: the bounded spin is set (openmp_spin.py), the engine is built and stepped
    on the service's thread, and no other team is there (no idle team, none on the main thread),
    so that the engine's team keeps that spin."""
    got = run_fresh("""
        import json, os, threading
        import batchprompt as bp
        import torch
        from batchprompt.engine import LLMEngine

        torch.set_num_threads(2)
        built_on = []
        original = LLMEngine.from_pretrained.__func__

        def recording(cls, *args, **kwargs):
            built_on.append(threading.current_thread().name)
            return original(cls, *args, **kwargs)

        LLMEngine.from_pretrained = classmethod(recording)
        lm = bp.LanguageModel.create(max_tokens=2, engine_options={"kv_cache_memory": 64 << 20, "max_model_len": 1024})
        lm.prompt("Say hi")
        names = {}
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            names[name] = names.get(name, 0) + 1
        print(json.dumps({"spin": os.environ.get("GOMP_SPINCOUNT"), "built_on": built_on, "names": names,
                          "main": threading.main_thread().name}))
    """, prelude=False)
    assert got["spin"] == "1000"
    assert len(got["built_on"]) == 1 and got["built_on"][0].startswith("batchprompt-engine-"), got["built_on"]
    names = got["names"]
    assert IDLE not in names, names
    assert names.get(ENGINE) == 2, names  # the engine thread and its one worker
