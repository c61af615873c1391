"""Request bodies planned for the engine (server/requests.py): each refusal is a 400 whose
`param` names the body field it is about, as OpenAI fills it."""
from __future__ import annotations

import pytest

from batchprompt.remote.tokenizer import load_tokenizer
from batchprompt.server.errors import ApiError
from batchprompt.jobs.rows import CHAT, Row
from batchprompt.server.requests import plan_chat, plan_completion, plan_row

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
    # vLLM fields that change the prompt or the output were accepted and ignored
    ({"bad_words": ["Hello"]}, "bad_words"),
    ({"tool_choice": "required"}, "tool_choice"),  # a forced tool call was answered with plain text
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"allowed_token_ids": [28, 29]}, "allowed_token_ids"),
    ({"truncate_prompt_tokens": 5}, "truncate_prompt_tokens"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"skip_special_tokens": False}, "skip_special_tokens"),
    ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
    ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
    ({"continue_final_message": True}, "continue_final_message"),  # add_generation_prompt is true unless set
    ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
])
def test_a_chat_refusal_names_the_field(tokenizer, body, param):
    with pytest.raises(ApiError) as e:
        plan_chat({"messages": M, **body}, tokenizer, 8192)
    assert (e.value.status, e.value.param) == (400, param), e.value.message


@pytest.mark.parametrize("schema", ['"abc"', "[1]"])
def test_a_guided_json_that_is_no_schema_object_is_named_as_sent(tokenizer, schema):
    # It said "json_schema must be a dict (a JSON schema) or a pydantic model class, got str".
    with pytest.raises(ApiError) as e:
        plan_chat({"messages": M, "guided_json": schema}, tokenizer, 8192)
    assert (e.value.status, e.value.param) == (400, "guided_json")
    assert e.value.message.startswith("guided_json must be a JSON schema: an object"), e.value.message
    assert "pydantic" not in e.value.message and "got a" in e.value.message


@pytest.mark.parametrize("fmt", [{"type": "xml"}, {"json_schema": {}}])
def test_a_bad_response_format_names_only_what_a_body_can_give(tokenizer, fmt):
    # It offered "or a pydantic model class", which only the Python API can give.
    with pytest.raises(ApiError) as e:
        plan_chat({"messages": M, "response_format": fmt}, tokenizer, 8192)
    assert (e.value.status, e.value.param) == (400, "response_format")
    assert "pydantic" not in e.value.message and '{"type": "json_object"}' in e.value.message, e.value.message


def test_an_over_long_completion_prompt_names_prompt(tokenizer):
    with pytest.raises(ApiError) as e:
        plan_completion({"prompt": ["x", "hi " * 9000]}, tokenizer, 8192)
    assert (e.value.status, e.value.code, e.value.param) == (400, "context_length_exceeded", "prompt")
    assert e.value.message.startswith("prompt 1 has 9001 tokens")


def test_a_lone_surrogate_names_the_field_not_a_python_class(tokenizer):
    """It said "the prompt cannot be rendered: ValueError: the text holds ...", with no param."""
    for plan, body, param in ((plan_chat, {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages"),
                              (plan_completion, {"prompt": "a\ud800b"}, "prompt")):
        with pytest.raises(ApiError) as e:
            plan(body, tokenizer, 8192)
        assert (e.value.status, e.value.code, e.value.param) == (400, "invalid_prompt", param), e.value.message
        assert "ValueError" not in e.value.message and "holds a lone surrogate '\\ud800'" in e.value.message


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_beyond_the_context_names_the_field_given(tokenizer, field):
    """max_completion_tokens too large was refused as "max_tokens 100000" with param max_tokens."""
    with pytest.raises(ApiError) as e:
        plan_chat({"messages": M, field: 100000}, tokenizer, 8192)
    assert (e.value.code, e.value.param) == ("context_length_exceeded", field)
    assert f"and {field} 100000; lower {field} to at most" in e.value.message, e.value.message
    with pytest.raises(ApiError) as e:
        plan_row(Row(1, "r", CHAT, messages=M, body={"messages": M, field: 100000}), tokenizer, 8192)
    assert e.value.param == field, e.value.message


@pytest.mark.parametrize("given", [{}, {"max_tokens": None}, {"max_tokens": 16}])
def test_a_completion_whose_default_max_tokens_does_not_fit_says_it_is_the_default(tokenizer, given):
    """A prompt that leaves 4 tokens: "max_tokens 16" was named as if the body had asked for it."""
    ids = plan_completion({"prompt": "hi " * 20}, tokenizer, 8192).prepared[0].token_ids
    with pytest.raises(ApiError) as e:
        plan_completion({"prompt": "hi " * 20, **given}, tokenizer, len(ids) + 4)
    assert (e.value.code, e.value.param) == ("context_length_exceeded", "max_tokens")
    default = "and max_tokens 16 (the default, where the body gives none); lower max_tokens to at most 4"
    assert (default in e.value.message) == ("max_tokens" not in given or given["max_tokens"] is None), e.value.message


def test_guided_json_true_is_any_json_value(tokenizer):
    # A 422 invalid_type, where structured_outputs {"json": true} and guided_json "true" were taken.
    grammar = plan_chat({"messages": M, "guided_json": True}, tokenizer, 8192).prepared[0].params.grammar
    assert grammar == plan_chat({"messages": M, "guided_json": {}}, tokenizer, 8192).prepared[0].params.grammar


def test_structured_outputs_json_object_asks_for_a_json_object(tokenizer):
    plan = plan_chat({"messages": M, "structured_outputs": {"json_object": True, "disable_fallback": True}},
                     tokenizer, 8192)
    assert plan.prepared[0].params.grammar.kind == "json_object"


def test_chat_template_fields_change_the_prompt_as_in_vllm(tokenizer):
    """add_generation_prompt, continue_final_message, add_special_tokens and chat_template_kwargs
    reach the chat template (they were accepted and ignored)."""
    def ids(**fields):
        return plan_chat({"messages": M + [{"role": "assistant", "content": "Hel"}], **fields},
                         tokenizer, 8192).prepared[0].token_ids

    hf = tokenizer.hf
    msgs = M + [{"role": "assistant", "content": "Hel"}]
    opened = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert ids() == hf.encode(opened, add_special_tokens=False)
    closed = hf.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False)
    assert ids(add_generation_prompt=False) == hf.encode(closed, add_special_tokens=False)
    continued = hf.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True, tokenize=False)
    assert continued.endswith("Hel")
    assert ids(add_generation_prompt=False, continue_final_message=True) == hf.encode(continued, add_special_tokens=False)
    assert ids(chat_template_kwargs={"enable_thinking": False}) == ids()  # a variable this template does not read
    completion = plan_completion({"prompt": "Hello", "add_special_tokens": False}, tokenizer, 8192)
    assert completion.prepared[0].token_ids == hf.encode("Hello", add_special_tokens=False)


def test_an_unsupported_field_is_shown_as_json():
    # It showed Python's repr: use_beam_search=True, {'type': ...}.
    with pytest.raises(ApiError) as e:
        plan_completion({"prompt": "hi", "use_beam_search": True}, None, 8192)
    assert e.value.message == "use_beam_search: true: batchprompt does not support it; leave it out"


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}}]


def test_tools_with_tool_choice_none_reach_the_chat_template_as_in_vllm():
    """Tools with tool_choice "none" (agent frameworks send their tools with every request) were
    refused: the model may call none, so the answer is text, and vLLM hands the tools to the chat
    template. Without tool_choice "none" they are still refused (no tool call is ever parsed)."""
    tokenizer = load_tokenizer("smollm2-135m")[0]
    tokenizer.hf.chat_template = ("{% if tools %}TOOLS {{ tools | map(attribute='function.name') | join(',') }}\n"
                                  "{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                                  "{% if add_generation_prompt %}assistant:{% endif %}")
    plan = plan_chat({"messages": M, "tools": TOOLS, "tool_choice": "none"}, tokenizer, 8192)
    assert tokenizer.decode(plan.prepared[0].token_ids) == "TOOLS get_weather\nuser: hi\nassistant:"
    assert tokenizer.decode(plan_chat({"messages": M}, tokenizer, 8192).prepared[0].token_ids) == "user: hi\nassistant:"
    for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        with pytest.raises(ApiError) as e:
            plan_chat({"messages": M, **body}, tokenizer, 8192)
        assert (e.value.param, e.value.code) == ("tools", "unsupported_parameter")
        assert 'tool_choice: "none"' in e.value.message
    with pytest.raises(ApiError) as e:
        plan_chat({"messages": M, "tools": [{"type": "function"}], "tool_choice": "none"}, tokenizer, 8192)
    assert (e.value.status, e.value.param) == (400, "tools") and e.value.message.startswith("tools[0] must be")
    with pytest.raises(ApiError) as e:
        plan_chat({"messages": M, "tools": "get_weather", "tool_choice": "none"}, tokenizer, 8192)
    assert e.value.param == "tools" and "must be a list" in e.value.message


@pytest.mark.parametrize("body, message", [
    ({"tool_choice": "auto"}, "tool_choice is only allowed when tools are given"),
    ({"tool_choice": "bogus"}, 'tool_choice must be "none", "auto", "required" or'),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice must be"),
])
def test_tool_fields_that_openai_and_vllm_refuse_are_refused_as_invalid_values(tokenizer, body, message):
    """tool_choice "auto" without tools was answered 200 (OpenAI and vLLM refuse it); a
    tool_choice that is none of its forms was "not supported"."""
    with pytest.raises(ApiError) as e:
        plan_chat({"messages": M, **body}, tokenizer, 8192)
    assert (e.value.status, e.value.code) == (400, "invalid_value"), e.value.message
    assert e.value.message.startswith(message) and e.value.param == "tool_choice"
    plan_chat({"messages": M, "tool_choice": "none"}, tokenizer, 8192)  # "none" alone runs, as in vLLM
    for body in ({"tools": []}, {"tools": [], "tool_choice": "auto"}):  # no tools, as vLLM takes them
        assert plan_chat({"messages": M, **body}, tokenizer, 8192).prepared
    # A completion takes no tools: its tool_choice is ignored, as vLLM ignores it (it became a 400)
    assert plan_completion({"prompt": "hi", "tool_choice": "auto", "max_tokens": 1}, tokenizer, 8192).prepared
