"""LLMEngine.generate and the add_request/step loop as vLLM's offline users call them: prompt
dicts, several threads, an interrupted call, a request whose adding fails, abort of several."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from batchprompt import SamplingParams

from .test_engine import GREEDY, engine, tiny_model  # noqa: F401  (tiny_model: a fixture)

PROMPTS = [[5, 9, 30, 41, 7], [8, 8, 60, 2 + 1], [50, 51, 52, 53, 54, 55, 56]]


def tokens(outs) -> list[list[int]]:
    return [o.output_token_ids for o in outs]


def test_vllm_prompt_dicts_and_arrays_are_prompts(tiny_model):
    """A dict prompt ran its keys' text ("prompt"); in a list, each failed. As vLLM: a
    TokensPrompt / TextPrompt is a prompt, alone or in a list, and so is an array of ids."""
    eng = engine(tiny_model)
    ref = tokens(eng.generate(PROMPTS, GREEDY))
    assert tokens(eng.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)) == ref
    assert tokens(eng.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY)) == ref[:1]
    assert tokens(eng.generate(np.array(PROMPTS[0]), GREEDY)) == ref[:1]
    assert tokens(eng.generate(torch.tensor(PROMPTS[0]), GREEDY)) == ref[:1]
    text, other, wrong = eng.generate([{"prompt": "hi"}, {"text": "hi"}, {"prompt_token_ids": "hi"}], GREEDY)
    assert "no tokenizer" in text.error  # this engine has none: the dict's text is the prompt
    assert "'prompt' (text) or 'prompt_token_ids'" in other.error
    assert "is a list of token ids" in wrong.error
    with pytest.raises(TypeError, match="not a single number"):
        eng.generate(torch.tensor(5), GREEDY)
    for bad in (None, 5):  # it was "'NoneType' object is not iterable"
        with pytest.raises(TypeError, match=r"generate\(\) takes a prompt \(a string, or a list of token ids\) or a "
                                            r"list of prompts, got"):
            eng.generate(bad, GREEDY)


def test_generate_from_several_threads_runs_each_call_whole(tiny_model):
    """Two threads' generate() on one engine took each other's requests (KeyError 'req-N', rows
    failed with index_select errors, outputs parked for ever). Now one call runs after another."""
    eng = engine(tiny_model)
    ref = tokens(eng.generate(PROMPTS, GREEDY))
    got, errors = {}, []

    def call(k: int) -> None:
        try:
            got[k] = tokens(eng.generate(PROMPTS, GREEDY))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=call, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and all(got[k] == ref for k in range(4))
    assert not eng.has_unfinished()


def test_another_threads_step_while_generate_runs_is_refused(tiny_model, monkeypatch):
    eng = engine(tiny_model)
    inside, release = threading.Event(), threading.Event()
    real_step = eng._step

    def slow_step(*a, **k):
        inside.set()
        release.wait(10)
        return real_step(*a, **k)

    monkeypatch.setattr(eng, "_step", slow_step)
    worker = threading.Thread(target=eng.generate, args=(PROMPTS, GREEDY))
    worker.start()
    assert inside.wait(10)
    for call in (eng.step, lambda: eng.add_request([1, 2]), lambda: eng.abort("req-0")):
        with pytest.raises(RuntimeError, match="generate\\(\\) runs this engine"):
            call()
    release.set()
    worker.join(30)
    assert not eng.has_unfinished()


def test_an_interrupted_generate_leaves_no_request_and_no_output_behind(tiny_model, monkeypatch):
    """Ctrl-C in generate() left its requests running (taking compute in later calls), and their
    outputs parked: has_unfinished() stayed true, and a vLLM step() loop got stale outputs."""
    eng = engine(tiny_model)
    real_step, calls = eng._step, []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step(*a, **k)

    monkeypatch.setattr(eng, "_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        eng.generate(PROMPTS, GREEDY)
    monkeypatch.setattr(eng, "_step", real_step)
    assert not eng.has_unfinished()  # at once (it was true until a step dropped the stopped requests)
    stale = []
    for _ in range(100):  # vLLM's loop: while has_unfinished(): step()
        if not eng.has_unfinished():
            break
        stale += eng.step()
    assert stale == [] and not eng.has_unfinished()
    assert eng.pool.num_used == 0
    assert tokens(eng.generate(PROMPTS, GREEDY)) == tokens(engine(tiny_model).generate(PROMPTS, GREEDY))


def test_an_add_request_that_raises_leaves_no_ghost_request(tiny_model, monkeypatch):
    """The request stayed registered, so `while has_unfinished(): step()` spun for ever."""
    eng = engine(tiny_model)

    def broken(req):
        raise RuntimeError("boom")

    monkeypatch.setattr(eng, "_prepare_structured", broken)
    for params in (GREEDY, SamplingParams(n=3, temperature=1.0, max_tokens=2)):
        with pytest.raises(RuntimeError, match="boom"):
            eng.add_request([1, 2, 3], params)
        assert not eng.has_unfinished()
    with pytest.raises(TypeError, match="grammar must be a batchprompt Grammar"):
        SamplingParams(grammar={"regex": "a+"})
    with pytest.raises(TypeError, match="vLLM's LLMEngine takes the request id first"):
        eng.add_request("id1", "hi", SamplingParams())


def test_abort_takes_several_ids_as_vllms_abort_request(tiny_model):
    eng = engine(tiny_model)
    ids = [eng.add_request(p, SamplingParams(max_tokens=50, ignore_eos=True)) for p in PROMPTS]
    assert eng.abort(ids[:2]) is True and eng.abort(["nope"]) is False
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert sorted((o.request_id, o.finish_reason) for o in outs) == sorted(
        [(ids[0], "abort"), (ids[1], "abort"), (ids[2], "length")])


def test_outputs_read_as_vllms_request_output(tiny_model):
    """Code written for vLLM reads `out.outputs[0].text`: there was no `.outputs`."""
    eng = engine(tiny_model)
    one = eng.generate(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True))[0]
    [sample] = one.outputs
    assert (sample.index, sample.text, sample.token_ids, sample.finish_reason) == (0, one.text, one.output_token_ids,
                                                                                  "length")
    assert sample.cumulative_logprob == pytest.approx(sum(one.logprobs)) and one.finished
    many = eng.generate(PROMPTS[0], SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=3, ignore_eos=True))[0]
    assert [s.token_ids for s in many.outputs] == [s.output_token_ids for s in many.samples]
    assert [s.index for s in many.outputs] == [0, 1, 2] and many.outputs[0].cumulative_logprob is None


def test_a_request_stopped_before_its_prompt_log_probs_were_computed_leaves_the_engine_working(tiny_model):
    """Reading the prompt's log-probs of such a request raised KeyError, and every later step and
    generate() raised again (KeyError 'req-0'), for good: a Ctrl-C in a generate() asking for
    them, or a client that left an `echo` request, broke the engine."""
    eng = engine(tiny_model)
    asks = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs_from=1, prompt_top_logprobs=2,
                          prompt_ranks=True)
    rid = eng.add_request(PROMPTS[2], asks)
    assert eng.abort(rid)
    [out] = eng.step()
    assert out.finish_reason == "abort" and out.prompt_logprobs is None and out.prompt_ranks is None
    assert tokens(eng.generate(PROMPTS, GREEDY)) == tokens(engine(tiny_model).generate(PROMPTS, GREEDY))


def test_generate_inside_a_step_of_the_same_thread_is_refused(tiny_model, monkeypatch):
    """A signal handler's generate() ran in the middle of the outer call's step: the outer call
    raised KeyError and lost its results."""
    eng = engine(tiny_model)
    real_step, seen = eng._step, []

    def step_that_calls_back(*a, **k):
        if not seen:
            with pytest.raises(RuntimeError, match="inside a step of this engine"):
                eng.generate(PROMPTS[:1], GREEDY)
            seen.append(1)
        return real_step(*a, **k)

    monkeypatch.setattr(eng, "_step", step_that_calls_back)
    assert tokens(eng.generate(PROMPTS, GREEDY)) == tokens(engine(tiny_model).generate(PROMPTS, GREEDY))
    assert seen and not eng._discarded
