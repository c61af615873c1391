"""OpenAI's routes on a real server, through the official `openai` client and plain httpx."""
from __future__ import annotations

import json
import re
import socket

import jsonschema
import openai
import pytest

from .conftest import LONG_COMPLETION, error_of, start_server, stop_server
from tests.json_depth import DEEP

pytestmark = pytest.mark.slow

BODY_LIMIT = 65536


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("server"), "--max-body-bytes", str(BODY_LIMIT))
    yield srv
    assert stop_server(srv) == 0, srv.output()


def test_models_lists_the_served_model(server):
    client = server.openai()
    models = client.models.list().data
    assert [m.id for m in models] == ["smollm2-135m"]
    assert client.models.retrieve("smollm2-135m").id == "smollm2-135m"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_served_model_names_as_vllm_takes_them(tmp_path):
    """A vLLM user's requests and batch files name the model as vLLM served it (its hub id): there
    was no --served-model-name, and each was a 404. As vLLM: every name is listed, and an answer
    carries the name its request gave (it carried the first, where a client checks it)."""
    hub_id = "HuggingFaceTB/SmolLM2-135M-Instruct"
    srv = start_server(tmp_path, "--served-model-name", hub_id, "smol")
    try:
        client = srv.openai()
        assert [m.id for m in client.models.list().data] == [hub_id, "smol"]
        assert client.models.retrieve("smol").id == "smol"
        for name in (hub_id, "smol"):
            out = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=2)
            assert out.model == name
            stream = client.completions.create(model=name, prompt="Hi", max_tokens=2, stream=True)
            assert {chunk.model for chunk in stream} == {name}
        with srv.client() as c:  # no model given: the first name
            assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).json()["model"] == hub_id
        with pytest.raises(openai.NotFoundError, match="this server runs 'HuggingFaceTB/SmolLM2-135M-Instruct', "
                                                       "'smol'"):
            client.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=2)
        # A Batch API row's answer carries its body's name too (the batch's for a row that gives none)
        from .batch_util import chat_line, upload, wait_ended

        rows = [chat_line("a", "Hi", model="smol"), chat_line("b", "Hi", model=hub_id), chat_line("c", "Hi")]
        del rows[2]["body"]["model"]
        batch = client.batches.create(input_file_id=upload(client, rows).id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        batch = wait_ended(client, batch.id)
        answers = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
        assert {a["custom_id"]: a["response"]["body"]["model"] for a in answers} == {"a": "smol", "b": hub_id,
                                                                                    "c": hub_id}
    finally:
        assert stop_server(srv) == 0, srv.output()


def test_completions_answer_a_list_of_prompts_in_input_order(server):
    prompts = ["1, 2, 3, 4,", "A, B, C, D,", "Monday, Tuesday, Wednesday,"]
    out = server.openai().completions.create(model="smollm2-135m", prompt=prompts, max_tokens=4, temperature=0)
    assert out.object == "text_completion"
    assert [c.index for c in out.choices] == [0, 1, 2]
    # Each continuation can only belong to its own prompt.
    assert "5" in out.choices[0].text and "E" in out.choices[1].text and "Thursday" in out.choices[2].text
    assert 3 <= out.usage.completion_tokens <= 3 * 4
    assert out.usage.prompt_tokens > 3 * 4


def test_completions_take_token_ids_and_default_to_16_tokens(server):
    tokens = [[16, 28, 220, 33], [50, 28, 220]]
    out = server.openai().completions.create(model="smollm2-135m", prompt=tokens, temperature=0, logprobs=0)
    assert len(out.choices) == 2
    for choice in out.choices:
        assert choice.finish_reason in ("stop", "length")
        assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) <= 16
        assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    assert out.usage.prompt_tokens == 7


def test_chat_completion(server):
    out = server.openai().chat.completions.create(
        model="smollm2-135m", messages=[{"role": "system", "content": "Answer in one word."},
                                        {"role": "user", "content": "What colour is the sky?"}],
        max_completion_tokens=8, temperature=0, logprobs=True)
    choice = out.choices[0]
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    assert len(choice.logprobs.content) == out.usage.completion_tokens <= 8
    assert "".join(t.token for t in choice.logprobs.content).strip() == choice.message.content.strip()


def test_the_answers_id_carries_the_clients_request_id_as_vllm_makes_it(server):
    """It was random whatever the client sent: vLLM answers chatcmpl-<X-Request-Id> (else the
    body's request_id), so a client's logs and the server's name a request alike."""
    client = server.openai()
    chat = dict(model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    out = client.chat.completions.create(**chat, extra_headers={"X-Request-Id": "mine-7"})
    assert out.id == "chatcmpl-mine-7"
    assert client.chat.completions.create(**chat, extra_body={"request_id": "body-8"}).id == "chatcmpl-body-8"
    out = client.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=1,
                                    extra_headers={"X-Request-Id": "mine-9"})
    assert out.id == "cmpl-mine-9"
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", client.chat.completions.create(
        **chat, extra_headers={"X-Request-Id": "not a token"}, extra_body={"request_id": 5}).id)
    import httpx  # two headers: the answer's header and its id take the same one (the id took the first)
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60,
                   headers=[("X-Request-Id", "one"), ("X-Request-Id", "two")])
    assert (r.headers["x-request-id"], r.json()["id"]) == ("two", "chatcmpl-two")


def test_logprob_bytes_rebuild_the_content(server):
    """Each token's `bytes` are its own, so that a character split across tokens (an emoji,
    whose token texts are U+FFFD) comes back whole when they are joined, as OpenAI's do."""
    out = server.openai().chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Reply with three emojis only: 🎉🌟😀"}],
        max_tokens=8, temperature=0, logprobs=True)
    choice = out.choices[0]
    joined = b"".join(bytes(t.bytes) for t in choice.logprobs.content)
    assert joined.decode("utf-8", "replace").rstrip("\ufffd") == choice.message.content


def test_chat_streams_server_sent_events(server):
    client = server.openai()
    messages = [{"role": "user", "content": "Say hello."}]
    whole = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=12)
    stream = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=12, n=2,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    # One id shape, streamed or not, and each request its own id.
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", whole.id) and re.fullmatch(r"chatcmpl-[0-9a-f]{32}", chunks[0].id)
    assert whole.id != chunks[0].id
    first = chunks[0]
    assert [(c.index, c.delta.role) for c in first.choices] == [(0, "assistant"), (1, "assistant")]
    text = {0: "", 1: ""}
    finish = {}
    for c in chunks[1:-1]:
        assert len(c.choices) == 1 and c.usage is None
        choice = c.choices[0]
        text[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finish[choice.index] = choice.finish_reason
    assert set(finish) == {0, 1}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == whole.usage.prompt_tokens
    assert 2 <= usage.completion_tokens <= 2 * 12
    assert text[0] and text[1]


def _whole_chat(client, **kwargs):
    """The request's answer without streaming, once its prompt is in the prefix cache (as it
    then is for the stream: in bfloat16 a step of other shape may flip a near-tie)."""
    client.chat.completions.create(model="smollm2-135m", **kwargs)
    return client.chat.completions.create(model="smollm2-135m", **kwargs).choices[0]


def _streamed_chat(client, **kwargs) -> tuple[list[str], str | None]:
    """The content pieces of a one-choice chat stream, and its finish_reason."""
    pieces, finish = [], None
    for c in client.chat.completions.create(model="smollm2-135m", stream=True, **kwargs):
        for choice in c.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    return pieces, finish


def test_a_chat_stream_sends_its_text_as_it_is_made(server):
    """Token by token, as OpenAI and vLLM stream: several content chunks (one per step or
    so), which join to the text the same request gets without streaming."""
    client = server.openai()
    ask = dict(messages=[{"role": "user", "content": "Write two sentences about the sea."}], max_tokens=24,
               temperature=0)
    whole = _whole_chat(client, **ask)
    pieces, finish = _streamed_chat(client, **ask)
    assert len(pieces) >= 8, pieces
    assert "".join(pieces) == whole.message.content and finish == whole.finish_reason


def test_a_stream_with_logprobs_sends_them_with_its_tokens_as_vllm_does(server):
    """With logprobs asked, a stream sent nothing until the answer was whole (one chunk of 54 KB
    after 13 s: a client whose read timeout was shorter failed). Each chunk now carries its
    tokens' log-probs; joined, they are the answer's, token for token."""
    client = server.openai()
    ask = dict(messages=[{"role": "user", "content": "Write two sentences about the sea."}], max_tokens=24,
               temperature=0, logprobs=True, top_logprobs=2)
    whole = _whole_chat(client, **ask)
    carrying, streamed = 0, []
    for c in client.chat.completions.create(model="smollm2-135m", stream=True, **ask):
        for choice in c.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                carrying += 1
                streamed += choice.logprobs.content
    assert carrying >= 8, carrying
    assert [t.token for t in streamed] == [t.token for t in whole.logprobs.content]
    assert all(len(t.top_logprobs) == 2 for t in streamed)
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in whole.logprobs.content], abs=1e-3)
    # Completions: tokens, log-probs, top ones and offsets counted over the whole text.
    chunks = list(client.completions.create(model="smollm2-135m", prompt="The sea is", max_tokens=12,
                                            temperature=0, logprobs=2, stream=True))
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs is not None
             and c.choices[0].logprobs.tokens]
    assert len(parts) >= 4, len(parts)
    tokens = [t for p in parts for t in p.tokens]
    offsets = [o for p in parts for o in p.text_offset]
    assert offsets == [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    assert all(1 <= len(top) <= 3 for p in parts for top in p.top_logprobs)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == "".join(t for t in tokens if t not in ("<|im_end|>", "<|endoftext|>")), (text, tokens)


def test_a_stream_never_sends_what_a_stop_string_cuts(server):
    """A stop string is cut from the output once it completes: the stream holds back as many
    characters as could start one, so what it sent is never taken back."""
    client = server.openai()
    ask = dict(messages=[{"role": "user", "content": "Write two sentences about the sea."}], max_tokens=24,
               temperature=0)
    text = _whole_chat(client, **ask).message.content
    words = text.split(" ")
    assert len(words) > 6, text
    stop = " " + words[4][:3]  # a piece from the middle of the answer: the output ends before it
    whole = _whole_chat(client, stop=[stop], **ask)
    pieces, finish = _streamed_chat(client, stop=[stop], **ask)
    assert whole.finish_reason == "stop" and stop not in whole.message.content
    assert "".join(pieces) == whole.message.content and finish == "stop"
    assert len(pieces) >= 2, pieces


def test_choices_say_which_stop_ended_them_as_vllm_does(server):
    """vLLM's stop_reason: the stop string or stop token id that ended a choice, null for EOS
    or max_tokens; also in a stream's finish chunk. It was missing."""
    client = server.openai()
    out = client.completions.create(model="smollm2-135m", prompt=["1, 2, 3, 4,", "Say hi."], max_tokens=12,
                                    temperature=0, stop=["zebra", "7"])
    assert [c.model_extra.get("stop_reason", "absent") for c in out.choices][0] == "7"
    chat = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Say hi."}],
                                          max_tokens=40, temperature=0)
    assert chat.choices[0].finish_reason == "stop" and chat.choices[0].model_extra["stop_reason"] is None
    cut = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Say hi."}],
                                         max_tokens=1, temperature=0)
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].model_extra["stop_reason"] is None
    stream = client.chat.completions.create(model="smollm2-135m", stream=True, max_tokens=12, temperature=0,
                                            messages=[{"role": "user", "content": "Say hi."}], stop=[" "])
    ends = [c.choices[0] for c in stream if c.choices and c.choices[0].finish_reason]
    assert [(e.finish_reason, e.model_extra["stop_reason"]) for e in ends] == [("stop", " ")]


def test_completions_stream(server):
    with server.client() as c, c.stream("POST", "/v1/completions", json={
            "prompt": ["1, 2, 3, 4,", "A, B, C, D,"], "max_tokens": 4, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    text, finish = {0: "", 1: ""}, {}
    for ch in chunks:
        choice = ch["choices"][0]
        text[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finish[choice["index"]] = choice["finish_reason"]
    assert "5" in text[0] and "E" in text[1] and set(finish) == {0, 1}
    assert {ch["object"] for ch in chunks} == {"text_completion"}
    with server.client() as c:
        whole = c.post("/v1/completions", json={"prompt": ["1, 2, 3, 4,", "A, B, C, D,"], "max_tokens": 4,
                                                "temperature": 0}).json()
    assert [text[0], text[1]] == [ch["text"] for ch in whole["choices"]]


def _sse(r) -> list[dict]:
    lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_return_token_ids_streamed_and_whole_as_vllm_gives_them(server):
    """vLLM's return_token_ids: each choice's `token_ids`, and the prompt's `prompt_token_ids`
    (a chat's on the response, a completion's on each choice). Streamed, each chunk carries its
    own tokens' ids. The prompt's ids were never given, a chat stream carried no ids and a
    completion stream all of them on its last chunk."""
    msgs = [{"role": "user", "content": "Count: 1, 2, 3,"}]
    common = {"max_tokens": 8, "temperature": 0, "return_token_ids": True, "n": 2, "stop": [", 7"]}
    with server.client() as c:
        chat_ids = c.post("/tokenize", json={"messages": msgs}).json()["tokens"]
        prompt_ids = c.post("/tokenize", json={"prompt": "1, 2, 3, 4,"}).json()["tokens"]
        whole_chat = c.post("/v1/chat/completions", json={"messages": msgs, **common}).json()
        whole = c.post("/v1/completions", json={"prompt": "1, 2, 3, 4,", **common}).json()
        with c.stream("POST", "/v1/chat/completions", json={"messages": msgs, "stream": True, **common}) as r:
            chat_chunks = _sse(r)
        with c.stream("POST", "/v1/completions", json={"prompt": "1, 2, 3, 4,", "stream": True, **common}) as r:
            chunks = _sse(r)
    assert whole_chat["prompt_token_ids"] == chat_ids
    assert [ch["prompt_token_ids"] for ch in whole["choices"]] == [prompt_ids, prompt_ids]
    assert all(ch["token_ids"] for ch in whole_chat["choices"] + whole["choices"])
    # Streamed: the chat's prompt ids on its first chunk; each chunk's ids are its own tokens'
    assert chat_chunks[0]["prompt_token_ids"] == chat_ids and all("prompt_token_ids" not in ch
                                                                  for ch in chat_chunks[1:])
    for streamed, answer, chat in ((chat_chunks, whole_chat, True), (chunks, whole, False)):
        ids: dict[int, list[int]] = {0: [], 1: []}
        firsts: dict[int, list] = {}
        for ch in streamed:
            for choice in ch["choices"]:
                ids[choice["index"]] += choice.get("token_ids", [])
                if not chat and choice["index"] not in firsts:
                    firsts[choice["index"]] = choice.get("prompt_token_ids")
        assert [ids[0], ids[1]] == [ch["token_ids"] for ch in answer["choices"]], chat
        if not chat:
            assert firsts == {0: prompt_ids, 1: prompt_ids}
    pieces = [ch["choices"][0]["token_ids"] for ch in chunks if ch["choices"] and ch["choices"][0].get("text")]
    assert len(pieces) > 1  # not all of them on one chunk


def test_greedy_choices_of_one_request_are_the_same_answer(server):
    """n > 1 at temperature 0: the first choice answered otherwise than the others, every time
    (its prompt computed in full, theirs read from the prefix cache, rounding apart in bfloat16)."""
    body = {"messages": [{"role": "user", "content": "Write a poem about the sea"}], "max_tokens": 24,
            "temperature": 0, "n": 3}
    with server.client() as c:
        finished = c.get("/v1/batch/stats").json()["engine"]["finished"]
        whole = c.post("/v1/chat/completions", json=body).json()
        assert c.get("/v1/batch/stats").json()["engine"]["finished"] == finished + 1  # computed once
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            chunks = _sse(r)
    texts = [ch["message"]["content"] for ch in whole["choices"]]
    assert len(set(texts)) == 1 and texts[0], texts
    streamed = {0: "", 1: "", 2: ""}
    for ch in chunks:
        for choice in ch["choices"]:
            streamed[choice["index"]] += choice["delta"].get("content") or ""
    assert list(streamed.values()) == texts


def test_structured_output_choices(server):
    client = server.openai()
    labels = ["spam", "ham"]
    for extra in ({"guided_choice": labels}, {"structured_outputs": {"choice": labels}}):
        out = client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "WINNER! Claim your prize now"}],
            extra_body=extra)
        assert out.choices[0].message.content in labels, extra
    out = client.completions.create(model="smollm2-135m", prompt=["Label: ", "Word: "], max_tokens=5,
                                    extra_body={"guided_choice": labels})
    assert [c.text in labels for c in out.choices] == [True, True]


def test_a_streamed_answer_in_score_mode_carries_its_choice_probs(server):
    """Its last chunk had none (the answer without streaming had them)."""
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Spam or ham: WIN a prize"}],
            "guided_choice": ["spam", "ham"], "choice_mode": "score"}
    with server.client() as c:
        whole = c.post("/v1/chat/completions", json=body).json()["choices"][0]
        with c.stream("POST", "/v1/chat/completions", json=dict(body, stream=True)) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert set(whole["choice_probs"]) == {"spam", "ham"}
    last = [ch for chunk in chunks for ch in chunk["choices"] if ch["finish_reason"]]
    assert len(last) == 1 and last[0]["choice_probs"] == pytest.approx(whole["choice_probs"], abs=1e-3), chunks
    content = "".join(ch["delta"].get("content") or "" for chunk in chunks for ch in chunk["choices"])
    assert content == whole["message"]["content"]


def test_structured_output_json_schema(server):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    out = server.openai().chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Describe a person as JSON."}],
        max_tokens=48, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_a_streamed_answer_that_breaks_its_schema_ends_with_an_error_event(server):
    """The grammar forces "2023-02-29" (a const), which is no date: unstreamed it is a 400
    `invalid_output` (not a 500, which clients retry to the same answer), with the text; the
    stream of it ended with finish_reason "stop" and no error, as if it were good."""
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "A date?"}], "max_tokens": 16,
            "guided_json": {"const": "2023-02-29", "format": "date"}}
    with server.client() as c:
        whole = c.post("/v1/chat/completions", json=body)
        assert whole.status_code == 400 and error_of(whole)["code"] == "invalid_output", whole.text
        assert error_of(whole)["message"].endswith("is not a 'date' (the grammar engine let it through); "
                                                   'the output: "2023-02-29"'), whole.text
        with c.stream("POST", "/v1/chat/completions", json=dict(body, stream=True)) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events
    last = json.loads(events[-2])
    assert "is not a 'date'" in last["error"]["message"], events
    finished = [ch["finish_reason"] for e in events[:-2] for ch in json.loads(e)["choices"]]
    assert "stop" not in finished, events


def test_of_several_choices_one_that_breaks_its_schema_carries_its_error_and_the_others_are_answered(server):
    """A list of two prompts under one schema, one answered with a date that does not exist: the
    whole request was a 400, and the good answer was lost (so with n > 1). Now it is a 200; the
    bad choice keeps its text and carries OpenAI's error object, streamed on its last chunk too."""
    schema = {"enum": ["2023-02-28", "2023-02-29"], "format": "date"}
    body = {"model": "smollm2-135m", "max_tokens": 12, "temperature": 0, "guided_json": schema,
            "prompt": [f'{d!r} {d!r} {d!r} {d!r} '.replace("'", '"') for d in ("2023-02-28", "2023-02-29")]}
    with server.client() as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        with c.stream("POST", "/v1/completions", json=dict(body, stream=True)) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert [ch["text"] for ch in choices] == ['"2023-02-28"', '"2023-02-29"'], choices
    assert "error" not in choices[0] and choices[0]["finish_reason"] == "stop", choices
    assert choices[1]["error"]["code"] == "invalid_output", choices
    assert "is not a 'date'" in choices[1]["error"]["message"], choices
    assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1]), events
    streamed = [ch for e in events[:-1] for ch in json.loads(e)["choices"]]
    finished = {ch["index"]: ch for ch in streamed if ch["finish_reason"] is not None}
    assert sorted(finished) == [0, 1] and "error" not in finished[0], events
    assert finished[1]["error"]["code"] == "invalid_output", events
    for i, choice in enumerate(choices):
        assert "".join(ch["text"] for ch in streamed if ch["index"] == i) == choice["text"], events
    # A list of one prompt (as a pool sends a sub-batch of one) is answered so too
    with server.client() as c:
        r = c.post("/v1/completions", json=dict(body, prompt=body["prompt"][1:]))
    assert r.status_code == 200 and r.json()["choices"][0]["error"]["code"] == "invalid_output", r.text
    # n = 2 of a chat, both choices bad: each carries its error, through the openai client too
    out = server.openai().chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "A date?"}], max_tokens=16, n=2,
        extra_body={"guided_json": {"const": "2023-02-29", "format": "date"}})
    assert [(c.message.content, c.model_extra["error"]["code"]) for c in out.choices] == [
        ('"2023-02-29"', "invalid_output")] * 2, out


@pytest.mark.parametrize("field, value", [("max_tokens", -5), ("n", 0), ("top_p", 2), ("temperature", -1),
                                          ("presence_penalty", 9), ("stop", [""]),
                                          ("stop", "")])  # as vLLM: an empty stop string, alone too
def test_a_bad_value_names_its_field_in_param(server, field, value):
    """OpenAI's `param` (it was null for these: the field was named only in the message)."""
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], field: value})
    assert r.status_code == 400, r.text
    assert (error_of(r)["param"], error_of(r)["code"]) == (field, "invalid_parameter"), r.text


@pytest.mark.parametrize("body, status, code", [
    (b'{"messages": [', 400, "invalid_json"),
    (b'[1, 2]', 400, "invalid_json"),
    (b'{"messages": ' + b"[" * DEEP + b"]" * DEEP + b"}", 400, "invalid_json"),  # was a 500 (RecursionError)
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, None),
    ({"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}}, 400,
     "invalid_parameter"),  # without stream: true (OpenAI refuses it too)
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, None),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, 400, None),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "invalid_messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, 400, "invalid_parameter"),  # no logprobs
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": "a"}, 422, "invalid_type"),
    ({"messages": [{"role": "user", "content": "hi"}], "guided_regex": "("}, 400, None),
    ({"messages": [{"role": "user", "content": "hi"}], "guided_json": 5}, 422, "invalid_type"),  # was a 400
    ({"messages": [{"role": "user", "content": "hi"}], "guided_choice": "spam"}, 422, "invalid_type"),
    ({"messages": [{"role": "user", "content": "hi"}], "choice_mode": "score"}, 400, "invalid_parameter"),  # ignored
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 422, "invalid_type"),
    ({"messages": "hi", "max_tokens": "8"}, 422, "invalid_type"),
    ({"max_tokens": 8}, 422, "invalid_type"),
    ({"messages": [{"role": "user", "content": "hi"}], "user": 5}, 422, "invalid_type"),  # was taken, ignored
    ({"messages": [{"role": "user", "content": "hi"}], "metadata": {"a": 1}}, 422, "invalid_type"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4o"}, 404, "model_not_found"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "invalid_json"),  # was taken
])
def test_chat_errors_in_openai_shape(server, body, status, code):
    with server.client() as c:
        if isinstance(body, bytes):
            r = c.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
        else:
            r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    error = error_of(r)
    if code is not None:
        assert error["code"] == code, error


def test_what_vllm_takes_is_taken(server):
    """As vLLM's (lax) models: a whole-number float for an integer field ("max_tokens": 5.0, as
    JavaScript or a Python float sends it), "model": "" (left out), and an assistant turn with
    content null (a refusal's, replayed). Each was a 422, a 404 or a 400."""
    hi = [{"role": "user", "content": "hi"}]
    with server.client() as c:
        for extra in ({"max_tokens": 2.0, "n": 1.0, "seed": 7.0}, {"max_tokens": 2, "model": ""},
                      {"max_tokens": 2, "messages": [{"role": "assistant", "content": None, "refusal": "no"}] + hi}):
            r = c.post("/v1/chat/completions", json={"messages": hi, **extra})
            assert r.status_code == 200, (extra, r.text)
            assert r.json()["usage"]["completion_tokens"] <= 2
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3.0, "logprobs": 2.0})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["logprobs"]["top_logprobs"][0]) >= 2
        # Token ids too (they were a 422): as ints they read the same
        for prompt in ([1.0, 504.0], [[1.0, 504], [504.0]]):
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "stop_token_ids": [2.0]})
            assert r.status_code == 200, (prompt, r.text)
            lists = prompt if isinstance(prompt[0], list) else [prompt]
            assert r.json()["usage"]["prompt_tokens"] == sum(map(len, lists))
        r = c.post("/v1/completions", json={"prompt": [1.5, 504], "max_tokens": 1})
        assert r.status_code == 422 and error_of(r)["param"].startswith("prompt"), r.text
        r = c.post("/v1/chat/completions", json={"messages": hi, "max_tokens": 2.5})
        assert r.status_code == 422 and error_of(r)["param"] == "max_tokens", r.text


def test_echo_with_logprobs_gives_the_prompts_log_probs_as_lm_eval_asks_them(server):
    """lm-eval-harness's loglikelihood request to an OpenAI-compatible server (echo, logprobs 1,
    max_tokens 1) was refused ("echo ... does not support it"). As vLLM: the prompt's text first,
    its tokens' log-probs (the first null) and top ones, then the answer's."""
    prompt = "The capital of France is Paris"
    client = server.openai()
    ids = server.client().post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    choices = [client.completions.create(model="smollm2-135m", prompt=given, max_tokens=1, temperature=0,
                                         logprobs=1, echo=True).choices[0] for given in (prompt, ids)]
    for choice in choices:
        lp = choice.logprobs
        assert choice.text.startswith(prompt)
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
        assert "".join(lp.tokens[:len(ids)]) == prompt
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(v <= 0 for v in lp.token_logprobs[1:])
        assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])
        assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
        # A token among its position's top ones has one value (the two differed by up to 0.06 in bfloat16).
        assert all(top[token] == value for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:],
                                                                    lp.top_logprobs[1:]))
    first, second = choices  # the prompt as text and as its token ids: the same numbers
    assert first.logprobs.token_logprobs[1:] == pytest.approx(second.logprobs.token_logprobs[1:], abs=1e-6)
    plain = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=2, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(prompt) and plain.choices[0].logprobs is None
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "echo": True})
    assert (r.status_code, error_of(r)["param"]) == (400, "echo"), r.text


def test_an_echoed_token_id_prompt_keeps_its_special_tokens_as_its_log_probs_do(server):
    """`prompt: [1, 504]` (<|im_start|>The) echoed "The" while its log-probs' tokens began with
    "<|im_start|>" and their text_offset counted it, pointing past the text's end; the same
    prompt sent as text echoed "<|im_start|>The". As vLLM: the special token is in the text."""
    with server.client() as c:
        answers = [c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True,
                                                   "logprobs": 0}).json()["choices"][0]
                   for prompt in ([1, 504], "<|im_start|>The")]
    for choice in answers:
        lp = choice["logprobs"]
        assert choice["text"].startswith("<|im_start|>The"), choice["text"]
        assert choice["text"] == "".join(lp["tokens"])
        assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    assert answers[0]["text"] == answers[1]["text"]


def test_vllms_prompt_logprobs_give_each_prompt_tokens_log_prob_rank_and_top_ones(server):
    """vLLM's `prompt_logprobs: k` was refused. As vLLM: per prompt token (null for the first),
    {token id: {logprob, rank, decoded_token}}, the token itself first, then its position's k most
    likely; on a completion's choices, and on a chat's response. The values are those `echo`
    with logprobs gives."""
    prompt = "The capital of France is Paris"
    with server.client() as c:
        echoed = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": True,
                                                 "logprobs": 3}).json()["choices"][0]["logprobs"]
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                            "prompt_logprobs": 2, "n": 2, "seed": 1})
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                    "prompt_logprobs": 0}).json()
        refused = [c.post("/v1/completions", json={"prompt": prompt, **extra})
                   for extra in ({"prompt_logprobs": -1}, {"prompt_logprobs": 21},
                                 {"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": "2"})]
    plp = choices[0]["prompt_logprobs"]
    assert choices[1]["prompt_logprobs"] == plp
    n = len(echoed["tokens"]) - 1  # the prompt's tokens
    assert len(plp) == n and plp[0] is None
    for pos in range(1, n):
        entry, token = plp[pos], echoed["tokens"][pos]
        own = next(iter(entry.values()))  # the prompt token first
        assert own["decoded_token"] == token
        assert own["logprob"] == pytest.approx(echoed["token_logprobs"][pos], abs=1e-6)
        tops = sorted(echoed["top_logprobs"][pos].values(), reverse=True)[:2]
        others = sorted((e for e in entry.values() if e["rank"] <= 2), key=lambda e: e["rank"])
        assert [e["rank"] for e in others] == [1, 2] and len(entry) in (2, 3)
        assert [e["logprob"] for e in others] == pytest.approx(tops, abs=1e-6)
        if own["rank"] <= 2:  # among the top ones: one entry, which the ranks order
            assert own in others
        else:
            assert own["logprob"] <= tops[-1] + 1e-6
    ids = server.client().post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
    chat_plp = chat["prompt_logprobs"]
    assert len(chat_plp) == len(ids) and chat_plp[0] is None
    assert all(list(e) == [str(t)] and e[str(t)]["rank"] >= 1 for e, t in zip(chat_plp[1:], ids[1:]))
    assert [(x.status_code, error_of(x)["param"]) for x in refused] == [(400, "prompt_logprobs")] * 3 + [
        (422, "prompt_logprobs")], [x.text for x in refused]


def test_echo_with_max_tokens_0_answers_the_prompt_alone(server):
    """`echo` with max_tokens 0 (how HELM and older lm-eval score a text) was a 400. As OpenAI's
    completions and vLLM: the prompt alone, its tokens' log-probs, finish_reason "length", no
    generated token counted. Without echo, 0 is still refused, naming echo."""
    prompt = "The capital of France is Paris"
    client = server.openai()
    scored = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=1, temperature=0,
                                       logprobs=2, echo=True).choices[0].logprobs
    n = len(scored.tokens) - 1  # the prompt's tokens
    out = client.completions.create(model="smollm2-135m", prompt=[prompt, "Hello"], max_tokens=0, logprobs=2,
                                    echo=True)
    first, second = out.choices
    assert (first.text, second.text) == (prompt, "Hello")
    assert first.finish_reason == "length" and out.usage.completion_tokens == 0
    assert first.logprobs.tokens == scored.tokens[:n] and first.logprobs.token_logprobs[0] is None
    assert first.logprobs.token_logprobs[1:] == pytest.approx(scored.token_logprobs[1:n], abs=1e-6)
    assert first.logprobs.text_offset == scored.text_offset[:n]
    plain = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=0, echo=True).choices[0]
    assert (plain.text, plain.logprobs) == (prompt, None)
    with server.client() as c:
        for body in ({"prompt": prompt, "max_tokens": 0},
                     {"prompt": prompt, "max_tokens": 0, "echo": True, "min_tokens": 1},
                     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}):
            r = c.post("/v1/chat/completions" if "messages" in body else "/v1/completions", json=body)
            assert r.status_code == 400, (body, r.text)
            assert error_of(r)["param"] in ("max_tokens", "min_tokens"), r.text
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0})
        assert "0 only with echo: true" in error_of(r)["message"], r.text


def test_vllms_tokenize_detokenize_and_version_routes(server):
    """vLLM's /tokenize, /detokenize and /version were 404s. /tokenize renders a prompt or chat
    messages as the endpoints render them: its ids are those a request's prompt counts."""
    hi = [{"role": "user", "content": "hi"}]
    with server.client() as c:
        chat = c.post("/tokenize", json={"messages": hi, "return_token_strs": True}).json()
        answer = c.post("/v1/chat/completions", json={"messages": hi, "max_tokens": 1}).json()
        assert chat["count"] == len(chat["tokens"]) == answer["usage"]["prompt_tokens"]
        assert chat["max_model_len"] == 8192 and len(chat["token_strs"]) == chat["count"]
        text = c.post("/tokenize", json={"prompt": "Hello world"}).json()
        assert text["token_strs"] is None
        assert c.post("/detokenize", json={"tokens": text["tokens"]}).json() == {"prompt": "Hello world"}
        back = c.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
        assert back.startswith("<|im_start|>") and back.endswith("<|im_start|>assistant\n")  # as vLLM's: specials kept
        assert c.get("/version").json()["version"]
        for path, body, status, param in (("/tokenize", {}, 400, "prompt"),
                                          ("/tokenize", {"prompt": "a", "messages": hi}, 400, "prompt"),
                                          ("/tokenize", {"prompt": 5}, 422, "prompt"),
                                          ("/tokenize", {"prompt": "a", "model": "gpt-4o"}, 404, "model"),
                                          ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
                                          ("/detokenize", {"tokens": "abc"}, 422, "tokens")):
            r = c.post(path, json=body)
            assert (r.status_code, error_of(r)["param"]) == (status, param), (path, body, r.text)


def test_unknown_fields_are_ignored_and_named_once_in_the_log(server):
    """As vLLM: a field no API knows is ignored and named in the log (it was ignored silently,
    while the Batch API's own endpoints refuse theirs, as OpenAI does)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "zz_unknown_b": 1, "zz_unknown_a": 2}
    with server.client() as c:
        for _ in range(2):
            assert c.post("/v1/chat/completions", json=body).status_code == 200
    log = server.output()
    assert log.count("ignored: zz_unknown_a, zz_unknown_b (each is named once)") == 1, log[-3000:]


def test_a_value_of_the_wrong_type_is_shown_in_the_message(server):
    # The message said "Input should be a valid number", not what was sent.
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"})
        missing = c.post("/v1/chat/completions", json={"max_tokens": 8})
    assert r.status_code == 422 and error_of(r)["param"] == "temperature", r.text
    assert "temperature: " in error_of(r)["message"] and 'got "hot"' in error_of(r)["message"], r.text
    assert missing.status_code == 422 and "got" not in error_of(missing)["message"], missing.text  # nothing was sent


def test_a_wrong_type_is_named_by_its_field_and_shown_as_json(server):
    """param read "stop.str" (pydantic's name of the union member), and values were Python's
    (True, None)."""
    with server.client() as c:
        stop = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "stop": 123})
        flag = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": True, "echo": None, "n": None,
                                               "user": True})
    assert stop.status_code == 422 and error_of(stop)["param"] == "stop", stop.text
    assert "stop: " in error_of(stop)["message"] and "got 123" in error_of(stop)["message"]
    assert flag.status_code in (400, 422) and "True" not in error_of(flag)["message"], flag.text


@pytest.mark.parametrize("body, code", [
    ({"prompt": "hi", "echo": True, "stream": True}, "unsupported_parameter"),
    ({"prompt": "hi", "logprobs": 21}, "invalid_parameter"),
    ({"prompt": []}, "invalid_prompt"),
    ({"prompt": ["ok", ""]}, "invalid_prompt"),
    ({"prompt": [1, 2] * 5000}, "context_length_exceeded"),
    ({"prompt": "hi", "best_of": 3, "stream": True}, "invalid_parameter"),  # one chunk came; OpenAI refuses it
])
def test_completion_errors(server, body, code):
    with server.client() as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert error_of(r)["code"] == code


def test_a_null_max_completion_tokens_from_the_openai_client_keeps_max_tokens(server):
    """The client sends "max_completion_tokens": null beside max_tokens where a caller passes
    None; the answer ran to the context's end (8,156 tokens, minutes on 2 cores)."""
    chat = server.openai().chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Write a long essay about cats."}],
        max_tokens=2, max_completion_tokens=None)
    assert chat.usage.completion_tokens <= 2, chat.usage
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "Cats", "max_tokens": 3, "max_completion_tokens": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3, r.text


def test_unknown_route_and_method(server):
    with server.client() as c:
        r = c.get("/v1/nothing")
        assert r.status_code == 404 and error_of(r)["code"] == "not_found"
        r = c.get("/v1/chat/completions")
        assert r.status_code == 405 and error_of(r)["code"] == "method_not_allowed"


def test_body_over_the_limit_is_413(server):
    big = {"prompt": "x" * (BODY_LIMIT + 10), "max_tokens": 1}
    with server.client() as c:
        r = c.post("/v1/completions", json=big)
        assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"

        def chunks():  # no Content-Length: the limit applies while the body is read
            data = json.dumps(big).encode()
            for i in range(0, len(data), 8192):
                yield data[i:i + 8192]
        r = c.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"


def test_openai_client_raises_its_errors(server):
    client = server.openai()
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "hi"}],
                                       temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model="smollm2-135m", messages="hi")


def test_health_ready_and_metrics(server):
    with server.client() as c:
        assert c.get("/health").json() == {"status": "ok"}
        assert c.get("/ready").status_code == 200
        c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        metrics = c.get("/metrics")
        text = metrics.text
    # The text is prometheus_client's 0.0.4 format, which its header said was 1.0.0.
    assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4"), metrics.headers
    for name in ("batchprompt_requests_running", "batchprompt_requests_waiting", "batchprompt_prefix_cache_hit_rate",
                 "batchprompt_kv_cache_usage", "batchprompt_generation_tokens_per_second",
                 "batchprompt_http_request_duration_seconds_bucket", "batchprompt_model_loaded 1.0"):
        assert name in text, name
    assert 'batchprompt_http_requests_total{method="POST",route="/v1/completions",status="200"}' in text


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in the metrics")


def test_a_client_that_disconnects_has_its_request_cancelled(server):
    before = server.stats()
    body = json.dumps(LONG_COMPLETION).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        server.wait_until(lambda s: s["engine"]["running"] >= 1, "the request reached the engine")
    finally:
        sock.close()
    after = server.wait_until(lambda s: s["engine"]["running"] == 0 and s["engine"]["waiting"] == 0,
                              "the engine dropped the request")
    assert after["server"]["requests_cancelled"].get("client_disconnected", 0) == \
        before["server"]["requests_cancelled"].get("client_disconnected", 0) + 1
    assert after["server"]["prompts_pending"] == 0
    generated = after["engine"]["generation_tokens"] - before["engine"]["generation_tokens"]
    assert generated < LONG_COMPLETION["max_tokens"]
    with server.client() as c:
        metrics = c.get("/metrics").text
    assert _metric(metrics, 'batchprompt_server_requests_cancelled_total{reason="client_disconnected"}') >= 1


def test_a_stream_that_disconnects_has_its_request_cancelled(server):
    before = server.stats()
    with server.client() as c, c.stream("POST", "/v1/completions", json={**LONG_COMPLETION, "stream": True}) as r:
        assert r.status_code == 200
        server.wait_until(lambda s: s["engine"]["running"] >= 1, "the request reached the engine")
    after = server.wait_until(lambda s: s["engine"]["running"] == 0 and s["engine"]["waiting"] == 0,
                              "the engine dropped the streamed request")
    assert after["server"]["requests_cancelled"].get("client_disconnected", 0) == \
        before["server"]["requests_cancelled"].get("client_disconnected", 0) + 1
    assert after["engine"]["generation_tokens"] - before["engine"]["generation_tokens"] < LONG_COMPLETION["max_tokens"]


@pytest.mark.parametrize("url, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999999": 5}},
     "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [99999999]},
     "stop_token_ids"),
    ("/v1/completions", {"prompt": [[1, 99999999]]}, "prompt"),
    ("/v1/completions", {"prompt": ["hi", "there"], "logit_bias": {"60000": 1}}, "logit_bias"),
])
def test_a_token_id_outside_the_vocabulary_is_refused_before_a_stream_starts(server, url, body, param):
    """Streamed, the engine's refusal was a 200 with an error event (the `openai` client raised
    a bare APIError, no BadRequestError); OpenAI and vLLM refuse the request. Both are now the
    same 400, naming the field."""
    body = {**body, "max_tokens": 2}
    with server.client() as c:
        whole = c.post(url, json=body)
        streamed = c.post(url, json={**body, "stream": True})
    assert whole.status_code == streamed.status_code == 400, (whole.text, streamed.text)
    assert error_of(streamed) == error_of(whole) and "outside the vocabulary" in error_of(whole)["message"]
    assert error_of(whole)["param"] == param
