"""Chat messages as OpenAI's Chat Completions API takes them, checked and made plain in one place.

The batch API's prompts and initial_prompts, and the chat rows of `batchprompt run`, all come
through `check_messages`, so both refuse and accept the same input with the same message:

- roles: system, developer, user, assistant, tool. `developer` is OpenAI's newer name for the
  system message (its models read one as the other); open models' chat templates know only
  `system`, so a developer message becomes a system message.
- content: a string, or OpenAI's array of parts. Text parts (`{"type": "text", "text": ...}`,
  also vLLM's `input_text`/`output_text`, and `refusal` in an assistant turn) are joined with
  "\\n", as vLLM joins them. Any other part (image_url, input_audio, file, ...) is refused by
  name: the models we run read text only.
- one rule for a system prompt given twice (`with_default_system`): a default system prompt
  (a session's `system=`, or `batchprompt run --system`) applies to prompts without a system
  message of their own; a prompt that starts with one replaces it.
"""
from __future__ import annotations

from typing import Any

Message = dict[str, str]

ROLES = ("system", "developer", "user", "assistant", "tool")
#: Content part types that carry text, and the field that holds it.
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
PART_SEPARATOR = "\n"  # vLLM joins a message's text parts with a newline


def check_messages(messages: Any, what: str = "messages", *, allow_empty: bool = False) -> list[Message]:
    """Plain `{"role", "content"}` dicts with string content, or a ValueError that names the
    message and what to change. Other keys (name, tool_call_id, ...) are dropped."""
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, (list, tuple)):
        raise ValueError(f"{what} must be a list of messages such as [{{\"role\": \"user\", \"content\": "
                         f"\"...\"}}], got {type(messages).__name__}")
    if not messages and not allow_empty:
        raise ValueError(f"{what} is an empty list of messages: give at least one, such as "
                         f"{{\"role\": \"user\", \"content\": \"...\"}}")
    return [_message(m, f"{what}, message {i}") for i, m in enumerate(messages)]


def _message(m: Any, where: str) -> Message:
    if not isinstance(m, dict):
        raise ValueError(f"{where}: a message is a dict with 'role' and 'content', got {_short(m)}")
    role = m.get("role")
    if not isinstance(role, str):
        raise ValueError(f"{where}: 'role' must be one of {', '.join(ROLES)}, got {_short(role)}")
    if role not in ROLES:
        raise ValueError(f"{where}: unknown role {role!r}; the roles are {', '.join(ROLES)}")
    if m.get("tool_calls"):  # with text or without: dropped, the model saw an empty or partial turn
        raise ValueError(f"{where}: tool calls are not supported; give the {role} turn's text as 'content' "
                         f"without 'tool_calls'")
    if role == "assistant" and m.get("content") is None:  # OpenAI's schema lets an assistant turn have none:
        # a refusal's turn, replayed, reads as its refusal (as a refusal part does); else empty, as vLLM
        refusal = m.get("refusal")
        return {"role": role, "content": refusal if isinstance(refusal, str) else ""}
    if "content" not in m:
        raise ValueError(f"{where}: the {role} message has no 'content'")
    return {"role": "system" if role == "developer" else role, "content": message_text(m["content"], where)}


def message_text(content: Any, where: str = "message") -> str:
    """A message's content as one string: itself, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: 'content' must be a string or a list of text parts "
                         f"[{{\"type\": \"text\", \"text\": \"...\"}}], got {_short(content)}")
    if not content:
        raise ValueError(f"{where}: 'content' is an empty list of parts; give a string or at least one "
                         f"{{\"type\": \"text\", \"text\": \"...\"}} part")
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):  # vLLM takes bare strings among the parts
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind is None and isinstance(part, dict):  # text without its type: not "text only" that fails
            raise ValueError(f"{where}: content part {j} {_short(part)} has no 'type'; a text part is "
                             f"{{\"type\": \"text\", \"text\": \"...\"}}")
        if kind not in TEXT_PARTS:
            shown = f"type {kind!r}" if isinstance(kind, str) else f"{_short(part)} (no 'type')"
            raise ValueError(f"{where}: content part {j} of {shown} is not supported: the model reads "
                             f"text only, so send {{\"type\": \"text\", \"text\": \"...\"}} parts")
        text = part.get(TEXT_PARTS[kind])
        if not isinstance(text, str):
            raise ValueError(f"{where}: content part {j} ({kind}) needs a string {TEXT_PARTS[kind]!r}, "
                             f"got {_short(text)}")
        texts.append(text)
    return PART_SEPARATOR.join(texts)


def with_default_system(default: list[Message], messages: list[Message]) -> list[Message]:
    """`default` (a session's system prompt and initial turns) then `messages`, where a
    system message at the start of `messages` takes the place of the default one."""
    if messages and messages[0]["role"] == "system":
        rest = default[1:] if default and default[0]["role"] == "system" else default
        return messages[:1] + rest + messages[1:]
    return default + messages


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
