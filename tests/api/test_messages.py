"""Message checks shared by the batch API and the jobs reader: roles, content parts, the system rule."""
from __future__ import annotations

import pytest

from batchprompt.api.messages import check_messages, message_text, with_default_system


def test_openai_roles_are_accepted_and_developer_is_the_system_message():
    msgs = check_messages([
        {"role": "developer", "content": "Be brief.", "name": "ops"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ])
    assert msgs == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"}, {"role": "tool", "content": "42"}]


@pytest.mark.parametrize("messages, match", [
    ([{"role": "wizard", "content": "x"}], r"message 0: unknown role 'wizard'; the roles are system, developer"),
    ([{"role": "user", "content": "x"}, {"role": 1, "content": "x"}], r"message 1: 'role' must be one of"),
    ([{"role": "user", "content": 7}], r"'content' must be a string or a list of text parts"),
    ([{"role": "user", "content": None}], r"'content' must be a string"),
    ([{"role": "user"}], r"the user message has no 'content'"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}], r"tool calls are not supported"),
    # With text too: the calls were dropped without a word, the model shown an empty or partial turn
    ([{"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]}], r"tool calls are not supported"),
    ([{"role": "assistant", "content": "Let me look.", "tool_calls": [{"id": "c"}]}], r"tool calls are not"),
    (["hello"], r"a message is a dict"),
    ([], r"empty list of messages"),
    ({"role": "user", "content": "x"}, r"must be a list of messages"),
])
def test_bad_messages_are_refused_with_a_message_naming_the_fix(messages, match):
    with pytest.raises(ValueError, match=match):
        check_messages(messages, "a prompt")


def test_an_assistant_turn_without_content_is_empty_or_its_refusal():
    # OpenAI's schema lets an assistant message have no content (a refusal's turn, replayed) and
    # vLLM takes it; it was refused. A user's turn still needs its content.
    msgs = check_messages([{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "refusal": "no"},
                           {"role": "user", "content": "y"}, {"role": "assistant"}])
    assert [m["content"] for m in msgs] == ["x", "no", "y", ""]


def test_an_empty_list_is_allowed_where_asked():
    assert check_messages([], "initial_prompts", allow_empty=True) == []


def test_text_parts_are_joined_with_newlines_as_vllm_does():
    parts = [{"type": "text", "text": "Classify:"}, {"type": "input_text", "text": "WIN NOW"}, "bare"]
    assert message_text(parts) == "Classify:\nWIN NOW\nbare"
    msgs = check_messages([{"role": "user", "content": [{"type": "text", "text": "only"}]}])
    assert msgs == [{"role": "user", "content": "only"}]
    assert message_text([{"type": "refusal", "refusal": "no"}]) == "no"


@pytest.mark.parametrize("content, match", [
    ([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}], r"part 0 of type 'image_url' is not supported"),
    ([{"type": "text", "text": "a"}, {"type": "input_audio", "input_audio": {}}], r"part 1 of type 'input_audio'"),
    ([{"text": "no type"}], r"content part 0 \{'text': 'no type'\} has no 'type'; a text part is"),  # not "text only"
    ([{"type": "text", "text": None}], r"needs a string 'text'"),
    ([], r"empty list of parts"),
])
def test_other_content_parts_are_refused_by_name(content, match):
    with pytest.raises(ValueError, match=match):
        check_messages([{"role": "user", "content": content}])


def test_a_prompts_own_system_message_replaces_the_default():
    system = {"role": "system", "content": "default"}
    shot = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    user = [{"role": "user", "content": "x"}]
    own = [{"role": "system", "content": "mine"}] + user
    assert with_default_system([system] + shot, user) == [system] + shot + user
    assert with_default_system([system] + shot, own) == own[:1] + shot + user
    assert with_default_system(shot, own) == own[:1] + shot + user  # the system message comes first
    assert with_default_system([], own) == own


def test_the_session_checks_messages_with_the_shared_rules():
    from batchprompt.api.session import _check_messages

    with pytest.raises(ValueError, match="a prompt is an empty list"):
        _check_messages([], "a prompt")
    with pytest.raises(ValueError, match="unknown role 'wizard'"):
        _check_messages([{"role": "wizard", "content": "x"}], "a prompt")
    assert _check_messages([], "initial_prompts") == []
    assert _check_messages([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "a prompt") == \
        [{"role": "user", "content": "hi"}]
