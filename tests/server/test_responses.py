"""How a failed result is answered: the request's fault (400) or the server's (500)."""
from __future__ import annotations

import pytest

from batchprompt.api.result import Result, Usage
from batchprompt.server.responses import result_error


@pytest.mark.parametrize("message", [
    "the model failed on this step: RuntimeError: probability tensor contains either `inf`, `nan` or element < 0",
    "the engine failed: RuntimeError: boom",
    "the engine could not queue this prompt: RuntimeError: cannot build the grammar's tokenizer",
])
def test_an_engine_or_model_failure_is_a_server_error(message):
    # A model step that raised was answered 400 invalid_request: the client was told to fix a
    # request that was fine, and the fuzz's "no 5xx" could not see the server's failure.
    e = result_error(Result(0, error=message))
    assert (e.status, e.code, e.message) == (500, "engine_error", message)


def test_a_request_the_model_cannot_hold_is_the_clients_error():
    message = ("the model ran out of memory running this request alone, one token at a time (OutOfMemoryError: "
               "x): shorten the prompt, or leave the model more memory")
    e = result_error(Result(0, error=message))
    assert (e.status, e.code) == (400, "context_length_exceeded")


# ---- streamed text: held back while it may still change ------------------------------------
def _plan(stop=(), chat=True):
    """A one-choice plan whose tokens are single bytes (decoded as UTF-8, bad bytes as U+FFFD,
    as a byte-level tokenizer decodes)."""
    from batchprompt.api.batch import Prepared
    from batchprompt.engine import SamplingParams
    from batchprompt.jobs.rows import CHAT, COMPLETION, Row
    from batchprompt.server.requests import Plan

    row = Row(1, "x", CHAT if chat else COMPLETION, messages=[{"role": "user", "content": "hi"}] if chat else None,
              prompt=None if chat else "hi")
    return Plan("rid", [row], 1, [Prepared(0, [1], SamplingParams(max_tokens=64, stop=stop))],
                lambda t: bytes([t]).decode("utf-8", "replace"), lambda ids: bytes(ids).decode("utf-8", "replace"))


def _stream(plan, text: str, final: str, chat=True) -> list[str]:
    """The texts a client reads: each token (byte) of `text` streamed but the last, which comes
    with the result `final` (the step that makes a request's last token finishes it)."""
    import json

    from batchprompt.api.result import Result
    from batchprompt.server.responses import Chunks

    chunks = Chunks(plan, chat, "m", 0, include_usage=False)
    events = []
    for b in text.encode()[:-1]:
        events += chunks.tokens(0, [b])
    events += chunks.result(0, Result(0, final, "stop", token_ids=list(final.encode())))
    out = []
    for e in events:
        choice = json.loads(e.removeprefix("data: "))["choices"][0]
        out.append(choice["delta"].get("content", "") if chat else choice["text"])
    return [t for t in out if t]


def test_a_character_made_of_several_tokens_is_sent_whole():
    pieces = _stream(_plan(), "ok \U0001F600 fine é", "ok \U0001F600 fine é")
    assert "".join(pieces) == "ok \U0001F600 fine é"
    assert not any("\ufffd" in p for p in pieces), pieces
    assert len(pieces) > 5  # sent as it came, not at the end


def test_text_that_may_begin_a_stop_string_is_held_until_it_cannot():
    # The output met "STOP" after "abc ST": the engine cut it; nothing of it was ever sent.
    pieces = _stream(_plan(stop=("STOP",)), "abc STOP", "abc ")
    assert "".join(pieces) == "abc " and all("S" not in p for p in pieces)
    # An "S" that turned out not to start it is sent once what follows shows it.
    pieces = _stream(_plan(stop=("STOP",)), "a Sun and more", "a Sun and more")
    assert "".join(pieces) == "a Sun and more" and len(pieces) > 3


def test_completions_stream_text_pieces_too():
    pieces = _stream(_plan(chat=False), "one two three", "one two three", chat=False)
    assert "".join(pieces) == "one two three" and len(pieces) > 3


@pytest.mark.parametrize("continuous, include", [(True, True), (False, True), (True, False)])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(continuous, include):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): it was ignored, each
    chunk's usage null until the last."""
    import json

    from batchprompt.server.responses import Chunks

    chunks = Chunks(_plan(), True, "m", 0, include_usage=include, continuous_usage=continuous)
    events = chunks.start() + chunks.tokens(0, [104]) + chunks.tokens(0, [105])
    events += chunks.result(0, Result(0, "hi!", "stop", usage=Usage(1, 3), token_ids=[104, 105, 33]))
    usages = [json.loads(e.removeprefix("data: ")).get("usage", "absent") for e in events]
    if not include:
        assert usages == ["absent"] * len(events)
    elif not continuous:
        assert usages == [None] * len(events)
    else:
        made = [u["completion_tokens"] for u in usages]
        assert made[0] == 0 and made == sorted(made) and made[-1] == 3, usages
        assert all(u["prompt_tokens"] == 1 and u["total_tokens"] == 1 + u["completion_tokens"] for u in usages)


def test_continuous_usage_stats_count_each_choice_alone_as_vllm_does():
    """With n = 2 the usage so far summed both choices' tokens (1, 2, 3, 4 where vLLM says 1, 1, 2, 2)."""
    import json

    from batchprompt.api.batch import Prepared
    from batchprompt.engine import SamplingParams
    from batchprompt.server.responses import Chunks

    plan = _plan()
    plan = type(plan)("rid", plan.rows, 2, [Prepared(i, [1, 2, 3], SamplingParams(max_tokens=8)) for i in range(2)],
                      plan.token_text, plan.decode)
    chunks = Chunks(plan, True, "m", 0, include_usage=True, continuous_usage=True)
    events = chunks.start() + chunks.tokens(0, [104]) + chunks.tokens(1, [105]) + chunks.tokens(0, [106])
    events += chunks.tokens(1, [107])
    usages = [json.loads(e.removeprefix("data: "))["usage"] for e in events]
    assert [u["completion_tokens"] for u in usages] == [0, 1, 1, 2, 2]
    assert all(u["prompt_tokens"] == 3 for u in usages)


def test_an_async_batch_cancelled_after_its_last_result_completed():
    """A cancel, or a server's stop, that came as the last prompt finished cancelled nothing:
    the batch said "cancelled" with every result there."""
    from types import SimpleNamespace

    from batchprompt.server.batches import AsyncBatch

    done = [Result(0, text="a", finish_reason="length"), Result(1, text="b", finish_reason="stop")]
    job = AsyncBatch(SimpleNamespace(results=done), session=None, model="m", cancel_asked=True, finished_at=1.0)
    assert job.status == "completed"
    job.batch.results = [done[0], Result(1, finish_reason="cancelled", error="cancelled before it finished")]
    assert job.status == "cancelled"
    job.finished_at = None
    assert job.status == "cancelling"


def test_a_route_s_answer_holding_a_lone_surrogate_is_written_with_json_s_escape():
    """A batch stored with such metadata by an earlier version: pydantic's writer of a route's
    dict raised on it, so every list of batches that held it was a 500."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from batchprompt.server.errors import JSONAnswer

    app = FastAPI(default_response_class=JSONAnswer)

    @app.get("/x")
    async def x() -> dict:
        return {"metadata": {"k": "\ud800"}, "name": "é"}

    r = TestClient(app).get("/x")
    assert r.status_code == 200 and r.content == '{"metadata":{"k":"\\ud800"},"name":"é"}'.encode()
    assert r.json() == {"metadata": {"k": "\ud800"}, "name": "é"}
