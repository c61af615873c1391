"""Request bodies planned for the engine (server/requests.py): each refusal is a 400 whose
`param` names the body field it is about, as OpenAI fills it."""
from __future__ import annotations

import pytest

from batchprompt.remote.tokenizer import load_tokenizer
from batchprompt.server.errors import ApiError
from batchprompt.server.requests import plan_chat, plan_completion

M = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")[0]


@pytest.mark.parametrize("body, param", [
    ({"structured_outputs": {"foo": 1}}, "structured_outputs"),  # was ignored: the request ran unconstrained
    ({"structured_outputs": {"regex": "("}}, "structured_outputs"),  # param was null
    ({"guided_regex": "("}, "guided_regex"),
    ({"structured_outputs": {"json": {"type": "bogus"}}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format"),
    ({"messages": [{"role": "user", "content": "hi " * 9000}]}, "messages"),  # was null
    ({"max_tokens": 9000}, "max_tokens"),
    ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "guided_regex"),  # guided_regex won, silently
    ({"guided_json": {"type": "object"}, "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),  # ignored
])
def test_a_chat_refusal_names_the_field(tokenizer, body, param):
    with pytest.raises(ApiError) as e:
        plan_chat({"messages": M, **body}, tokenizer, 8192)
    assert (e.value.status, e.value.param) == (400, param), e.value.message


def test_an_over_long_completion_prompt_names_prompt(tokenizer):
    with pytest.raises(ApiError) as e:
        plan_completion({"prompt": ["x", "hi " * 9000]}, tokenizer, 8192)
    assert (e.value.status, e.value.code, e.value.param) == (400, "context_length_exceeded", "prompt")
    assert e.value.message.startswith("prompt 1 has 9001 tokens")


def test_structured_outputs_json_object_asks_for_a_json_object(tokenizer):
    plan = plan_chat({"messages": M, "structured_outputs": {"json_object": True, "disable_fallback": True}},
                     tokenizer, 8192)
    assert plan.prepared[0].params.grammar.kind == "json_object"
