"""vLLM's and OpenAI's sampling options on a real server started with the engine's flags
(--device, --dtype, --max-model-len, --kv-cache-memory as `batchprompt run` takes them)."""
from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from batchprompt.api.result import Result
from batchprompt.models import resolve_model
from batchprompt.models.tokenizer import Tokenizer

from .conftest import error_of, start_server, stop_server

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 128
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("server"), "--device", "cpu", "--dtype", "float32",
                       "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "30%")
    yield srv
    assert stop_server(srv) == 0, srv.output()


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.load(resolve_model(None))


def test_max_model_len_reaches_the_engine(server):
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": [7] * (MAX_MODEL_LEN + 10), "max_tokens": 1})
    assert r.status_code == 400, r.text
    error = error_of(r)
    assert error["code"] == "context_length_exceeded" and f"the context holds {MAX_MODEL_LEN}" in error["message"]


def test_the_model_card_says_the_context_length(server):
    """As vLLM's: a pool of servers reads it (it learned nothing, and a too-long prompt went out)."""
    with server.client() as c:
        listed, one = c.get("/v1/models").json()["data"], c.get(f"/v1/models/{MODEL}").json()
    assert [m["max_model_len"] for m in listed] == [MAX_MODEL_LEN] and one["max_model_len"] == MAX_MODEL_LEN


def test_a_prompt_too_long_by_its_length_is_refused_unread(server):
    """A prompt of far more bytes than the context's tokens can cover is refused by its length
    alone (megabytes of text held the tokenizer, which every request waits for, for seconds):
    on both routes and in a Batch API row. The message says "at least" (the old code counted)."""
    from .batch_util import chat_line, lines_of, upload, wait_ended

    huge = "word " * 20 * MAX_MODEL_LEN * 5  # 100 bytes for each token of the context
    with server.client() as c:
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": huge}]})
        listed = c.post("/v1/completions", json={"prompt": ["hi", huge], "max_tokens": 1})
    for r, text in ((chat, "the messages have at least "), (listed, "prompt 1 has at least ")):
        assert r.status_code == 400, r.text
        error = error_of(r)
        assert error["code"] == "context_length_exceeded" and text in error["message"], error
        assert f"the context holds {MAX_MODEL_LEN}" in error["message"]
    client = server.openai()
    lines = [chat_line("huge", huge), chat_line("small", "hi")]
    batch = wait_ended(client, client.batches.create(input_file_id=upload(client, lines).id,
                                                     endpoint="/v1/chat/completions", completion_window="24h").id)
    assert batch.request_counts.model_dump() == {"total": 2, "completed": 1, "failed": 1}, batch
    [err] = lines_of(client, batch.error_file_id)
    assert err["custom_id"] == "huge" and err["error"]["code"] == "context_length_exceeded"
    assert "the messages have at least " in err["error"]["message"]


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100_000}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**29}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}),
])
def test_max_tokens_beyond_the_context_is_refused(server, route, body):
    """As vLLM: prompt plus max_tokens must fit the context (it was taken, and the answer ran on
    to the context's end: minutes for a client that asked for an impossible length)."""
    with server.client() as c:
        r = c.post(route, json=body)
    assert r.status_code == 400, r.text
    error = error_of(r)
    field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"  # it said max_tokens
    assert (error["code"], error["param"]) == ("context_length_exceeded", field), error
    assert f"the context holds {MAX_MODEL_LEN} tokens" in error["message"] and f"lower {field} " in error["message"]
    with server.client() as c:  # what fits still runs; unset, a chat gets the rest of the context
        fits = {**body, **({"max_tokens": 2} if "max_tokens" in body else {"max_completion_tokens": 2})}
        assert c.post(route, json=fits).status_code == 200
        if route == "/v1/chat/completions":
            assert c.post(route, json={"messages": body["messages"]}).status_code == 200


def test_logit_bias_forces_a_token(server, tokenizer):
    [banana] = tokenizer.encode(" banana", add_special_tokens=False)
    client = server.openai()
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    assert "banana" not in plain.choices[0].text
    forced = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                       logit_bias={str(banana): 100})
    assert forced.choices[0].text == " banana" * 3
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=2, temperature=0, logit_bias={str(banana): 100})
    assert chat.choices[0].message.content == " banana" * 2


def test_penalties_change_a_repetitive_answer(server):
    client = server.openai()
    prompt = "Repeat after me: hello hello hello"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert plain.choices[0].text.count(" hello") >= 6  # the model repeats, greedily
    for penalty in ({"presence_penalty": 2}, {"frequency_penalty": 2}, {"extra_body": {"repetition_penalty": 2.0}}):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, **penalty)
        assert out.choices[0].text.count(" hello") <= 2, penalty


def test_min_tokens_and_include_stop_str_in_output(server):
    client = server.openai()
    args = {"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 8, "temperature": 0, "stop": [","]}
    plain = client.completions.create(**args)
    assert plain.choices[0].text == " 4"
    kept = client.completions.create(**args, extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == " 4,"
    longer = client.completions.create(**args, extra_body={"min_tokens": 4, "min_p": 0.1})
    # " ", "4", ",", " " are the first 4 tokens: the "," among them is no stop (as vLLM), the next one is.
    assert longer.choices[0].text == " 4, 5" and longer.usage.completion_tokens == 6


def test_best_of(server):
    client = server.openai()
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1, seed=3,
                                    best_of=3)
    assert len(out.choices) == 1 and out.choices[0].text
    same = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, n=2, best_of=2, seed=1)
    assert len(same.choices) == 2  # best_of = n: all of them, as OpenAI
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, n=2, best_of=3)


def test_vllms_stop_token_ids_and_ignore_eos(server):
    """They were ignored (stop_token_ids) or refused (ignore_eos) though the engine has them."""
    client = server.openai()
    ask = dict(model=MODEL, prompt="Count: one, two, three, four, five,", max_tokens=12, temperature=0)
    whole = client.completions.create(**ask)
    ids = Tokenizer.load(resolve_model(None)).encode(whole.choices[0].text, add_special_tokens=False)
    cut = client.completions.create(**ask, extra_body={"stop_token_ids": [ids[2]]})
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == 3, cut
    short = client.completions.create(model=MODEL, prompt="Say OK.", max_tokens=40, temperature=0)
    assert short.usage.completion_tokens < 40  # it ends by itself
    longer = client.completions.create(model=MODEL, prompt="Say OK.", max_tokens=40, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert longer.usage.completion_tokens == 40 and longer.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="stop_token_ids must be a list of token ids"):
        client.completions.create(**ask, extra_body={"stop_token_ids": [-1]})
    for bad in ("a", [1.5]):  # wrong types: 422, as every field's
        with pytest.raises(openai.UnprocessableEntityError, match="stop_token_ids"):
            client.completions.create(**ask, extra_body={"stop_token_ids": bad})


def test_a_huge_best_of_is_refused(server):
    # A million sequences for one prompt held the engine for minutes (and /ready said ready).
    with pytest.raises(openai.BadRequestError, match="best_of must be an integer from 1 to 128") as e:
        server.openai().completions.create(model=MODEL, prompt="Hi", max_tokens=2, best_of=1_000_000)
    assert e.value.body["param"] == "best_of"


def test_a_top_k_beyond_any_vocabulary_fails_nobody(server):
    """A top_k too large for the sampler's tensors failed every request of the step it ran in
    (500 for the others too); it keeps every token, as top_k off."""
    client = server.openai()
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0)
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda k: client.chat.completions.create(**ask, extra_body={"top_k": k}),
                             [10**30, None, None, 2**63]))
    assert all(o.choices[0].message.content for o in outs)


def _has_top_logprobs() -> bool:
    return "top_logprobs" in {f.name for f in dataclasses.fields(Result)}


def test_chat_top_logprobs_shape(server):
    out = server.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What colour is the sky?"}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    if not _has_top_logprobs():
        pytest.skip("api Result has no top_logprobs yet: the alternatives cannot reach the response")
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the likeliest
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                  reverse=True)


def test_completion_logprobs_count_is_top_logprobs(server):
    out = server.openai().completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=0,
                                             logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens
    if not _has_top_logprobs():
        pytest.skip("api Result has no top_logprobs yet: the alternatives cannot reach the response")
    assert len(lp.top_logprobs) == len(lp.tokens)
    for token, top in zip(lp.tokens, lp.top_logprobs):
        assert 1 <= len(top) <= 2 and token in top  # two ids may decode to the same text
    # true, as a Batch API row takes it (the route answered 422): 1, as vLLM's integer field reads it
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "1, 2, 3,", "max_tokens": 4, "temperature": 0, "logprobs": True})
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["logprobs"]
    assert got["tokens"] == lp.tokens and [len(top) for top in got["top_logprobs"]] == [1] * len(lp.tokens)
    assert got["token_logprobs"] == pytest.approx(lp.token_logprobs, abs=0.05)  # bfloat16 may round them apart


@pytest.mark.parametrize("body, code", [
    ({"prompt": "hi", "echo": True, "stream": True}, "unsupported_parameter"),  # echo alone is taken, as vLLM
    ({"prompt": "hi", "suffix": "!"}, "unsupported_parameter"),
    ({"prompt": "hi", "use_beam_search": True}, "unsupported_parameter"),
    ({"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "unsupported_parameter"),  # taken alone, as vLLM
    ({"prompt": "hi", "logprobs": 21}, "invalid_parameter"),
    ({"prompt": "hi", "presence_penalty": 3}, "invalid_parameter"),
    ({"prompt": "hi", "logit_bias": {"7": 500}}, "invalid_parameter"),
])
def test_what_is_not_supported_or_out_of_range_is_400(server, body, code):
    with server.client() as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = error_of(r)
    assert error["code"] == code, error
    assert next(iter(k for k in body if k != "prompt")) in error["message"], error
