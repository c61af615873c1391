"""Two Ray nodes on this machine (`ray start --head` and a second `ray start --address`), each
offering one `bp_slot`, so one replica runs on each. One node's worker processes are killed
mid-job: the job completes with every row once, as a local run writes it, and its summary says
how many rows ran again."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

import batchprompt as bp
from batchprompt.jobs import JobOptions, run_job

from .conftest import REPLICA, answers, journal_rows, spam_lines, wait_for, write_jsonl

pytestmark = pytest.mark.slow

N = 120  # enough rows that node B is still running some once 4 are journaled, on a fast machine too
RAY = str(Path(sys.executable).with_name("ray"))


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def raylet_pid(temp_dir: str, node_manager_port: int) -> int:
    for p in Path("/proc").glob("[0-9]*"):
        cmd = cmdline(int(p.name))
        if "raylet/raylet" in cmd and temp_dir in cmd and f"--node_manager_port={node_manager_port}" in cmd:
            return int(p.name)
    raise AssertionError(f"no raylet with node manager port {node_manager_port}")


@pytest.fixture(scope="module")
def two_nodes():
    """(address, node B's raylet pid); every process of both nodes ends with the module."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    temp_dir = tempfile.mkdtemp(prefix="bp2n", dir="/tmp")
    gcs, nm_a, om_a, nm_b, om_b = free_ports(5)
    # Token authentication off for this loopback-only test cluster (the driver here sends no token).
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    common = ["--num-cpus", "1", "--resources", '{"bp_slot": 1}', "--temp-dir", temp_dir, "--disable-usage-stats"]
    try:
        subprocess.run([RAY, "start", "--head", "--port", str(gcs), "--include-dashboard=false",
                        "--node-manager-port", str(nm_a), "--object-manager-port", str(om_a), *common],
                       check=True, capture_output=True, env=env, timeout=180)
        subprocess.run([RAY, "start", "--address", f"127.0.0.1:{gcs}", "--node-manager-port", str(nm_b),
                        "--object-manager-port", str(om_b), *common],
                       check=True, capture_output=True, env=env, timeout=180)
        yield f"127.0.0.1:{gcs}", raylet_pid(temp_dir, nm_b)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        ours = [int(p.name) for p in Path("/proc").glob("[0-9]*") if temp_dir in cmdline(int(p.name))]
        for pid in ours + [c for pid in ours for c in children(pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_a_lost_nodes_rows_run_on_the_other(two_nodes, tmp_path):
    address, raylet_b = two_nodes
    job = write_jsonl(tmp_path / "in.jsonl", spam_lines(N))
    # The reference first: this process's own engine, the same job.
    ref = run_job(JobOptions(input=job, output=str(tmp_path / "ref.jsonl"), dtype="float32", progress=False,
                             max_tokens=6), out=open(os.devnull, "w"))
    assert ref.ok == N

    cluster = bp.RayCluster(replicas=2, address=address, replica_resources={"bp_slot": 1}, **REPLICA)
    out = tmp_path / "out.jsonl"
    killed: list[int] = []

    def kill_node_b_workers() -> None:
        def node_b_busy():
            for backend in cluster.backends:
                b = [r for r in backend.replicas if r["pid"] in children(raylet_b)]
                if b and b[0]["in_flight"] and journal_rows(str(out) + ".journal") >= 4:
                    return True
            return False
        wait_for(node_b_busy, 600, "node B's replica to be running rows")
        workers = [pid for pid in children(raylet_b) if cmdline(pid).startswith("ray::")
                   and not cmdline(pid).startswith(("ray::DashboardAgent", "ray::RuntimeEnvAgent"))]
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        killed.extend(workers)

    killer = threading.Thread(target=kill_node_b_workers, daemon=True)
    killer.start()
    try:
        summary = run_job(JobOptions(input=job, output=str(out), dtype="float32", progress=False, max_tokens=6,
                                     cluster=cluster), out=open(os.devnull, "w"))
        killer.join(30)
        assert killed, "node B's workers were not killed during the job"
        assert summary.ok == N and summary.failed == 0
        assert summary.rows_rerun > 0 and "were sent again after a replica was lost" in str(summary)
        got = answers(out)
        assert [a[0] for a in got] == [f"sms-{i}" for i in range(N)]  # every custom_id once, in order
        assert got == answers(tmp_path / "ref.jsonl")
        # The replicas ran on two nodes, and node B's was restarted there by Ray.
        backend = cluster.backends[0]
        wait_for(lambda: all(r["state"] == "ready" for r in backend.replicas), 180, "node B's replica to return")
        assert len({r["node_id"] for r in backend.replicas}) == 2
        assert sum(r["restarts"] for r in backend.replicas) >= 1
    finally:
        cluster.shutdown()
