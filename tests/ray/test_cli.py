"""`batchprompt run --ray`: the same output, errors file and exit status as a local run; a driver
killed with SIGKILL resumes from its journal; without Ray, one line says what to install."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from .conftest import answers, journal_rows, spam_lines, wait_for, write_jsonl

pytestmark = pytest.mark.slow

#: LONG generates 300 tokens: the job runs on for seconds after the other rows are journaled, so
#: the driver is killed mid-job (with 6 tokens a row, the rows came back nearly at once, and a kill
#: sent once 6 were journaled could find the job done).
N, BAD, LONG = 40, 5, 11


def batchprompt(*args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "batchprompt", "run", *args, "--no-progress", "--dtype", "float32"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **kwargs)


def stderr_of(p: subprocess.Popen, timeout: float) -> str:
    """The process's stderr once it exits (killed if it has not within `timeout`)."""
    try:
        return p.communicate(timeout=timeout)[1]
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("job") / "in.jsonl", spam_lines(N, bad=(BAD,), long=(LONG,)))


@pytest.fixture(scope="module")
def reference(job, tmp_path_factory):
    """The local run of the same job: its outputs and errors."""
    out = tmp_path_factory.mktemp("local") / "out.jsonl"
    p = batchprompt(job, "-o", str(out))
    _, err = p.communicate(timeout=600)
    assert p.returncode == 1, err  # the bad row failed, alone
    return answers(out), open(str(out) + ".errors.jsonl").read().count("\n")


def test_address_auto_with_no_cluster_here_says_to_start_one(job, tmp_path, monkeypatch):
    """Its hint was "give --address auto for the cluster `ray start` runs on this machine",
    which is what the user had given. (First in the module: no Ray of its own runs yet.)"""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    p = batchprompt(job, "-o", str(tmp_path / "o.jsonl"), "--ray", "--address", "auto")
    err = stderr_of(p, 180)
    assert p.returncode == 2, err
    assert "no cluster runs here: run `ray start --head` first" in err and "give --address auto" not in err, err


def test_killed_driver_resumes_and_matches_a_local_run(local_ray, job, reference, tmp_path):
    out = tmp_path / "out.jsonl"
    ray_args = (job, "-o", str(out), "--ray", "--address", local_ray, "--replicas", "2", "--replica-cpus", "0.5")
    first = batchprompt(*ray_args)
    try:
        wait_for(lambda: journal_rows(str(out) + ".journal") >= 6 or first.poll() is not None, 600,
                 "the Ray job to journal some rows")
        assert first.poll() is None, first.communicate()[1]
        first.send_signal(signal.SIGKILL)  # the driver dies mid-job; Ray ends its replicas
        first.wait(30)
    finally:
        if first.poll() is None:
            first.kill()
    done = journal_rows(str(out) + ".journal")
    assert 6 <= done < N
    second = batchprompt(*ray_args)
    _, err = second.communicate(timeout=600)
    assert second.returncode == 1, err  # as locally: one row failed
    assert f"resuming: {done} of {N} rows are already done" in err
    ref_answers, ref_errors = reference
    got = answers(out)
    assert got == ref_answers  # same content, same order, each custom_id once
    assert len({a[0] for a in got}) == N - 1
    errors = open(str(out) + ".errors.jsonl").read()
    assert errors.count("\n") == ref_errors == 1 and f'"sms-{BAD}"' in errors and "vocabulary" in errors


def test_sigterm_stops_a_ray_job_as_it_stops_a_local_one(local_ray, job, tmp_path):
    """Ray's own handler took SIGTERM over from batchprompt's once Ray started: the driver died
    with exit 15 (or an abort) and Ray's C++ log, with no summary and no word on resuming."""
    out = tmp_path / "out.jsonl"
    p = batchprompt(job, "-o", str(out), "--ray", "--address", local_ray, "--replicas", "1", "--replica-cpus", "0.5")
    try:
        wait_for(lambda: journal_rows(str(out) + ".journal") >= 6 or p.poll() is not None, 600,
                 "the Ray job to journal some rows")
        assert p.poll() is None, p.communicate()[1]
        p.send_signal(signal.SIGTERM)
        err = stderr_of(p, 120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 143, err
    assert "stopped by SIGTERM" in err and "Run the same command again to resume" in err, err


BLOCK_RAY = """
import importlib.abc, sys
class NoRay(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, NoRay())
from batchprompt.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_ray_without_ray_installed_says_what_to_install(job, tmp_path):
    p = subprocess.run([sys.executable, "-c", BLOCK_RAY, "run", job, "-o", str(tmp_path / "o.jsonl"), "--ray"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "batchprompt: error: --ray: Ray is not installed: pip install 'batchprompt[ray]'"]
    assert not (tmp_path / "o.jsonl").exists()


def test_ray_options_need_ray(job, tmp_path):
    from batchprompt.cli import main

    assert main(["run", job, "-o", str(tmp_path / "o.jsonl"), "--replicas", "2"]) == 2


@pytest.mark.parametrize("address", ["127.0.0.1:1", "ray://127.0.0.1:1"])
def test_an_address_where_no_ray_listens_is_an_error_not_a_hang(job, tmp_path, address):
    """Nothing listens at the address: one line naming it, exit 2, at once. (ray.init retried
    for ever, printing only Ray's C++ log.)"""
    out = tmp_path / "o.jsonl"
    p = batchprompt(job, "-o", str(out), "--ray", "--address", address)
    err = stderr_of(p, 120)
    assert p.returncode == 2, err
    assert f"cannot reach the Ray cluster at {address}" in err and "ray start --head" in err, err
    assert "Traceback" not in err



def test_a_head_that_checks_a_token_is_named_in_the_hint(local_ray, job, tmp_path, monkeypatch):
    """A cluster begun with token authentication (`ray start --head`, or a local Ray here) and a
    driver without RAY_AUTH_MODE=token: the error's only hint was "give --address auto ..."."""
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)  # the fixture's ray.init set it for its children
    p = batchprompt(job, "-o", str(tmp_path / "o.jsonl"), "--ray", "--address", local_ray)
    err = stderr_of(p, 180)
    assert p.returncode == 2, err
    assert "set RAY_AUTH_MODE=token here, with the head's ~/.ray/auth_token on this machine" in err, err[-3000:]


@pytest.mark.parametrize("address", [[], ["--address", "auto"]])
def test_a_ray_address_in_the_environment_where_nothing_listens_is_an_error_not_a_hang(job, tmp_path, monkeypatch,
                                                                                      address):
    """RAY_ADDRESS (or the cluster `ray start` recorded, since stopped) where nothing listens: Ray
    retried for ever (still running at 290 s, and SIGTERM did not end it)."""
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    p = batchprompt(job, "-o", str(tmp_path / "o.jsonl"), "--ray", *address)
    err = stderr_of(p, 120)
    assert p.returncode == 2, err
    assert ("cannot reach the Ray cluster at 127.0.0.1:1" in err and "the address is RAY_ADDRESS in the environment: "
            "unset or fix RAY_ADDRESS, or give --address local for a new local Ray" in err), err


def test_a_stopped_cluster_that_ray_start_recorded_is_an_error_not_a_hang(job, tmp_path, monkeypatch):
    """`ray start`'s head killed, its address file left: --ray (and --address auto) waited for ever."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # where Ray looks: RAY_TMPDIR/ray/ray_current_cluster
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")
    p = batchprompt(job, "-o", str(tmp_path / "o.jsonl"), "--ray")
    err = stderr_of(p, 120)
    assert p.returncode == 2, err
    assert ("cannot reach the Ray cluster at 127.0.0.1:1" in err and "the address is the cluster that `ray start` "
            "recorded on this machine: `ray stop` forgets it, or give --address local" in err), err
