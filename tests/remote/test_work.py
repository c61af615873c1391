"""The pool's queue: sub-batches of one source's items with equal parameters, cut to a token
budget; split halves stay apart; priorities first, the others not starved."""
from __future__ import annotations

from batchprompt.backends.base import BULK, INTERACTIVE, Item, Source
from batchprompt.engine import SamplingParams
from batchprompt.remote.work import STARVATION_EVERY, Work, WorkQueue

P = SamplingParams(max_tokens=4)


def _works(source, n, params=P, tokens=10):
    return [Work(Item([i], params, lambda out: None), source, params, tokens) for i in range(n)]


def test_budget_parameters_and_order():
    q, s = WorkQueue(), Source()
    other = SamplingParams(max_tokens=5)
    ws = _works(s, 3) + _works(s, 1, other) + _works(s, 3)
    q.add(ws)
    first = q.take(budget_tokens=45, max_prompts=100)
    assert first.works == [ws[0], ws[1], ws[2], ws[4]]  # the other parameters wait for their own
    assert q.take(45, 100).works == [ws[3]]
    assert q.take(45, 100).works == [ws[5], ws[6]]
    assert not q and q.queued_tokens == 0


def test_a_retry_does_not_ride_along_to_an_endpoint_that_failed_it():
    """A sub-batch is routed by its head's failures: a retry behind a fresh head went with it to
    an endpoint that had already failed that retry (a server answering 500 to everything), used up
    its tries there, and failed beside a healthy server."""
    q, s = WorkQueue(), Source()
    ws = _works(s, 4)
    ws[1].avoid = frozenset({7})
    q.add(ws)
    assert q.take(1000, 100, endpoint=7).works == [ws[0], ws[2], ws[3]]
    assert q.take(1000, 100, endpoint=3).works == [ws[1]]
    assert not q and q.queued_tokens == 0


def test_split_halves_are_not_joined_again():
    q, s = WorkQueue(), Source()
    ws = _works(s, 4)
    for w in ws[:2]:
        w.cap = 2
    for w in ws[2:]:
        w.cap = 2
    q.add(ws, front=True)
    assert [len(q.take(1000, 100).works) for _ in range(2)] == [2, 2]


def test_priority_first_without_starving_bulk():
    q, bulk, interactive = WorkQueue(), Source(priority=BULK), Source(priority=INTERACTIVE)
    q.add(_works(bulk, 50))
    q.add(_works(interactive, 50))
    picks = [q.take(10, 1).source for _ in range(2 * STARVATION_EVERY)]
    assert picks.count(bulk) == 2 and picks[0] is interactive
