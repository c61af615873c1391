"""Routing: least outstanding tokens, with prefix affinity while the endpoint keeps up."""
from __future__ import annotations

from batchprompt.remote.endpoint import Endpoint
from batchprompt.remote.hostfile import EndpointSpec
from batchprompt.remote.routing import Router


def _endpoints(n):
    return [Endpoint(i, EndpointSpec(f"http://h{i}:1"), api_key=None, timeout=1, connect_timeout=1, max_in_flight=4,
                     initial_in_flight=2) for i in range(n)]


def test_prefix_affinity_while_the_endpoint_keeps_up():
    eps = _endpoints(3)
    router = Router(eps, slack_tokens=100)
    session = list(range(64)) + [7, 7]
    router.record(eps[2], [session])
    eps[2].outstanding_tokens = 80  # busier than the others, within the slack
    assert router.choose(list(range(64)) + [9], eps) is eps[2]
    eps[2].outstanding_tokens = 500  # no longer keeping up
    assert router.choose(list(range(64)) + [9], eps) in (eps[0], eps[1])


def test_a_prefix_every_endpoint_holds_decides_nothing():
    eps = _endpoints(2)
    router = Router(eps, slack_tokens=100)
    shared = list(range(32))
    router.record(eps[0], [shared])
    router.record(eps[1], [shared])
    eps[0].outstanding_tokens = 50
    assert router.choose(shared + [1], eps) is eps[1]  # least loaded


def test_avoid_the_endpoint_that_just_failed_unless_it_is_the_only_one():
    eps = _endpoints(2)
    router = Router(eps, slack_tokens=100)
    assert router.choose([1, 2, 3], eps, avoid=frozenset({0})) is eps[1]
    assert router.choose([1, 2, 3], [eps[0]], avoid=frozenset({0})) is eps[0]
