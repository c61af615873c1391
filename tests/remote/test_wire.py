"""SamplingParams as a /v1/completions body (the fields our server and vLLM read), and the
answer back."""
from __future__ import annotations

import pytest

from batchprompt.engine import SamplingParams
from batchprompt.remote import EndpointError
from batchprompt.remote.wire import (CompletionStream, completion_body, parse_completions, streams,
                                     structured_fields, to_output)
from batchprompt.structured import Grammar


def test_body_carries_every_option_that_is_set():
    p = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=20, seed=3, stop=("\n",), presence_penalty=0.5,
                       repetition_penalty=1.1, min_p=0.05, min_tokens=2, logit_bias={5: -1.0}, logprobs=True,
                       top_logprobs=2)
    body = completion_body("m", [[1, 2, 3], [4]], p)
    assert body == {"model": "m", "prompt": [[1, 2, 3], [4]], "max_tokens": 7, "temperature": 0.5, "top_p": 0.9,
                    "top_k": 20, "seed": 3, "stop": ["\n"], "presence_penalty": 0.5, "repetition_penalty": 1.1,
                    "min_p": 0.05, "min_tokens": 2, "logit_bias": {"5": -1.0}, "logprobs": 2,
                    "return_tokens_as_token_ids": True, "return_token_ids": True}
    assert completion_body("m", [[1]], SamplingParams()) == {"model": "m", "prompt": [[1]], "max_tokens": 16,
                                                            "temperature": 1.0, "return_token_ids": True}


@pytest.mark.parametrize("grammar, modern, guided", [
    (Grammar.regex("[0-9]+"), {"structured_outputs": {"regex": "[0-9]+"}}, {"guided_regex": "[0-9]+"}),
    (Grammar.choices(["yes", "no"]), {"structured_outputs": {"choice": ["yes", "no"]}}, {"guided_choice": ["yes", "no"]}),
    (Grammar.lark('start: "a"'), {"structured_outputs": {"grammar": 'start: "a"'}}, {"guided_grammar": 'start: "a"'}),
    (Grammar.json_object(), {"response_format": {"type": "json_object"}}, {"response_format": {"type": "json_object"}}),
])
def test_structured_output_fields(grammar, modern, guided):
    assert structured_fields(grammar) == modern
    assert structured_fields(grammar, "guided") == guided


def test_answers_are_grouped_per_prompt_in_index_order():
    data = {"choices": [{"index": 1, "text": "b", "finish_reason": "length"},
                        {"index": 0, "text": "a", "finish_reason": "stop"}]}
    per = parse_completions(data, 2, 1, "x")
    assert [[s.text for s in p] for p in per] == [["a"], ["b"]]
    with pytest.raises(EndpointError, match="expected 3 choices, got 2"):
        parse_completions(data, 3, 1, "x")
    # It read "expected 1 choices, got NoneType".
    with pytest.raises(EndpointError, match=r"x: the answer has no list of choices \(its `choices`: NoneType\)"):
        parse_completions({"id": "cmpl-1"}, 1, 1, "x")


class _Tok:
    eos_token_ids = frozenset({2})

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


def test_token_ids_from_the_server_or_encoded_again():
    given = parse_completions({"choices": [{"index": 0, "text": "hi", "finish_reason": "stop", "logprobs": {
        "tokens": ["token_id:104", "token_id:105"], "token_logprobs": [-0.1, -0.2], "top_logprobs": None}}]}, 1, 1, "x")
    out = to_output("r", [1], given[0], SamplingParams(logprobs=True), _Tok())
    assert out.output_token_ids == [104, 105] and out.logprobs == [-0.1, -0.2]
    ids = parse_completions({"choices": [{"index": 0, "text": "hi", "finish_reason": "length",
                                          "token_ids": [7, 8, 9]}]}, 1, 1, "x")  # return_token_ids: as given
    assert to_output("r", [1], ids[0], SamplingParams(), _Tok()).output_token_ids == [7, 8, 9]
    again = parse_completions({"choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}]}, 1, 1, "x")
    assert to_output("r", [1], again[0], SamplingParams(), _Tok()).output_token_ids == [104, 105, 2]  # + EOS
    cut = parse_completions({"choices": [{"index": 0, "text": "hi", "finish_reason": "length"}]}, 1, 1, "x")
    assert to_output("r", [1], cut[0], SamplingParams(), _Tok()).output_token_ids == [104, 105]


def test_a_stream_answers_each_prompt_when_its_choices_end():
    """Chunks as vLLM and our server send them (choice index = prompt * n + sample): a prompt is
    complete once its n choices have a finish_reason, its pieces (text, token ids, log-probs)
    joined in order."""
    s = CompletionStream(n_prompts=2, n=2, where="http://x")
    assert s.feed({"choices": [{"index": 0, "text": "Hel", "token_ids": [1], "finish_reason": None},
                               {"index": 2, "text": "a", "finish_reason": "stop", "token_ids": [9]}]}) == []
    assert s.feed({"choices": [{"index": 0, "text": "lo", "token_ids": [2], "finish_reason": "length"}]}) == []
    done = s.feed({"choices": [{"index": 1, "text": "Yo", "token_ids": [3, 4], "finish_reason": "stop",
                                "logprobs": {"token_logprobs": [-0.5, -0.25], "tokens": ["Y", "o"]}}]})
    assert [(p, [(x.text, x.finish_reason, x.token_ids) for x in samples]) for p, samples in done] == \
        [(0, [("Hello", "length", [1, 2]), ("Yo", "stop", [3, 4])])]
    assert done[0][1][1].logprobs == [-0.5, -0.25] and s.unfinished() == 1
    assert s.feed({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 6}}) == []
    assert [p for p, _ in s.feed({"choices": [{"index": 3, "text": "", "finish_reason": "stop"}]})] == [1]
    assert s.unfinished() == 0 and s.usage == {"prompt_tokens": 5, "completion_tokens": 6}


@pytest.mark.parametrize("error, kind", [
    ({"message": "bad prompt", "type": "BadRequestError", "code": 400}, "request"),  # vLLM's
    ({"message": "bad prompt", "type": "invalid_request_error", "param": None, "code": "context_length_exceeded"},
     "request"),  # ours
    ({"message": "shutting down", "type": "service_unavailable", "code": "shutting_down"}, "overloaded"),
    ({"message": "boom", "type": "server_error", "code": None}, "server"),
    ("a bare string", "server"),
])
def test_an_error_inside_a_stream_is_sorted_as_its_status_would_be(error, kind):
    s = CompletionStream(n_prompts=1, n=1, where="http://x")
    with pytest.raises(EndpointError) as e:
        s.feed({"error": error})
    assert e.value.kind == kind and e.value.status is None  # never taken for a refusal of token ids


def test_a_chunk_with_a_choice_out_of_range_is_the_servers_fault():
    s = CompletionStream(n_prompts=1, n=1, where="http://x")
    with pytest.raises(EndpointError, match="index 5") as e:
        s.feed({"choices": [{"index": 5, "text": "x", "finish_reason": "stop"}]})
    assert e.value.kind == "server"


def test_streaming_is_asked_except_where_servers_refuse_it():
    body = completion_body("m", [[1]], SamplingParams(), stream=True)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert streams(SamplingParams(n=2)) and not streams(SamplingParams(n=1, best_of=3))


def test_a_stream_of_keep_alives_alone_times_out():
    """A server that keeps its stream open with comments alone (a stuck one that still sends
    keep-alives) is a timeout, as a silent one is: the work goes elsewhere."""
    import asyncio
    import time

    from batchprompt.remote.endpoint import Endpoint
    from batchprompt.remote.hostfile import EndpointSpec

    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        try:
            for _ in range(400):
                chunk = b": keep-alive\n\n"
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                await writer.drain()
                await asyncio.sleep(0.05)
        except ConnectionError:
            pass
        writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        e = Endpoint(0, EndpointSpec(f"http://127.0.0.1:{port}"), api_key=None, timeout=0.5, connect_timeout=2,
                     max_in_flight=1, initial_in_flight=1)
        t0 = time.monotonic()
        try:
            with pytest.raises(EndpointError) as err:
                await e.post_stream("/v1/completions", {"prompt": "x"}, lambda chunk: None)
            return err.value, time.monotonic() - t0
        finally:
            await e.close()
            server.close()

    err, took = asyncio.run(main())
    assert err.kind == "timeout" and "only keep-alives" in str(err) and took < 5, (err, took)


def test_a_stream_of_several_choices_without_their_index_is_the_servers_fault():
    """A proxy that dropped `index`: every prompt's pieces were joined into prompt 0's answer,
    an ok result. One choice may leave it out."""
    with pytest.raises(EndpointError, match="a choice of index None") as e:
        CompletionStream(2, 1, "http://h").feed({"choices": [{"text": "a", "finish_reason": None}]})
    assert e.value.kind == "server"
    one = CompletionStream(1, 1, "http://h")
    assert one.feed({"choices": [{"text": "a", "finish_reason": None}]}) == []
    assert [p for p, _ in one.feed({"choices": [{"text": "b", "finish_reason": "stop"}]})] == [0]
