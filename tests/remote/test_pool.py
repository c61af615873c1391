"""The pool behind the same API as the local engine, against two real servers."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

import batchprompt as bp
from batchprompt.remote import PoolError, map_gather, scatter_gather, tree_reduce

from .conftest import pool_of

SYSTEM = "You are a terse assistant. Answer in a few words."
PROMPTS = [f"What is the capital of country number {i}?" for i in range(10)] + ["Name a color.", "Name a fruit."]


def test_pool_answers_as_the_local_engine_does(two_servers, reference):
    """Same weights, float32, greedy: every answer equals the local engine's, in input order,
    and the pool sent fewer HTTP requests than prompts (sub-batches of token-id prompts)."""
    want = reference(PROMPTS, SYSTEM, max_tokens=12)
    with pool_of([s.url for s in two_servers]) as pool:
        lm = bp.LanguageModel.create(system=SYSTEM, model=pool, max_tokens=12)
        got = lm.batch_prompt(PROMPTS)
        assert [r.error for r in got] == [None] * len(PROMPTS)
        assert [r.text for r in got] == want
        assert all(r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0 for r in got)
        stats = pool.endpoint_stats()
        assert sum(e["prompts"] for e in stats) == len(PROMPTS)
        assert sum(e["requests"] for e in stats) < len(PROMPTS)
        assert all(e["token_ids"] is True for e in stats if e["requests"])


def test_logprobs_and_token_counts_through_our_servers(two_servers):
    """The pool asks for the generated token ids (return_token_ids, and with logprobs vLLM's
    return_tokens_as_token_ids): our server refused the latter, so every prompt that asked for
    logprobs failed; and without ids the text was encoded again, so ",,," made of three ","
    tokens counted 2 (SmolLM2 has a ",," token)."""
    with pool_of([s.url for s in two_servers]) as pool:
        lm = bp.LanguageModel.create(model=pool, max_tokens=3)
        got = lm.batch_prompt(PROMPTS[:3], logprobs=True)
        forced = lm.batch_prompt(["Say hi."], logit_bias={28: 100.0})[0]
        spaced = lm.batch_prompt(["Say hi."], stop=[" "], max_tokens=20)[0]
    assert spaced.finish_reason == "stop" and spaced.stop_reason == " ", spaced  # the server's stop_reason
    assert [r.error for r in got] == [None] * 3, got
    assert all(len(r.logprobs) == len(r.token_ids) == r.usage.completion_tokens >= 1 for r in got), got
    assert (forced.text, forced.token_ids, forced.usage.completion_tokens) == (",,,", [28, 28, 28], 3), forced


def test_streaming_callbacks_progress_and_order(two_servers, reference):
    want = reference(PROMPTS, SYSTEM, max_tokens=12)
    with pool_of([s.url for s in two_servers]) as pool:
        lm = bp.LanguageModel.create(system=SYSTEM, model=pool, max_tokens=12)
        seen, completed = [], threading.Event()
        batch = lm.create_batch(PROMPTS)
        batch.on_result(lambda i, r: seen.append(i)).on_complete(lambda rs: completed.set())
        streamed = dict(iter(batch))  # (index, result) as each completes
        assert completed.wait(60)
        assert sorted(seen) == list(range(len(PROMPTS)))
        assert [streamed[i].text for i in range(len(PROMPTS))] == want
        assert batch.progress.done == len(PROMPTS) and batch.progress.failed == 0


SHORT_AND_LONG = ["Reply with just the word yes.", "What is 2+2? Answer with a number only.", "Say hello.",
                  "Write a very long story about a dragon who learns to cook, with many chapters."]


def test_each_prompt_is_answered_as_it_finishes_not_when_its_request_ends(two_servers):
    """A sub-batch is asked as a stream: a prompt that ends early is answered while the
    request's long prompt still runs (the answers came all at once, when the request ended, so
    a job interrupted then lost them all)."""
    with pool_of([two_servers[0].url], min_batch_tokens=4096) as pool:
        lm = bp.LanguageModel.create(model=pool, max_tokens=200)
        batch = lm.create_batch(SHORT_AND_LONG)
        streamed = iter(batch)
        index, first = next(streamed)
        open_requests = pool.endpoint_stats()[0]["in_flight"]
        rest = dict(streamed)
        stats = pool.endpoint_stats()[0]
    assert index != 3 and first.finish_reason == "stop" and first.error is None
    assert open_requests == 1  # the request that holds the long prompt was still open
    assert rest[3].finish_reason == "length" and rest[3].usage.completion_tokens == 200
    assert stats["requests"] == 1 and stats["prompts"] == 4


def test_equal_endpoints_get_their_whole_share_in_the_first_requests(two_servers):
    """Work within the budget, equal endpoints: each gets its share at once, in as many requests
    as it may have in flight (initial_in_flight), which its server batches together. A second
    round of smaller requests after the first ones end would cost each server a second pass of
    decoding steps (the pool was 10-20% slower than one list request per endpoint)."""
    prompts = [f"Item {i}: say yes." for i in range(10, 34)]  # 24 prompts of equal length
    with pool_of([s.url for s in two_servers], min_batch_tokens=16, initial_in_flight=2) as pool:
        backend = pool.as_backend()
        lm = bp.LanguageModel.create(model=pool, max_tokens=4)
        assert len({len(backend.tokenizer.encode_prompt(p)) for p in prompts}) == 1
        assert [r.error for r in lm.batch_prompt(prompts)] == [None] * len(prompts)
        stats = pool.endpoint_stats()
        first_round = sum(e["requests"] for e in stats) - backend.hedges  # a hedge re-sends a late one
        assert first_round == 4, stats


def test_rows_that_cannot_share_a_request_still_fill_the_server(two_servers):
    """Rows whose parameters differ (a seed each, sampling) go one request each; the limit of 4
    requests per endpoint held a server to 4 of them at once, a 48-row job to 12 rounds. A
    one-prompt request now takes a sixteenth of a place."""
    prompts = [f"Item {i}: say yes." for i in range(48)]
    with pool_of([two_servers[0].url], max_in_flight=4, initial_in_flight=4) as pool:
        lm = bp.LanguageModel.create(model=pool, max_tokens=3, temperature=0.7)
        most, done = 0, threading.Event()

        def watch():
            nonlocal most
            while not done.is_set():
                most = max(most, pool.endpoint_stats()[0]["in_flight"])
                time.sleep(0.005)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            batches = [lm.create_batch([p], seed=i) for i, p in enumerate(prompts)]  # each its own seed
            for b in batches:
                b.start()
            results = [b.wait()[0] for b in batches]
        finally:
            done.set()
            watcher.join()
        stats = pool.endpoint_stats()[0]
    assert [r.error for r in results] == [None] * 48
    assert stats["requests"] >= 48 and most > 4, (most, stats)


def test_a_small_job_with_one_system_prompt_is_shared_and_computed_once(two_servers):
    """The least sub-batch (min_batch_tokens, 1,024) let the first request take most of a small
    job, and the prompts' shared system prompt drew the rest to the same endpoint (prefix
    affinity): 27 of 30 prompts went to one server, which then looked late beside the other's
    quick request, so they were sent again and computed twice (1.5x the tokens)."""
    prompts = [f"Item {i}: say yes or no, then explain why in one long sentence." for i in range(30)]
    before = [s.stats()["engine"]["generation_tokens"] for s in two_servers]
    with pool_of([s.url for s in two_servers]) as pool:
        lm = bp.LanguageModel.create(model=pool, max_tokens=16)
        got = lm.batch_prompt(prompts)
        stats = pool.endpoint_stats()
    assert [r.error for r in got] == [None] * 30
    generated = sum(s.stats()["engine"]["generation_tokens"] for s in two_servers) - sum(before)
    assert min(e["prompts"] for e in stats) >= 10, stats
    assert generated <= 1.15 * sum(r.usage.completion_tokens for r in got), (generated, stats)


def test_cancel_answers_every_prompt(two_servers):
    with pool_of([s.url for s in two_servers], batch_tokens=64) as pool:
        lm = bp.LanguageModel.create(model=pool, max_tokens=64)
        batch = lm.create_batch([f"Write a long story about the number {i}." for i in range(40)])
        batch.start()
        batch.cancel()
        results = batch.wait(timeout=120)
        assert len(results) == 40
        assert all(r.error is None or r.finish_reason == "cancelled" for r in results)
        assert any(r.finish_reason == "cancelled" for r in results)


def test_bp_shutdown_lets_go_of_a_pool_too(two_servers):
    """Its error said "pool.close() or bp.shutdown()", and bp.shutdown() released local engines only."""
    from batchprompt.api.result import EngineStoppedError

    with pool_of([two_servers[0].url]) as pool:
        lm = bp.LanguageModel.create(model=pool, max_tokens=2)
        assert lm.prompt("hi")
        assert bp.shutdown(timeout=60) >= 1
        with pytest.raises(EngineStoppedError, match="the endpoint pool was shut down"):
            lm.prompt("hi")
        assert bp.LanguageModel.create(model=pool, max_tokens=2).prompt("hi")  # a new session starts it again


def test_a_script_that_ends_while_its_batch_runs_on_a_pool_says_so(two_servers):
    """The exit did not stop the pool: its requests were dropped with the interpreter, and
    nothing said that the batch's prompts had no answers."""
    from tests.exit_script import end_while_a_batch_runs

    end_while_a_batch_runs("model=bp.EndpointPool(sys.argv[1:])", [s.url for s in two_servers], timeout=300)


def test_a_ctrl_c_in_batch_prompt_on_a_pool_is_no_forgotten_wait_at_exit(two_servers):
    """The exit after a Ctrl-C inside batch_prompt spoke of 8 prompts unfinished, "Call wait()"."""
    from tests.exit_script import interrupt_a_batch

    interrupt_a_batch("model=bp.EndpointPool(sys.argv[1:])", [s.url for s in two_servers], timeout=300)


def test_structured_output_goes_to_the_servers(two_servers, reference):
    with pool_of([s.url for s in two_servers]) as pool:
        lm = bp.LanguageModel.create(model=pool)
        labels = lm.batch_prompt(["Is the sky blue? Answer yes or no.", "Is fire cold? Answer yes or no."],
                                 choices=["yes", "no"])
        assert all(r.text in ("yes", "no") for r in labels), labels
        digits = lm.batch_prompt(["Give a number."], regex=r"[0-9]{3}")
        assert len(digits[0].text) == 3 and digits[0].text.isdigit(), digits
        people = lm.batch_prompt(["Describe a person."], max_tokens=64, json_schema={
            "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"]})
        assert people[0].error is None and set(people[0].parsed) == {"name", "age"}, people
        assert people[0].text == reference(["Describe a person."], max_tokens=64, json_schema={
            "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"]})[0]
        with pytest.raises(ValueError, match="choice_mode='decode'"):  # once, before any row is sent
            lm.batch_prompt(["Is it?"], choices=["yes", "no"], choice_mode="score")


def test_a_model_the_endpoints_do_not_serve_is_a_clear_error(two_servers):
    with pytest.raises(PoolError, match=r"does not serve the model 'llama-70b' \(it serves: smollm2-135m\)"):
        bp.EndpointPool([s.url for s in two_servers], model="llama-70b")


def test_no_endpoint_answering_is_a_clear_error_after_give_up_after():
    from .fault_proxy import free_port

    t0 = time.monotonic()
    with pytest.raises(PoolError, match=r"none of the 2 endpoints answered GET /v1/models in 1s \(give_up_after\)"):
        bp.EndpointPool([f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"], give_up_after=1)
    assert 1 <= time.monotonic() - t0 < 30


def test_an_endpoint_that_takes_connections_but_never_answers_waits_no_longer_than_give_up_after():
    """Each probe's wait is cut to the time left (a probe waited 10 s, past give_up_after=2)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        t0 = time.monotonic()
        with pytest.raises(PoolError, match=r"in 2s \(give_up_after\)"):
            bp.EndpointPool([f"127.0.0.1:{listener.getsockname()[1]}"], give_up_after=2)
        assert time.monotonic() - t0 < 8


@pytest.mark.parametrize("fault", ["404", "tls"])
def test_an_endpoint_that_cannot_serve_is_an_error_at_once(fault):
    """A base URL with the wrong path (the server answers 404) or https to a plain-HTTP server
    waited all of give_up_after (120 s by default), then said "start the servers"."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class NotFound(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        scheme = "http" if fault == "404" else "https"
        t0 = time.monotonic()
        with pytest.raises(PoolError, match="waiting will not change that") as e:
            bp.EndpointPool([f"{scheme}://127.0.0.1:{server.server_address[1]}/v2"], give_up_after=30)
        assert time.monotonic() - t0 < 20
        assert ("HTTP 404" if fault == "404" else "SSL") in str(e.value), e.value
    finally:
        server.shutdown()
        server.server_close()


def test_a_pool_started_before_its_server_answers_waits_for_it(proxy):
    """Servers still loading when the pool starts (started together): the pool waits up to
    give_up_after for one to answer. It failed at once, though work waits that long."""
    proxy.set_down(True)
    threading.Timer(2.0, proxy.set_down, (False,)).start()
    t0 = time.monotonic()
    with pool_of([proxy.url], give_up_after=60) as pool:
        assert time.monotonic() - t0 >= 1.5
        lm = bp.LanguageModel.create(model=pool, max_tokens=2)
        assert lm.batch_prompt(["1, 2, 3,"])[0].ok
        lm.destroy()


def test_bad_hostfile_names_the_line(tmp_path):
    from batchprompt.remote import HostfileError

    f = tmp_path / "hosts"
    f.write_text("# servers\n127.0.0.1:8000 weight=2\nnode-2\n")
    with pytest.raises(HostfileError, match=r"hosts:3: 'node-2' has no port; give host:port"):
        bp.EndpointPool(f)


def test_aurora_methods(two_servers, reference):
    prompts = ["Name a color.", "Name a fruit.", "Name a tree.", "Name a river."]
    want = reference(prompts, max_tokens=8)

    async def go(pool):
        batched = await pool.send_all_batched(prompts, max_tokens=8)
        direct = await pool.post_batch(1, prompts, max_tokens=8)
        gathered = await scatter_gather(pool, prompts, max_tokens=8)
        mapped = await map_gather(pool, ["color", "fruit"], "Name a {item}.", max_tokens=8)
        chats = await pool.send_all(prompts[:2], max_tokens=8)
        reduced = await tree_reduce(pool, "Name a {item}.", "Join these: {responses}", fanin=2,
                                    items=["color", "fruit", "tree"], max_tokens=8)
        return batched, direct, gathered, mapped, chats, reduced

    with pool_of([s.url for s in two_servers]) as pool:
        batched, direct, gathered, mapped, chats, reduced = asyncio.run(go(pool))
    assert [r.text for r in batched] == want and all(r.success for r in batched)
    assert [r.text for r in direct] == want and {r.agent_index for r in direct} == {1}
    assert [r.text for r in gathered] == want
    assert [r.text for r in mapped] == want[:2]
    assert all(r.success and r.text for r in chats)  # chat completions: the server renders the template
    assert reduced.success and reduced.text


def test_an_endpoint_down_at_start_is_taken_in_when_it_answers(two_servers, proxy, caplog):
    import logging

    proxy.set_down(True)
    with caplog.at_level(logging.WARNING, logger="batchprompt"), \
            pool_of([two_servers[0].url, proxy.url], give_up_after=30, min_batch_tokens=64) as pool:
        lm = bp.LanguageModel.create(model=pool, max_tokens=4)
        assert [r.error for r in lm.batch_prompt(PROMPTS[:4])] == [None] * 4
        warned = [m for m in caplog.messages if proxy.url in m]
        assert len(warned) == 1 and "starts as down" in warned[0], warned  # said once, not twice
        assert [e["alive"] for e in pool.endpoint_stats()] == [True, False]
        proxy.set_down(False)
        t_end = time.monotonic() + 30  # the probe backs off to one try in 10s
        while not pool.endpoint_stats()[1]["alive"]:
            assert time.monotonic() < t_end, "the endpoint was not taken in within 30s"
            time.sleep(0.2)
        before = proxy.requests["POST /v1/completions"]
        assert [r.error for r in lm.batch_prompt(PROMPTS)] == [None] * len(PROMPTS)
        assert proxy.requests["POST /v1/completions"] > before  # it gets work again


def test_every_endpoint_down_mid_run_says_so_and_ends_within_give_up_after(two_servers, proxy, caplog):
    """The only endpoint dies mid-batch: one warning says that no endpoint is left and how long
    the work waits (the old message promised 'the others'), and every prompt ends with an error
    within give_up_after, not a wait without end."""
    import logging

    with pool_of([proxy.url], give_up_after=3, max_retries=10) as pool:
        lm = bp.LanguageModel.create(model=pool, max_tokens=4)
        assert lm.prompt("Say yes.")  # the endpoint answers
        proxy.set_down(True)
        with caplog.at_level(logging.WARNING, logger="batchprompt"):
            t0 = time.monotonic()
            results = lm.batch_prompt(PROMPTS)
            took = time.monotonic() - t0
        assert took < 60
        assert all(r.error and "no endpoint of the pool answered for 3s" in r.error for r in results), results[0]
        assert all(r.retryable for r in results)  # not the prompts' fault: a job runs them again
        assert any("no endpoint of the pool is left" in m and "3s" in m for m in caplog.messages), caplog.messages
        assert not any("goes to the others" in m for m in caplog.messages)
        assert results[0].error.count(proxy.url) == 1, results[0].error  # the endpoint named once
        # Work submitted after the pool gave up waits give_up_after again (it failed at once).
        t0 = time.monotonic()
        again = lm.batch_prompt(PROMPTS[:2])
        assert time.monotonic() - t0 >= 2.9
        assert all(r.retryable for r in again)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0, -1, True, "5"])
def test_a_wait_that_never_ends_or_is_no_number_is_refused(value):
    """give_up_after=nan compared false with everything, so the pool never gave up."""
    with pytest.raises(ValueError, match=r"give_up_after must be a finite number of seconds > 0"):
        bp.EndpointPool(["127.0.0.1:9"], give_up_after=value)


def test_an_answer_that_breaks_its_schema_fails_alone_as_invalid_output_through_a_pool(two_servers):
    """A sub-batch of one prompt (here each prompt its own request) was a request of one choice
    to our server, which answered its bad JSON with a 400 or an error event: the pool's error
    was the request's ("error in the stream: ..."), and a row's n > 1 lost its good samples. A
    list of prompts, even of one, is answered choice by choice; the pool checks the text."""
    from batchprompt.jobs import openai_io

    with pool_of([two_servers[0].url], use_batch=False) as pool:
        lm = bp.LanguageModel.create(model=pool, max_tokens=16)
        got = lm.batch_prompt(["A date?", "Another date?"], json_schema={"const": "2023-02-29", "format": "date"})
    for r in got:
        assert r.text == '"2023-02-29"' and r.error.startswith(openai_io.INVALID_OUTPUT), r
