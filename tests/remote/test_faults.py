"""Faults, against real servers: a proxy of ours injecting 500s, 429s, dropped connections and
delays in front of one; a prompt one server refuses; a server killed (-9) mid-batch."""
from __future__ import annotations

import asyncio
import re
import signal
import time

import batchprompt as bp
from tests.server.conftest import stop_server

from .conftest import pool_of, start_servers

PROMPTS = [f"Say the number {i} in words." for i in range(16)]


def test_injected_faults_are_retried_and_every_answer_is_right(two_servers, proxy, reference):
    """Every planned fault is met (the proxy is the pool's only endpoint, so no other endpoint
    can take the work before the faults come up), each is retried, and no prompt completes twice."""
    want = reference(PROMPTS, max_tokens=6)
    planned = {"500": 2, "429": 2, "drop": 2, "503": 1, "delay:0.5": 1}
    for fault, count in planned.items():
        proxy.plan(fault, count)
    with pool_of([proxy.url], min_batch_tokens=32, backoff_s=0.05, max_retries=len(planned) * 2) as pool:
        lm = bp.LanguageModel.create(model=pool, max_tokens=6)
        got = lm.batch_prompt(PROMPTS)
        stats = pool.endpoint_stats()
    assert [r.error for r in got] == [None] * len(PROMPTS)
    assert [r.text for r in got] == want
    assert dict(proxy.faults_done) == planned
    # every prompt completed exactly once on the server: the failed tries never completed
    assert stats[0]["prompts"] == len(PROMPTS)
    assert stats[0]["overloaded"] == 3  # the 429s and the 503


def test_faults_on_one_endpoint_leave_the_work_to_the_other(two_servers, proxy, reference):
    want = reference(PROMPTS, max_tokens=6)
    proxy.plan("500", 1000)  # the proxied endpoint answers every POST with a 500
    with pool_of([two_servers[0].url, proxy.url], min_batch_tokens=32, backoff_s=0.05) as pool:
        lm = bp.LanguageModel.create(model=pool, max_tokens=6)
        got = lm.batch_prompt(PROMPTS)
        stats = pool.endpoint_stats()
    assert [r.error for r in got] == [None] * len(PROMPTS)
    assert [r.text for r in got] == want
    assert proxy.faults_done["500"] >= 1 and stats[1]["prompts"] == 0
    assert stats[0]["prompts"] == len(PROMPTS)


def test_a_retry_avoids_every_endpoint_that_failed_it(two_servers, proxy, reference):
    """Beside a healthy server, one answering 500 and one answering 429 to everything: a retry
    avoided only the endpoint that failed it last, so prompts bounced between the two failing
    ones until their tries ran out ("failed after 3 tries ... HTTP 500")."""
    from .fault_proxy import FaultProxy

    want = reference(PROMPTS, max_tokens=6)
    busy = FaultProxy(two_servers[1].url)
    try:
        proxy.plan("500", 10_000)
        busy.plan("429", 10_000)
        with pool_of([two_servers[0].url, proxy.url, busy.url], min_batch_tokens=32, backoff_s=0.01,
                     max_retries=2, batch_prompts=1) as pool:
            got = bp.LanguageModel.create(model=pool, max_tokens=6).batch_prompt(PROMPTS)
    finally:
        busy.close()
    assert [r.error for r in got] == [None] * len(PROMPTS)
    assert [r.text for r in got] == want


def test_an_endpoint_that_keeps_failing_leaves_its_prompts_retryable(proxy):
    """Tries spent on 5xx answers are the endpoint's fault, not the prompt's: the result is
    `.retryable` (so `batchprompt run` leaves the row unjournaled, to run again); it was a final
    error, which `run` journaled as the request's own invalid_request."""
    proxy.plan("500", 1000)
    with pool_of([proxy.url], backoff_s=0.01, max_retries=1) as pool:
        got = bp.LanguageModel.create(model=pool, max_tokens=2).batch_prompt(PROMPTS[:2])
    assert [r.retryable for r in got] == [True, True], got
    assert all("failed after 2 tries" in r.error and "HTTP 500" in r.error for r in got), got


def test_an_endpoint_answering_500_to_everything_fails_its_work_soon_and_says_so(proxy, caplog):
    """With the default tries and backoff, 30 prompts on an endpoint that answers every request
    with a 500 failed after 150 s, and nothing was logged meanwhile: each failed sub-batch in
    flight raised the endpoint's backoff, which reached its 30 s cap within a few. The backoff now
    follows each prompt's own tries (0.5 s, 1, 2, 4: about 8 s in all), and a warning names it."""
    proxy.plan("500", 10_000)
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="batchprompt"), pool_of([proxy.url]) as pool:
        got = bp.LanguageModel.create(model=pool, max_tokens=2).batch_prompt([f"Say hi #{i}" for i in range(30)])
    took = time.monotonic() - t0
    assert all(r.retryable and "failed after 5 tries" in r.error and "HTTP 500" in r.error for r in got), got[0]
    assert took < 60, took  # a bound on waiting (it was 150 s), not a speed figure
    assert any("answered its last 3 requests with an error of its own" in m for m in caplog.messages), caplog.messages


def test_give_up_after_bounds_the_tries_of_work_that_keeps_failing(proxy):
    """give_up_after bounded only the wait while no endpoint was alive: an endpoint that is up
    but answers 500 kept its prompts for all their tries (here 50)."""
    proxy.plan("500", 10_000)
    t0 = time.monotonic()
    with pool_of([proxy.url], backoff_s=0.5, max_retries=50, give_up_after=3) as pool:
        got = bp.LanguageModel.create(model=pool, max_tokens=2).batch_prompt(PROMPTS[:2])
    assert all(r.retryable and r.error.startswith("gave up after ") and "give_up_after 3s" in r.error
               for r in got), got
    assert time.monotonic() - t0 < 60


def test_give_up_after_bounds_the_wait_for_an_endpoint_that_keeps_saying_it_is_busy(proxy):
    """A 429 with Retry-After 30 to everything, give_up_after 3: the prompts failed only at their
    next try, 30 s on (the helper's run: 64 s for give_up_after 30), as the endpoint's backoff."""
    proxy.plan("429:30", 10_000)
    t0 = time.monotonic()
    with pool_of([proxy.url], backoff_s=0.05, give_up_after=3) as pool:
        got = bp.LanguageModel.create(model=pool, max_tokens=2).batch_prompt(PROMPTS[:2])
    took = time.monotonic() - t0
    assert all(r.retryable and "give_up_after 3s" in r.error and "backed off for" in r.error for r in got), got
    assert took < 20, took


def test_a_timeout_is_retried(two_servers, proxy, reference):
    want = reference(PROMPTS[:4], max_tokens=4)
    proxy.plan("delay:30", 1)  # the first request hangs past the timeout; the retry is answered
    with pool_of([proxy.url], timeout=6, backoff_s=0.05) as pool:
        lm = bp.LanguageModel.create(model=pool, max_tokens=4)
        got = lm.batch_prompt(PROMPTS[:4])
        stats = pool.endpoint_stats()
    assert [r.text for r in got] == want
    assert stats[0]["errors"] == 1 and stats[0]["prompts"] == 4


def test_an_endpoint_that_never_answers_is_named_and_its_prompts_fail_in_bounded_time(proxy, caplog):
    """A server that takes requests and never answers kept the caller waiting in silence (the
    timeout, 300 s by default, per try), and the error said "failed for 10s" of tries that took
    40 s. A warning names it at its first timeout; the error gives the real time."""
    proxy.plan("delay:120", 10_000)
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="batchprompt"), pool_of([proxy.url], timeout=2, backoff_s=0.05,
                                                                   give_up_after=1) as pool:
        got = bp.LanguageModel.create(model=pool, max_tokens=2).batch_prompt(PROMPTS[:2])
    assert time.monotonic() - t0 < 60  # a bound on waiting, not a speed figure
    assert all(r.retryable and r.error for r in got), got
    assert any("never answers?" in m and "no answer within 2s" in m for m in caplog.messages), caplog.messages


def test_an_aurora_post_that_times_out_on_every_try_says_how_many_and_how_long(proxy):
    """`post` and `post_batch` to a hanging endpoint took every try's timeout and its backoff
    (33 s for timeout=5), and the error named only the 5 s of the last try."""
    proxy.plan("delay:60", 10)

    async def go(pool):
        return await pool.post(0, "Name a color.", max_tokens=2), await pool.post_batch(0, ["Hi."], max_tokens=2)

    with pool_of([proxy.url], timeout=1, backoff_s=0.05, max_retries=2) as pool:
        one, (batched,) = asyncio.run(go(pool))
    for r in (one, batched):
        assert not r.success
        assert re.search(r"no answer within 1s .*\(the last of 3 tries over [3-9]s\)", r.error), r.error


def test_an_endpoint_whose_models_answer_and_whose_requests_hang_is_named_once_not_at_each_return(proxy, caplog):
    """Its GET /v1/models answered, so it was taken back each time (within a second), timed out
    again and went down again: two warnings a cycle for as long as the run lasted."""
    proxy.plan("delay:120", 10_000)  # every POST hangs; GET /v1/models is forwarded
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="batchprompt"), pool_of([proxy.url], timeout=1, backoff_s=0.05,
                                                                   max_retries=100, give_up_after=15) as pool:
        got = bp.LanguageModel.create(model=pool, max_tokens=2).batch_prompt(PROMPTS[:2])
        stats = pool.endpoint_stats()
    assert time.monotonic() - t0 < 90  # a bound on waiting, not a speed figure
    assert all(r.retryable and r.error for r in got), got
    about = [m for m in caplog.messages if proxy.url in m]
    assert sum("is down again" in m for m in about) == 1, about
    assert stats[0]["revivals"] >= 1 and len(about) <= 4, (stats, about)


def test_a_late_sub_batch_is_hedged_on_an_idle_endpoint(two_servers, proxy, reference):
    """Nothing queued, one endpoint idle, a sub-batch late on the other: it is sent again to the
    idle one, the first answer wins and the late request is cancelled (no error, no retry)."""
    want = reference(PROMPTS[:8], max_tokens=4)
    proxy.plan("delay:60", 1)
    with pool_of([proxy.url, two_servers[0].url], min_batch_tokens=16) as pool:
        lm = bp.LanguageModel.create(model=pool, max_tokens=4)
        got = lm.batch_prompt(PROMPTS[:8])  # would take 60 s without the hedge
        stats = pool.endpoint_stats()
        hedges = pool.as_backend().hedges
    assert [r.text for r in got] == want
    assert stats[0]["errors"] == 0 and stats[0]["prompts"] + stats[1]["prompts"] == 8
    assert proxy.faults_done["delay:60"] == 1 and hedges >= 1


def test_one_bad_prompt_fails_alone(two_servers, reference):
    """The servers hold 512 tokens: a longer prompt is refused (400) in a sub-batch with good
    ones; the sub-batch is split until it fails alone, with the server's message."""
    long = "word " * 700
    prompts = PROMPTS[:5] + [long] + PROMPTS[5:8]
    want = reference(PROMPTS[:8], max_tokens=4)
    with pool_of([s.url for s in two_servers]) as pool:
        lm = bp.LanguageModel.create(model=pool, max_tokens=4)
        got = lm.batch_prompt(prompts)
    assert got[5].error is not None and "context holds 512" in got[5].error, got[5]
    assert [r.text for i, r in enumerate(got) if i != 5] == want
    assert all(r.error is None for i, r in enumerate(got) if i != 5)


def test_a_4xx_of_one_endpoint_is_asked_of_another_before_its_prompt_fails(two_servers, proxy, reference, caplog):
    """An endpoint answering 404 (a proxy's wrong route) or 422 to everything, beside a healthy
    one: each prompt it refused failed for good (journaled in `run`), silently. Another endpoint
    is asked once, and a prompt both refuse gives both answers (the second hid the first's
    reason); three refusals in a row are a warning. A 408 is the endpoint's being busy."""
    want = reference(PROMPTS[:8], max_tokens=4)
    for fault in ("404", "422", "408"):
        proxy.clear()
        proxy.plan(fault, 1000)
        with caplog.at_level("WARNING", logger="batchprompt"):
            with pool_of([two_servers[0].url, proxy.url], use_batch=False, backoff_s=0.05) as pool:
                lm = bp.LanguageModel.create(model=pool, max_tokens=4)
                got = lm.batch_prompt(PROMPTS[:8])
                bad = lm.batch_prompt(PROMPTS[:4], logit_bias={999999: 5.0})  # refused by every server
        assert [r.error for r in got] == [None] * 8, (fault, got)
        assert [r.text for r in got] == want
        assert proxy.faults_done[fault] >= 1, fault
        if fault != "408":
            refused = [r.error for r in bad if f"HTTP {fault}" in r.error]
            assert refused and all("outside the vocabulary" in r for r in refused), bad
            assert f"{proxy.url}/v1/completions: HTTP {fault}" in caplog.text and "refused its last 3" in caplog.text
        caplog.clear()


def test_prompts_sent_as_ids_before_the_endpoint_was_known_to_refuse_them_go_again_as_text(proxy, reference,
                                                                                          caplog):
    """A server that takes text only, refusing the later id requests after the first one's text
    answer set the endpoint text-only: each of those failed as its prompt's own fault, and the
    warning came once per request."""
    want = reference(PROMPTS[:8], max_tokens=4)
    proxy.refuse_ids = 3.0
    with caplog.at_level("WARNING", logger="batchprompt"):
        with pool_of([proxy.url], use_batch=False) as pool:
            lm = bp.LanguageModel.create(model=pool, max_tokens=4)
            got = lm.batch_prompt(PROMPTS[:8])
    assert [r.error for r in got] == [None] * 8, got
    assert [r.text for r in got] == want
    assert proxy.ids_refused >= 2  # some were in flight as ids when the first learnt it
    assert sum("refuses token-id prompts" in r.getMessage() for r in caplog.records) == 1, caplog.text


def test_a_server_killed_mid_batch_leaves_the_batch_to_the_others(tmp_path, reference):
    prompts = [f"Write one sentence about the number {i}." for i in range(24)]
    want = reference(prompts, max_tokens=24)
    servers = start_servers(tmp_path, 2)
    try:
        with pool_of([s.url for s in servers], min_batch_tokens=64, backoff_s=0.05) as pool:
            lm = bp.LanguageModel.create(model=pool, max_tokens=24)
            batch = lm.create_batch(prompts)
            batch.start()
            # Killed while it holds rows (a request in flight for a second): killed once it had
            # answered its whole share, nothing of the pool would ever fail on it.
            held_since, deadline = None, time.monotonic() + 300
            while held_since is None or time.monotonic() - held_since < 1.0:
                assert time.monotonic() < deadline, "the second server got no work within 300s"
                assert not batch.done, "the batch ended before the second server held a request"
                held = pool.endpoint_stats()[1]["in_flight"] > 0
                held_since = (held_since or time.monotonic()) if held else None
                time.sleep(0.01)
            servers[1].proc.send_signal(signal.SIGKILL)
            results = batch.wait(timeout=600)
            stats = pool.endpoint_stats()
        assert [r.error for r in results] == [None] * len(prompts)
        assert [r.text for r in results] == want
        assert stats[1]["alive"] is False and stats[1]["deaths"] == 1
        assert sum(e["prompts"] for e in stats) == len(prompts)  # none completed twice
    finally:
        for s in servers:
            stop_server(s)
