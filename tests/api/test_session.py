"""Sessions: results in order, the pinned system prompt, clone, destroy, options, errors."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

import batchprompt as bp

from ..conftest import SPAM_SYSTEM

pytestmark = pytest.mark.slow


def test_results_come_back_in_input_order_with_usage(lm, messages):
    results = lm.batch_prompt(messages[:8])
    assert [r.index for r in results] == list(range(8))
    for r in results:
        assert r.ok and r.finish_reason in ("stop", "length") and str(r) == r.text
        assert r.usage.completion_tokens == len(r.token_ids) <= 6
        # every prompt found the session's system prompt in the cache
        assert r.usage.cached_tokens >= lm.pinned_tokens > 0
        assert r.usage.prompt_tokens > r.usage.cached_tokens


def test_batch_equals_one_at_a_time_greedy(lm, messages):
    batched = lm.batch_prompt(messages[:12])
    alone = [lm.prompt(m) for m in messages[:12]]
    assert [r.text for r in batched] == alone


def test_the_system_prompt_is_pinned_while_the_session_lives(engine32):
    lm = bp.LanguageModel.create(system=SPAM_SYSTEM + " Be brief.", model=engine32)
    pins = engine32.kv.pins
    name = lm._name
    assert lm.pinned_tokens == len(pins[name]) * engine32.config.block_size
    assert lm.pinned_tokens >= len(lm.prefix_token_ids) - engine32.config.block_size + 1
    blocks = [b.block_id for b in pins[name]]
    assert all(b.ref_count >= 1 for b in pins[name])
    other = lm.clone()
    assert [b.block_id for b in pins[other._name]] == blocks  # shared, not recomputed
    lm.destroy()
    assert name not in _pins_after_commands(lm, engine32)
    assert other.prompt("hello", max_tokens=2)  # the clone lives on
    with pytest.raises(bp.SessionDestroyedError, match="destroyed"):
        lm.prompt("hello")
    with pytest.raises(bp.SessionDestroyedError):
        lm.batch_prompt(["hello"])
    other.destroy()
    assert other._name not in _pins_after_commands(other, engine32)


def _pins_after_commands(session, engine):
    session._service.call(lambda: None).result()  # unpin runs on the engine thread
    return engine.kv.pins


def test_initial_prompts_and_message_prompts(engine32):
    shots = [{"role": "system", "content": SPAM_SYSTEM},
             {"role": "user", "content": "WIN a free cruise! Text YES now"},
             {"role": "assistant", "content": "spam"}]
    with bp.LanguageModel.create(initial_prompts=shots, model=engine32, max_tokens=3) as lm:
        assert lm.system == SPAM_SYSTEM
        as_text = lm.prompt("are you coming tonight?")
        as_messages = lm.prompt([{"role": "user", "content": "are you coming tonight?"}])
        assert as_text == as_messages
        # A prompt's own system message replaces the session's; the other initial turns stay.
        own = [{"role": "system", "content": "Answer in French."},
               {"role": "user", "content": "are you coming tonight?"}]
        replaced = lm.prompt(own)
    with bp.LanguageModel.create(initial_prompts=[own[0]] + shots[1:], model=engine32, max_tokens=3) as ref:
        assert replaced == ref.prompt(own[1:])
        assert ref.system == "Answer in French."
    with pytest.raises(ValueError, match="not both"):
        bp.LanguageModel.create(system="a", initial_prompts=shots, model=engine32)
    # a string was read as a list of one-letter messages ("message 0 ... got 'h'")
    with pytest.raises(ValueError, match=r"initial_prompts is a list of messages .* got str 'hello'; for one "
                                         r"system prompt, give system="):
        bp.LanguageModel.create(initial_prompts="hello", model=engine32)


def test_options_per_session_and_per_call(lm, messages):
    r = lm.batch_prompt(messages[:2], max_tokens=2)
    assert all(x.usage.completion_tokens <= 2 for x in r)
    r = lm.batch_prompt(messages[:1], logprobs=True)[0]
    assert len(r.logprobs) == len(r.token_ids) and all(lp <= 0 for lp in r.logprobs)
    with pytest.raises(TypeError, match="unknown option.*max_token"):
        lm.batch_prompt(messages[:1], max_token=3)
    with pytest.raises(ValueError, match="temperature"):
        lm.batch_prompt(messages[:1], temperature=-1)
    with pytest.raises(ValueError, match="errors must be"):
        lm.batch_prompt(messages[:1], errors="ignore")
    with pytest.raises(TypeError, match="list of prompts"):
        lm.batch_prompt("one string")


def test_seeded_sampling_is_reproducible_in_any_batch(lm, messages):
    a = lm.batch_prompt(messages[:6], temperature=1.0, seed=7)
    b = lm.batch_prompt(messages[3:6], temperature=1.0, seed=7)
    assert [r.text for r in a[3:]] == [r.text for r in b]


def test_a_failed_item_does_not_disturb_the_others(lm, messages):
    too_long = "word " * 9000
    prompts = [messages[0], [{"role": 1}], messages[1], too_long, messages[2]]
    results = lm.batch_prompt(prompts)
    assert [r.ok for r in results] == [True, False, True, False, True]
    assert "role" in results[1].error and "shorten the prompt" in results[3].error
    assert results[0].text == lm.prompt(messages[0])
    with pytest.raises(bp.BatchError, match=r"2 of 5 prompts failed, at indices \[1, 3\]") as info:
        lm.batch_prompt(prompts, errors="raise")
    assert [r.ok for r in info.value.results] == [True, False, True, False, True]
    with pytest.raises(ValueError, match="shorten"):
        lm.prompt(too_long)


def test_a_conversation_the_chat_template_refuses_fails_alone(engine32):
    """Llama-2 / Mistral / Gemma templates raise on some conversations (roles that do not
    alternate): the TemplateError sank the whole call, the other prompts' results lost."""
    from ..jobs.test_run_faults import ALTERNATING_TEMPLATE

    hf = engine32.tokenizer.hf
    original = hf.chat_template
    hf.chat_template = ALTERNATING_TEMPLATE
    try:
        with bp.LanguageModel.create(model=engine32, max_tokens=2) as lm:
            user = [{"role": "user", "content": "Hello"}, {"role": "user", "content": "again"}]
            results = lm.batch_prompt(["Hello", user, "Bye"])
            with pytest.raises(ValueError, match="Conversation roles must alternate"):
                lm.prompt(user)
    finally:
        hf.chat_template = original
    assert [r.ok for r in results] == [True, False, True], results
    assert "Conversation roles must alternate" in results[1].error


def test_top_level_batch_prompt(engine32, messages):
    results = bp.batch_prompt(messages[:3], system=SPAM_SYSTEM, model=engine32, max_tokens=6)
    with bp.LanguageModel.create(system=SPAM_SYSTEM, model=engine32, max_tokens=6) as lm:
        assert [r.text for r in results] == [r.text for r in lm.batch_prompt(messages[:3])]


def test_unknown_model_is_a_clear_error():
    with pytest.raises(bp.ModelNotFoundError, match="unknown model 'no-such-model'"):
        bp.LanguageModel.create(model="no-such-model")


def test_a_prompt_of_the_wrong_type_fails_alone_naming_what_a_prompt_is(lm):
    results = lm.batch_prompt(["hi", None, 5, {"role": "user", "content": "x"}, b"hi"], max_tokens=2)
    assert results[0].ok
    for r, got in zip(results[1:3], ("NoneType: None", "int: 5")):
        assert f"a prompt is a string or a list of chat messages, got {got}" in r.error
    assert "this is one message: put it in a list" in results[3].error
    assert "got bytes: b'hi'" in results[4].error



def test_prompt_streaming_hands_out_the_text_in_pieces_as_it_is_made(lm, engine32):
    ask = "Write two sentences about the sea."
    whole = lm.prompt(ask, max_tokens=24)
    pieces = list(lm.prompt_streaming(ask, max_tokens=24))
    assert "".join(pieces) == whole and len(pieces) >= 8, pieces
    # with a stop string: what the stop cuts is never handed out
    stop = whole.split(" ")[4][:3]
    cut = lm.prompt(ask, max_tokens=24, stop=[stop])
    assert "".join(lm.prompt_streaming(ask, max_tokens=24, stop=[stop])) == cut


def test_leaving_a_prompt_stream_early_cancels_it(lm, engine32):
    stream = lm.prompt_streaming("Count from one to a hundred in words.", max_tokens=200)
    first = next(stream)
    assert first
    stream.close()  # as a `break` out of the loop does
    deadline = time.monotonic() + 30
    while engine32.has_unfinished():  # the request is aborted at the next step, not run to its end
        assert time.monotonic() < deadline, "the abandoned stream's request still runs"
        time.sleep(0.05)


def test_a_blocked_callback_of_another_batch_does_not_hold_up_a_stream(lm):
    """Streams took their pieces through the process's one callback thread: a user's on_result
    that blocked (a slow write) froze every prompt_streaming and aprompt_streaming until it
    returned, sessions without callbacks included."""
    release = threading.Event()
    held = threading.Event()

    def slow(index, result):
        held.set()
        release.wait(60)

    other = lm.create_batch(["Hi"], max_tokens=2)
    other.on_result(slow)
    other.start()
    try:
        assert held.wait(60), "the other batch's callback never ran"
        t0 = time.monotonic()
        pieces = list(lm.prompt_streaming("Write two sentences about the sea.", max_tokens=12))
        assert pieces and time.monotonic() - t0 < 30

        async def run():
            return [p async for p in lm.aprompt_streaming("Say hello.", max_tokens=6)]

        assert asyncio.run(asyncio.wait_for(run(), 30))
        assert not release.is_set() and held.is_set()  # all of it while the callback still blocked
    finally:
        release.set()
    other.wait(60)


def test_a_prompt_stream_that_fails_raises(lm):
    with pytest.raises(ValueError, match="context"):
        list(lm.prompt_streaming("word " * 9000))


def test_aprompt_streaming(lm):
    async def run():
        return [p async for p in lm.aprompt_streaming("Say hello.", max_tokens=12)]

    pieces = asyncio.run(run())
    assert "".join(pieces) == lm.prompt("Say hello.", max_tokens=12) and len(pieces) >= 2


@pytest.mark.parametrize("system", [5, ["a"], b"x"])
def test_a_system_prompt_that_is_not_text_is_refused_by_name(system):
    # It met the chat template: a Jinja TypeError ("can only concatenate str"), or bytes taken.
    with pytest.raises(TypeError, match=f"system must be a string \\(the system prompt\\), got {type(system).__name__}"):
        bp.LanguageModel.create(system=system)
    with pytest.raises(TypeError, match="system must be a string"):
        bp.batch_prompt(["hi"], system=system)


def test_destroy_cancels_the_sessions_running_and_unstarted_batches(engine32, messages):
    """As the Prompt API's destroy() aborts the session's prompts: they ran to the end before,
    and a batch made before destroy() ran on the destroyed session when started."""
    lm = bp.LanguageModel.create(system=SPAM_SYSTEM, model=engine32)
    running = lm.create_batch(messages[:6], max_tokens=60, min_tokens=60).start()
    unstarted = lm.create_batch(messages[:2], max_tokens=4)
    one = {}
    caller = threading.Thread(target=lambda: one.update(got=_raised(lm.prompt, messages[7], max_tokens=60,
                                                                      min_tokens=60)), daemon=True)
    caller.start()
    deadline = time.monotonic() + 30
    while len(lm._batches) < 3 or not engine32.scheduler.running:
        assert time.monotonic() < deadline, "the work never started"
        time.sleep(0.01)
    lm.destroy()
    results = running.wait(timeout=60)
    assert {r.finish_reason for r in results} <= {"cancelled", "length"} and any(
        r.finish_reason == "cancelled" and "session was destroyed" in r.error for r in results), results
    assert {(r.finish_reason, r.error) for r in unstarted.start().wait(timeout=10)} == {
        ("cancelled", "cancelled: the session was destroyed")}
    caller.join(60)
    assert isinstance(one.get("got"), bp.SessionDestroyedError), one


def _raised(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        return e
    return None


def test_priority_must_be_an_int(lm):
    """It was taken, and every prompt then failed with int()'s error and a logged traceback."""
    with pytest.raises(TypeError, match="priority must be an int"):
        lm.create_batch(["a", "b"], priority="high")


def test_what_is_not_a_list_of_prompts_is_named(lm):
    """None was "'NoneType' object is not iterable"; a string's message named a prompt() that
    the module does not have."""
    for bad, named in ((None, "NoneType"), ("abc", "str 'abc'"), ({"role": "user", "content": "x"}, "dict"),
                       (b"abc", "bytes b'abc'")):  # bytes were iterated as ints: one error per byte
        with pytest.raises(TypeError, match=f"a batch takes a list of prompts, got {named}.*give \\[prompt\\]"):
            lm.batch_prompt(bad)
        with pytest.raises(TypeError, match="a batch takes a list of prompts"):  # it said "batch_prompt takes"
            lm.create_batch(bad)
    with pytest.raises(TypeError, match="a set has none: give a list"):  # it ran in an order nobody chose
        lm.batch_prompt({"a", "b"})


def test_choice_mode_without_choices_is_refused_and_a_calls_other_constraint_drops_the_sessions_mode(lm):
    """choice_mode="score" without choices was ignored: the prompt came back as free text."""
    with pytest.raises(ValueError, match="choice_mode='score' picks among choices: give choices"):
        lm.batch_prompt(["Is it?"], choice_mode="score")
    scoring = bp.LanguageModel.create(model=lm.engine, choices=["yes", "no"], choice_mode="score", max_tokens=4)
    try:
        assert scoring.batch_prompt(["Is it?"])[0].choice_probs
        assert scoring.batch_prompt(["Give a digit."], regex="[0-9]")[0].text.isdigit()  # the regex, decoded
    finally:
        scoring.destroy()


def test_stop_token_ids_and_ignore_eos_are_options(lm):
    """They were unknown options of the batch API, though Result.stop_reason names a stop token id."""
    ask = "Count from one to ten in words, separated by spaces."
    whole = lm.prompt(ask, max_tokens=16)
    tok = lm.engine.tokenizer
    stop_id = tok.encode(" " + whole.split()[2], add_special_tokens=False)[0]
    [r] = lm.batch_prompt([ask], max_tokens=16, stop_token_ids=[stop_id])
    assert r.stop_reason == stop_id and r.finish_reason == "stop" and len(r.text) < len(whole), r
    # As vLLM: the stop token's text is left out unless include_stop_str_in_output (it was kept)
    piece = tok.decode([stop_id])
    assert whole.startswith(r.text) and not r.text.endswith(piece) and r.token_ids[-1] == stop_id, r
    [kept] = lm.batch_prompt([ask], max_tokens=16, stop_token_ids=[stop_id], include_stop_str_in_output=True)
    assert kept.text == r.text + piece, (kept.text, r.text)
    [r] = lm.batch_prompt([ask], max_tokens=16, ignore_eos=True)
    assert r.usage.completion_tokens == 16


def test_close_on_one_thread_never_stops_the_engine_under_a_session_being_created(engine32):
    """close() counted open sessions, then shut the engine down, while another thread's new
    session was between getting the engine and joining it: that session's first prompt raised
    EngineStoppedError ("this session's engine is gone"), or create() a ValueError."""
    failures = []

    def user(k: int) -> None:
        for _ in range(6):
            try:
                lm = bp.LanguageModel.create(system=f"Be terse {k}.", model=engine32, max_tokens=1)
                lm.prompt("hi")
                lm.close()
            except Exception as e:  # noqa: BLE001 - collected for the assertion
                failures.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=user, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads)
    assert failures == []


def test_async_waits_inside_a_callback_wait_for_the_results_only(lm):
    """wait() inside a callback waits for the results (the batch's other callbacks cannot run
    until this one returns); wait_async() and `async for` waited for those callbacks: for ever."""
    got = []

    async def inner_results():
        inner = lm.create_batch(["b", "c"])
        inner.on_result(lambda i, r: None)
        first = await asyncio.wait_for(inner.wait_async(), 120)
        again = lm.create_batch(["d"])
        again.on_result(lambda i, r: None)
        return len(first), [i async for i, _ in again]

    outer = lm.create_batch(["a"])
    outer.on_result(lambda i, r: got.append(asyncio.run(inner_results())))
    outer.wait(timeout=300)
    assert got == [(2, [0])]


def test_a_bad_errors_option_is_refused_before_the_wait(lm):
    batch = lm.create_batch(["a", "b"])
    with pytest.raises(ValueError, match="errors must be 'return'"):
        batch.wait(errors="bogus")
    assert not batch.done  # it ran the whole batch, then raised
    with pytest.raises(ValueError, match="errors must be 'return'"):
        asyncio.run(batch.wait_async(errors="bogus"))
    batch.cancel()


def test_seed_minus_one_is_no_seed_as_in_vllm():
    assert bp.SamplingParams(seed=-1).seed is None and bp.SamplingParams(seed=-2).seed == -2


def test_a_negative_shutdown_timeout_is_refused():
    with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0"):
        bp.shutdown(timeout=-1)
