"""Streaming batches: callbacks, iteration, cancel, progress, threads and asyncio."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

import batchprompt as bp
from batchprompt.api.batch import Batch, Prepared
from batchprompt.engine import SamplingParams

pytestmark = pytest.mark.slow


def test_on_result_in_completion_order_and_on_complete_once(lm, messages):
    seen, complete = [], []
    done = threading.Event()
    batch = lm.create_batch(messages[:10])
    batch.on_result(lambda i, r: seen.append((i, r)))
    batch.on_complete(lambda results: (complete.append(results), done.set()))
    assert batch.progress.done == 0 and batch.progress.eta_s is None
    results = batch.start().wait()
    assert done.wait(10)
    assert sorted(i for i, _ in seen) == list(range(10))
    assert all(r.index == i for i, r in seen)
    assert len(complete) == 1 and complete[0] == results
    p = batch.progress
    assert (p.done, p.total, p.failed) == (10, 10, 0) and p.eta_s == 0 and p.tokens_per_s > 0
    assert "10/10 done" in str(p)


def test_progress_counts_the_tokens_of_prompts_still_running(lm, messages, monkeypatch):
    """With every prompt in flight at once, none finishes until near the end: progress read 0
    tokens (0 tok/s) for most of the run. It counts the running prompts' tokens too."""
    import batchprompt.api.service as service

    monkeypatch.setattr(service, "MADE_EVERY_S", 0.0, raising=False)  # counted every step, not every second
    batch = lm.create_batch(messages[:6], max_tokens=120, min_tokens=120).start()
    seen = []
    deadline = time.monotonic() + 300
    while not batch.done and time.monotonic() < deadline:
        p = batch.progress
        seen.append((p.done, p.completion_tokens))
        time.sleep(0.02)
    results = batch.wait(timeout=300)
    assert any(done == 0 and tokens > 0 for done, tokens in seen), seen[-5:]
    assert all(a[1] <= b[1] for a, b in zip(seen, seen[1:])), seen  # never counted twice, then dropped
    assert max(t for _, t in seen) <= 6 * 120
    assert batch.progress.completion_tokens == sum(r.usage.completion_tokens for r in results) == 6 * 120


def test_callbacks_added_after_the_results_are_called_for_them(lm, messages):
    """As concurrent.futures calls a callback added to a finished future: on_result for each
    result already in, on_complete with them all; a non-function is refused at once."""
    batch = lm.create_batch(messages[:3])
    results = batch.start().wait(timeout=120)
    got, done = [], threading.Event()
    batch.on_result(lambda i, r: got.append((i, r)))
    batch.on_complete(lambda rs: (got.append(rs), done.set()))
    assert done.wait(10)
    assert sorted(i for i, _ in got[:3]) == [0, 1, 2] and all(r is results[i] for i, r in got[:3])
    assert got[3] == results and len(got) == 4
    for method in ("on_result", "on_complete"):
        with pytest.raises(TypeError, match=f"{method} takes a function, got 'print'"):
            getattr(lm.create_batch(messages[:1]), method)("print")


def test_on_tokens_hands_out_each_prompts_tokens_as_they_are_made(lm, messages):
    """Each prompt's new tokens, step by step, before its result, which holds them all."""
    events, done = [], threading.Event()
    batch = lm.create_batch(messages[:4])
    batch.on_tokens(lambda i, ids: events.append(("tokens", i, list(ids))))
    batch.on_result(lambda i, r: events.append(("result", i, r)))
    batch.on_complete(lambda rs: done.set())
    results = batch.start().wait(timeout=120)
    assert done.wait(10)
    for i, r in enumerate(results):
        mine = [e for e in events if e[1] == i]
        assert mine[-1] == ("result", i, r)  # the result comes after every piece of its tokens
        pieces = [ids for kind, _, ids in mine[:-1]]
        # Every token, the last ones too (those of the step that finished the prompt never came).
        assert sum(pieces, []) == r.token_ids and len(pieces) == len(r.token_ids) >= 1
        assert all(len(ids) >= 1 for ids in pieces)
    with pytest.raises(RuntimeError, match="before the batch starts"):
        batch.on_tokens(lambda i, ids: None)
    with pytest.raises(TypeError, match="on_tokens takes a function"):
        lm.create_batch(messages[:1]).on_tokens(None)


def test_on_tokens_with_one_token_and_without_the_last(lm, messages):
    """max_tokens=1: the one token comes (the callback was never called); last=False leaves out
    the tokens of the finishing step, for a consumer that takes the end from the result."""
    every, but_last = [], []
    batch = lm.create_batch(messages[:2], max_tokens=1)
    batch.on_tokens(lambda i, ids: every.append((i, list(ids))))
    batch.on_tokens(lambda i, ids: but_last.append((i, list(ids))), last=False)
    results = batch.start().wait(timeout=120)
    assert sorted(every) == sorted((i, r.token_ids) for i, r in enumerate(results)) and but_last == []


def test_wait_ends_after_every_on_tokens_call(lm, messages):
    """With on_tokens the only callback, wait() returned while token callbacks were still queued
    (best_of hands a prompt's tokens over at its end): they ran after it, into the next batch."""
    got: dict[int, list[int]] = {}
    batch = lm.create_batch(messages[:3], max_tokens=4, best_of=2, temperature=0.8, seed=1)
    batch.on_tokens(lambda i, ids: (time.sleep(0.05), got.setdefault(i, []).extend(ids)))
    results = batch.start().wait(timeout=120)
    assert {i: got.get(i) for i in range(3)} == {i: r.token_ids for i, r in enumerate(results)}


def test_iteration_as_completed(lm, messages):
    got = dict(lm.create_batch(messages[:6]))
    assert sorted(got) == list(range(6))
    assert [got[i].text for i in range(6)] == [r.text for r in lm.batch_prompt(messages[:6])]


def test_iteration_with_ticks_yields_none_while_waiting_and_the_same_results(lm, messages):
    """A tick far shorter than a step: Nones between results, and the results of iteration."""
    got = list(lm.create_batch(messages[:4]).with_ticks(0.001))
    results = [g for g in got if g is not None]
    assert len(results) == 4 and len(got) > 4
    assert [r.text for _, r in sorted(results, key=lambda g: g[0])] == [r.text for r in lm.batch_prompt(messages[:4])]
    for every in (0, -1, float("nan")):
        with pytest.raises(ValueError, match="positive number of seconds"):
            lm.create_batch(messages[:1]).with_ticks(every)


def test_cancel_keeps_finished_results_and_stops_the_rest(lm, messages, engine32):
    prompts = messages * 3  # 72
    batch = lm.create_batch(prompts, max_tokens=40, temperature=0.0)
    first = threading.Event()
    batch.on_result(lambda i, r: first.set())
    batch.start()
    assert first.wait(120)
    batch.cancel()
    results = batch.wait(timeout=60)
    finished = [r for r in results if r.ok]
    cancelled = [r for r in results if r.finish_reason == "cancelled"]
    assert len(finished) >= 1 and len(cancelled) >= 1
    assert len(finished) + len(cancelled) == len(prompts)
    assert all(r.error == "cancelled before it finished" for r in cancelled)
    batch.wait(errors="raise")  # a cancel is not a failure
    progress = batch.progress
    assert (progress.done, progress.failed, progress.cancelled) == (len(prompts), 0, len(cancelled))
    assert f"{len(cancelled)} cancelled" in str(progress)
    # nothing leaked: only pinned prefixes hold blocks
    lm._service.call(lambda: None).result()
    pinned = {b.block_id for blocks in engine32.kv.pins.values() for b in blocks}
    assert engine32.pool.num_used == len(pinned)
    assert not engine32.has_unfinished()


def test_cancel_before_start(lm, messages):
    batch = lm.create_batch(messages[:3])
    batch.cancel()
    assert [r.finish_reason for r in batch.wait()] == ["cancelled"] * 3


def test_progress_bar(lm, messages, capsys):
    lm.batch_prompt(messages[:4], progress=True)
    assert "4/4" in capsys.readouterr().err


def test_threads_share_one_engine(lm, messages, engine32):
    expected = [r.text for r in lm.batch_prompt(messages[:8])]
    got = [None] * 8
    barrier = threading.Barrier(8)

    def worker(i):
        barrier.wait()
        got[i] = lm.clone().prompt(messages[i]) if i % 2 else lm.prompt(messages[i])

    before = engine32.stats.steps
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == expected
    # batched together: far fewer steps than 8 prompts one after another would take
    assert engine32.stats.steps - before < 8 * 7


def test_asyncio_callers(lm, messages):
    expected = [r.text for r in lm.batch_prompt(messages[:6])]

    async def main():
        singles = await asyncio.gather(*(lm.aprompt(m) for m in messages[:3]))
        batch = await lm.abatch_prompt(messages[3:6])
        streamed = {i: r.text async for i, r in lm.create_batch(messages[:6])}
        return singles, batch, streamed

    singles, batch, streamed = asyncio.run(main())
    assert singles == expected[:3]
    assert [r.text for r in batch] == expected[3:6]
    assert [streamed[i] for i in range(6)] == expected


def test_top_level_async(engine32, messages):
    results = asyncio.run(bp.abatch_prompt(messages[:2], system="Be brief.", model=engine32, max_tokens=3))
    assert [r.index for r in results] == [0, 1] and all(r.ok for r in results)


class _Recorder:
    """Stands in for the service: records what a batch submits."""

    def __init__(self):
        self.sources = []

    def submit(self, source):
        self.sources.append(source)


def test_admission_groups_prompts_by_shared_prefix():
    a, b = [5, 5, 5, 5], [9, 9, 9, 9]
    prompts = [a + [1], b + [1], a + [2], b + [2], a + [3]]
    rec = _Recorder()
    Batch(rec, [Prepared(i, p, SamplingParams()) for i, p in enumerate(prompts)]).start()
    order = [item.token_ids for item in rec.sources[0].items]
    assert order == [a + [1], a + [2], a + [3], b + [1], b + [2]]


def test_a_large_batch_is_fed_in_a_window(lm, engine32, monkeypatch):
    service = lm._service
    fed = []  # (requests in the engine, the window) after each feed, on the engine thread
    feed = service._feed

    def recording_feed():
        feed()
        fed.append((service.in_flight, service._window()))

    # The window follows the completion rate, so it is read where it is applied: comparing a
    # sample taken on the callback thread with the window at the end raced with rate changes.
    monkeypatch.setattr(service, "_feed", recording_feed)
    batch = lm.create_batch([f"{i}" for i in range(1500)], max_tokens=1)
    results = batch.wait(timeout=600)
    assert all(r.ok for r in results)
    assert all(n <= window for n, window in fed)
    assert max(n for n, _ in fed) < 1500


def test_a_wait_without_limit_or_with_a_bad_timeout_keeps_the_batch(lm, messages):
    """wait(timeout=float("inf")) or 1e12 raised OverflowError from inside the wait, and "1" a
    TypeError there: each was taken for an abandoned wait, and the batch was cancelled."""
    batch = lm.create_batch(messages[:3], max_tokens=2)
    for bad in ("1", float("nan"), -1):
        with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0, or None"):
            batch.wait(timeout=bad)
    for no_limit in (float("inf"), 1e12):
        results = batch.wait(timeout=no_limit)
        assert all(r.ok for r in results), results


def test_a_prompt_that_cannot_be_rendered_is_the_prompt_not_prompt_0(lm):
    """prompt(None) said "prompt 0 cannot be rendered" for the one prompt it was given; in a
    batch, the result's index says which."""
    with pytest.raises(ValueError, match=r"^the prompt cannot be rendered: ") as e:
        lm.prompt(None)
    assert "prompt 0" not in str(e.value)
    results = lm.batch_prompt(["fine", None])
    assert results[0].ok and results[1].index == 1
    assert results[1].error.startswith("the prompt cannot be rendered: ")


def test_repeated_greedy_prompts_are_computed_once_and_answered_alike(lm, messages):
    """A request's n choices at temperature 0 (and a batch's repeated rows) were each computed:
    in bfloat16 the first, whose prompt was computed in full, answered otherwise than the rest,
    which read it from the prefix cache. Each is now answered with one computation's result,
    its tokens streamed to each; a temperature above 0 still samples each."""
    engine = lm._service.engine
    prompts = [messages[0], messages[1], messages[0], messages[0], messages[1]]
    streamed: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    before = engine.stats.finished
    batch = lm.create_batch(prompts)
    batch.on_tokens(lambda i, ids: streamed[i].extend(ids))
    results = batch.start().wait()
    assert engine.stats.finished - before == 2
    assert [r.index for r in results] == list(range(5))
    assert results[0].text == results[2].text == results[3].text and results[1].text == results[4].text
    assert results[0].token_ids == results[3].token_ids and results[0].token_ids
    batch.wait()  # on_tokens has run: every prompt got its tokens
    assert all(streamed[i] == results[i].token_ids for i in range(5))
    results[0].token_ids.append(-1)  # each its own copy: changing one changes no other
    assert results[3].token_ids[-1] != -1 and results[2].token_ids[-1] != -1
    before = engine.stats.finished
    sampled = lm.batch_prompt([messages[0]] * 3, temperature=0.8, seed=1)
    assert engine.stats.finished - before == 3 and all(r.ok for r in sampled)
