"""The Ray that a RayCluster started ends with the last batchprompt backend on it."""
from __future__ import annotations

import pytest

import batchprompt as bp

from .conftest import REPLICA

pytestmark = pytest.mark.slow


def test_bp_shutdown_ends_the_local_ray_that_a_cluster_started():
    """bp.shutdown() ended the replicas but left the local Ray that RayCluster had started (its GCS,
    raylet and agents, a few hundred MB) running until the process exited: in a notebook, for ever."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    cluster = bp.RayCluster(replicas=1, **REPLICA, init_options={"num_cpus": 2})
    other = bp.RayCluster(replicas=1, **REPLICA)  # joins the same Ray: it must not end under it
    try:
        lm = bp.LanguageModel.create(cluster=cluster, dtype="float32", max_tokens=2)
        lm2 = bp.LanguageModel.create(cluster=other, dtype="float32", max_tokens=2)
        assert lm.prompt("hi") is not None and lm2.prompt("hi") is not None
        other.shutdown()
        assert ray.is_initialized()  # the first cluster's backend still runs on it
        assert lm.prompt("hi") is not None
        assert bp.shutdown(timeout=60) >= 1
        assert not ray.is_initialized()
    finally:
        if ray.is_initialized():
            ray.shutdown()
