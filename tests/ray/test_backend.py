"""The batch API over engine replicas on a local Ray: the same answers as one local engine, in
the same order; streaming, cancel and a bad prompt as locally; a replica killed mid-batch costs
nothing but a re-run of its rows, and Ray restarts it."""
from __future__ import annotations

import threading
import time

import pytest

import batchprompt as bp

from .conftest import REPLICA, SPAM_SYSTEM, sms_rows, wait_for

pytestmark = pytest.mark.slow

N = 24


@pytest.fixture(scope="module")
def cluster(local_ray):
    c = bp.RayCluster(replicas=2, **REPLICA)
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def lm(cluster):
    session = bp.LanguageModel.create(system=SPAM_SYSTEM, cluster=cluster, dtype="float32", max_tokens=6)
    yield session
    session.destroy()


@pytest.fixture(scope="module")
def messages():
    return [text for _, text in sms_rows(N)]


@pytest.fixture(scope="module")
def local_texts(messages):
    """The reference: one local engine (float32, greedy) on the same prompts."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        local = bp.LanguageModel.create(system=SPAM_SYSTEM, dtype="float32", max_tokens=6)
        texts = [r.text for r in local.batch_prompt(messages)]
        local.close()
    finally:
        torch.set_num_threads(threads)
    return texts


def test_answers_are_the_local_engines_in_input_order(lm, messages, local_texts):
    results = lm.batch_prompt(messages)
    assert [r.index for r in results] == list(range(N))
    assert all(r.error is None for r in results)
    assert [r.text for r in results] == local_texts
    backend = lm.backend
    assert backend.name.startswith("ray-") and backend.rows_rerun == 0
    # Each replica holds the session's system prompt (pinned once there): every prompt found it
    # in its replica's prefix cache.
    stats = backend.stats(timeout=30)
    assert stats.finished >= N and lm.pinned_tokens > 0
    assert stats.cached_prompt_tokens >= N * lm.pinned_tokens
    assert sum(1 for r in backend.replicas if r["state"] == "ready") == 2


def test_streaming_and_progress_over_replicas(lm, messages, local_texts):
    batch = lm.create_batch(messages[:8], progress=True)
    seen = dict(iter(batch))
    assert sorted(seen) == list(range(8))
    assert [seen[i].text for i in range(8)] == local_texts[:8]


def test_a_bad_prompt_fails_alone(lm, messages, local_texts):
    # A logit bias on a token id beyond the vocabulary: only the replica's engine finds out.
    bad = lm.batch_prompt(messages[:3], logit_bias={999_999: 1.0})
    assert all(r.error and "vocabulary" in r.error for r in bad)
    good = lm.batch_prompt(messages[:3])
    assert [r.text for r in good] == local_texts[:3]


def test_cancel_answers_every_prompt(lm, messages):
    batch = lm.create_batch(messages * 4, max_tokens=32)
    first = threading.Event()
    batch.on_result(lambda i, r: first.set())
    batch.start()
    assert first.wait(120)
    batch.cancel()
    results = batch.wait(timeout=120)
    assert len(results) == 4 * N
    assert any(r.finish_reason == "cancelled" for r in results)
    assert all(r.error is None or r.finish_reason == "cancelled" for r in results)


def test_a_killed_replica_costs_a_rerun_and_comes_back(lm, messages, local_texts):
    import ray

    backend = lm.backend
    rerun0 = backend.rows_rerun
    prompts = messages * 3
    batch = lm.create_batch(prompts)
    killed: list[dict] = []
    seen = [0]

    def on_result(index, result):
        # Kill the replica that holds the most rows right now, once a few results are in.
        seen[0] += 1
        if killed or seen[0] < 4:
            return
        victim = max(backend.replicas, key=lambda r: r["in_flight"])
        if victim["in_flight"]:
            killed.append(victim)
            ray.kill(victim["handle"], no_restart=False)
    batch.on_result(on_result)
    results = batch.wait(timeout=300)
    assert killed, "no replica held rows to kill"
    assert [r.text for r in results] == local_texts * 3  # every prompt answered once, as locally
    assert backend.rows_rerun > rerun0
    assert backend.replicas_lost >= 1
    # Ray restarts it, and it takes work again.
    index = killed[0]["index"]
    wait_for(lambda: backend.replicas[index]["state"] == "ready" and backend.replicas[index]["restarts"] >= 1,
             180, "the killed replica to be restarted")
    # Ready means it holds the session's pinned prefix again: every row finds it there (it was
    # ready before the pin, and rows sent beside the pin's prefill computed part of the prefix).
    again = lm.batch_prompt(messages)
    assert [r.text for r in again] == local_texts
    assert all(r.usage.cached_tokens >= lm.pinned_tokens for r in again), [r.usage.cached_tokens for r in again]


def test_clone_and_a_second_session_share_the_replicas(lm, cluster, messages, local_texts):
    other = lm.clone()
    assert other.backend is lm.backend
    assert other.pinned_tokens == lm.pinned_tokens > 0
    assert [r.text for r in other.batch_prompt(messages[:4])] == local_texts[:4]
    other.destroy()
    second = bp.LanguageModel.create(system=SPAM_SYSTEM, cluster=cluster, dtype="float32", max_tokens=6)
    assert second.backend is lm.backend
    second.destroy()
    # Other engine_options for the same model started a second set of replicas, which waited for
    # the CPUs the first set holds (10 minutes by default); bad ones waited too.
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="already runs .* with other engine_options"):
        bp.LanguageModel.create(cluster=cluster, dtype="float32", engine_options={"max_num_seqs": 8})
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        bp.LanguageModel.create(cluster=cluster, dtype="float32", engine_options={"block_size": 0})
    assert time.monotonic() - t0 < 30


def test_replicas_no_node_can_hold_are_an_error_at_once(local_ray):
    """More GPUs (or CPUs) per replica than any node has: a ClusterError naming what the nodes
    have, before any actor is made. (The actors waited for a node until the start timeout, 600 s
    by default, with only Ray's autoscaler messages.)"""
    from batchprompt.ray.cluster import ClusterError

    for options, what in ((dict(replica_gpus=1), "1 GPU"), (dict(replica_cpus=64), "64 CPU")):
        c = bp.RayCluster(replicas=1, threads=1, start_timeout_s=600, **{"replica_cpus": 0.5, **options})
        t0 = time.monotonic()
        with pytest.raises(ClusterError) as e:
            bp.LanguageModel.create(cluster=c, dtype="float32")
        assert time.monotonic() - t0 < 60
        assert "no node of the Ray cluster can hold a replica" in str(e.value) and what in str(e.value), e.value
        assert "2 CPU / 0 GPU" in str(e.value), e.value
        assert c.backends == []


def test_replicas_that_cannot_start_give_an_error_not_a_hang(local_ray):
    """A replica asks for a resource no node has: creating the session fails with the reason
    within the start timeout. (The backend's dispatch thread used to wait for the cluster's lock,
    held by the starter that was waiting for that thread: a hang.)"""
    c = bp.RayCluster(replicas=1, replica_cpus=0.5, threads=1, start_timeout_s=3,
                      replica_resources={"bp_no_such_resource": 1})
    outcome: list = []

    def create() -> None:
        try:
            bp.LanguageModel.create(cluster=c, dtype="float32")
        except Exception as e:  # noqa: BLE001
            outcome.append(e)

    t = threading.Thread(target=create, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "creating a session on replicas that cannot start hung"
    from batchprompt.ray.cluster import ClusterError

    assert len(outcome) == 1 and isinstance(outcome[0], ClusterError), outcome
    assert "no Ray replica was ready within 3s" in str(outcome[0])
    assert c.backends == []


def test_ctrl_c_while_the_replicas_start_ends_the_backend(local_ray, caplog):
    """Ctrl-C while the replicas started left the backend's dispatcher running: the replicas,
    which a terminal's Ctrl-C reaches too, then died under it, and it warned "Ray replica 0 is
    gone for good" after the user's own interrupt."""
    import os
    import signal

    c = bp.RayCluster(replicas=1, replica_cpus=0.5, threads=1, start_timeout_s=120,
                      replica_resources={"bp_no_such_resource": 1})  # never ready: the start waits
    # Python's own handler, whatever this process started with: a background `make test` (nohup,
    # `&`) starts it with SIGINT ignored, and the signal then never came (the start waited on).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    before = set(threading.enumerate())  # the module's other sessions keep their own dispatchers
    timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            bp.LanguageModel.create(cluster=c, dtype="float32")
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    wait_for(lambda: not any(t.name.startswith("batchprompt-dispatch-ray") and t not in before
                             for t in threading.enumerate()), 30, "the backend's dispatcher to end")
    assert c.backends == []
    assert "gone for good" not in caplog.text


EXIT_WITHOUT_CLOSE = """
import sys
import batchprompt as bp
lm = bp.LanguageModel.create(system="Answer spam or ham.", max_tokens=4,
                             cluster=bp.RayCluster(address=sys.argv[1], replicas=1, replica_cpus=0.5, threads=1))
print(sum(r.ok for r in lm.batch_prompt(["hi", "free money"])), "answers")
"""


def test_a_script_that_ends_without_close_exits_cleanly(local_ray):
    """The README's Ray example has no close(): at exit, the session let go of its prefix on
    replicas Ray had already ended, and printed a traceback ("Failed to submit task to actor")."""
    import os
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", EXIT_WITHOUT_CLOSE, local_ray], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "2 answers" and "Traceback" not in p.stderr, (p.stdout, p.stderr[-3000:])
    # Then that release ran after Ray's own exit hook, and its call to a replica started a new
    # local Ray instance in the exiting process (seconds; at times a segmentation fault, -11).
    assert "Started a local Ray instance" not in p.stderr, p.stderr[-3000:]


def test_a_script_that_ends_while_its_batch_runs_on_ray_says_so(local_ray):
    """The exit stopped no Ray backend: the replicas were let go of after Ray's own exit hook,
    the cut prompts went unnamed, and a session's release started a new local Ray instance."""
    from tests.exit_script import end_while_a_batch_runs

    p = end_while_a_batch_runs("cluster=bp.RayCluster(address=sys.argv[1], replicas=1, replica_cpus=0.5, threads=1)",
                               [local_ray], timeout=600)
    assert "Started a local Ray instance" not in p.stderr, p.stderr[-3000:]


def test_a_ctrl_c_in_batch_prompt_on_ray_is_no_forgotten_wait_at_exit(local_ray):
    from tests.exit_script import interrupt_a_batch

    interrupt_a_batch("cluster=bp.RayCluster(address=sys.argv[1], replicas=1, replica_cpus=0.5, threads=1)",
                      [local_ray], timeout=600)


RAY_SHUT_DOWN_MID_BATCH = """
import sys, time
import ray
import batchprompt as bp
lm = bp.LanguageModel.create(cluster=bp.RayCluster(address=sys.argv[1], replicas=1, replica_cpus=0.5, threads=1),
                             max_tokens=24)
batch = lm.create_batch([f"Write a story about a cat named {i}" for i in range(40)]).start()
deadline = time.monotonic() + 120
while batch.progress.done < 1 and time.monotonic() < deadline:
    time.sleep(0.05)
ray.shutdown()
results = batch.wait(timeout=60)
print("ANSWERED", sum(r is not None for r in results), sum(r.ok for r in results), flush=True)
print("ERRORS", sorted({r.error for r in results if not r.ok}), flush=True)
"""


def test_ray_shut_down_under_a_running_batch_answers_every_prompt(local_ray):
    """ray.shutdown() while a batch ran: the dispatcher called a replica, which started a new
    local Ray, failed with a traceback, and left the rows it was handling unanswered (wait()
    never returned; Ray's C++ ended the process a minute later)."""
    import os
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", RAY_SHUT_DOWN_MID_BATCH, local_ray], capture_output=True, text=True,
                       timeout=400, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert p.returncode == 0 and "ANSWERED 40 " in p.stdout, (p.returncode, p.stdout, p.stderr[-3000:])
    ok = int(p.stdout.split("ANSWERED 40 ")[1].split()[0])
    assert 1 <= ok < 40, p.stdout
    assert "Ray was shut down in this process (ray.shutdown()) while this ran" in p.stdout, p.stdout
    assert "Started a local Ray instance" not in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]


def test_a_replica_that_cannot_start_is_told_by_the_error_it_raised():
    """The error named where the replica died and the traceback's top frames (6 lines), never
    the cause ("no CUDA GPU is visible")."""
    from batchprompt.ray.backend import _reason

    message = ("The actor died because of an error raised in its creation task, \x1b[36mray::Replica.__init__()\x1b[39m "
               "(pid=25785, ip=192.0.2.2, actor_id=37d6, repr=<batchprompt.ray.replica.Replica object at 0x7f>)\n"
               '  File "/x/concurrent/futures/_base.py", line 456, in result\n    return self.__get_result()\n'
               "           ^^^^^^^^^^^^^^^^^^^\n"
               '  File "/x/concurrent/futures/_base.py", line 401, in __get_result\n    raise self._exception\n'
               '  File "/x/batchprompt/device.py", line 40, in resolve\n    raise ValueError("no CUDA GPU")\n'
               "ValueError: --device cuda: no CUDA GPU is visible to PyTorch")
    assert _reason(RuntimeError(message)) == ("The actor died because of an error raised in its creation task, "
                                              "ray::Replica.__init__(): ValueError: --device cuda: no CUDA GPU is "
                                              "visible to PyTorch")
    assert _reason(RuntimeError("The actor died unexpectedly before finishing this task.\n\tclass_name: Replica")) \
        == "The actor died unexpectedly before finishing this task. class_name: Replica"


def test_bp_shutdown_lets_go_of_the_ray_replicas_too(local_ray):
    """The README says bp.shutdown() releases every engine in the process: it released the local
    ones only, and the replicas ran on (cluster.backends still listed them)."""
    from batchprompt.api.result import EngineStoppedError

    cluster = bp.RayCluster(replicas=1, replica_cpus=0.5, threads=1)
    lm = bp.LanguageModel.create(cluster=cluster, dtype="float32", max_tokens=2)
    assert lm.prompt("hi") and len(cluster.backends) == 1
    assert bp.shutdown(timeout=60) >= 1
    assert cluster.backends == []
    with pytest.raises(EngineStoppedError):
        lm.prompt("hi")


def test_more_replicas_than_the_cluster_holds_at_once_are_told(local_ray, caplog):
    """--replicas 4 of 1 CPU on a 2-CPU cluster started without a word: 2 ran, 2 waited."""
    import logging

    cluster = bp.RayCluster(replicas=3, replica_cpus=1.0, threads=1)
    with caplog.at_level(logging.WARNING, logger="batchprompt"):
        lm = bp.LanguageModel.create(cluster=cluster, dtype="float32", max_tokens=2)
    try:
        assert "the Ray cluster holds 2 of the 3 replicas asked for at once" in caplog.text, caplog.text
    finally:
        lm.close()
        cluster.shutdown()


@pytest.mark.parametrize("bad, message", [
    (dict(replica_cpus="1"), "replica_cpus must be a number, got '1'"),  # was a bare TypeError ('<' on str)
    (dict(replicas=True), "replicas must be a whole number, got True"),  # was taken as 1 replica
    (dict(replicas=2.0), "replicas must be a whole number, got 2.0"),
    (dict(threads=False), "threads must be a whole number, got False"),
    (dict(replica_gpus=None), "replica_gpus must be a number, got None"),  # was a bare TypeError
    (dict(start_timeout_s=0), "start_timeout_s and recover_timeout_s must be > 0 seconds"),
])
def test_a_bad_cluster_option_is_one_clear_error(bad, message):
    with pytest.raises(ValueError) as e:
        bp.RayCluster(**bad)
    assert str(e.value) == message
