"""Bodies that `batchprompt run`, the server's endpoints and its Batch API all refuse, with
OpenAI's error codes: fields that change what a request means and that batchprompt cannot
honour (tools, echo, beam search, ...), and an explicit max_tokens that does not fit the
context beside the prompt (vLLM's rule, rather than an answer cut short at the context's end)."""
from __future__ import annotations

import json

from ..engine.sampling_params import MAX_TOP_LOGPROBS
from .rows import max_tokens_field

#: field -> is the value a no-op? (The sampling options, from presence_penalty to best_of and
#: top_logprobs, go to the engine through run.row_params.)
_NOOP = {
    "suffix": lambda v: v in (None, ""),
    "tools": lambda v: not v,
    "functions": lambda v: not v,
    "tool_choice": lambda v: v in (None, "none", "auto"),  # "required" or a named function: a tool call
    "function_call": lambda v: v in (None, "none", "auto"),
    "use_beam_search": lambda v: not v,
    "guided_whitespace_pattern": lambda v: v is None,  # JSON here is always compact
    # vLLM's fields that change the prompt or the output, unless left at their default
    "truncate_prompt_tokens": lambda v: v is None,
    "allowed_token_ids": lambda v: v is None,
    "bad_words": lambda v: not v,
    "chat_template": lambda v: v is None,
    "documents": lambda v: not v,
    "skip_special_tokens": lambda v: v in (None, True),
    # OpenAI's: audio output and web search
    "audio": lambda v: v is None,
    "modalities": lambda v: v in (None, ["text"]),
    "web_search_options": lambda v: v is None,
}

#: vLLM's chat-template fields, which `chat_template_options` hands to the chat template.
TEMPLATE_FLAGS = ("add_generation_prompt", "continue_final_message", "add_special_tokens")
#: apply_chat_template's own arguments: never a template variable from a body.
_RESERVED_TEMPLATE_KWARGS = {"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                             "add_generation_prompt", "continue_final_message", "padding", "truncation",
                             "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                             "tokenizer_kwargs"}


class Refused(ValueError):
    """A body refused: the message, OpenAI's error `code` and the field (`param`) it is about."""

    def __init__(self, message: str, code: str, param: str | None = None):
        super().__init__(message)
        self.code, self.param = code, param


def refuse_unsupported(body: dict) -> dict:
    """The body to run, or Refused naming a field batchprompt cannot honour."""
    _check_tool_fields(body)
    shown_tools = _tools_shown(body)
    for name, noop in _NOOP.items():
        if name in body and not noop(body[name]) and not (name == "tools" and shown_tools):
            hint = (' (or send tool_choice: "none": the chat template then shows them to the model, which '
                    'answers in text)' if name == "tools" else "")
            raise Refused(f"{name}: {shown(body[name])}: batchprompt does not support it; leave it out{hint}",
                          "unsupported_parameter", name)
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise Refused(f"echo must be true or false, got {shown(echo)}", "invalid_value", "echo")
    if echo and "messages" in body:
        raise Refused("echo: true: batchprompt echoes a completion's prompt, not a chat's messages; leave it out",
                      "unsupported_parameter", "echo")
    if echo and body.get("stream"):
        raise Refused("echo cannot be streamed here: leave out stream or echo", "unsupported_parameter", "echo")
    _check_prompt_logprobs(body)
    if body.get("stream_options") is not None and not body.get("stream"):
        raise Refused("stream_options is only allowed with stream: true", "invalid_parameter", "stream_options")
    _check_template_fields(body)
    if body.get("stream") and body.get("best_of") not in (None, body.get("n") or 1):
        # OpenAI's: "results cannot be streamed"; the best of several is known only at the end.
        raise Refused("best_of other than n cannot be streamed: leave out stream or best_of",
                      "invalid_parameter", "best_of")
    if body.get("best_of") is not None and body.get("best_of") == (body.get("n") or 1):
        # best_of = n picks all n: a no-op clients send, not the best-of-n search (which needs n = 1).
        body = {k: v for k, v in body.items() if k != "best_of"}
    return body


def _check_tool_fields(body: dict) -> None:
    """What OpenAI and vLLM refuse as a value, before asking whether it is supported here: a
    tool_choice of another shape, and a tool_choice other than "none" without tools (they were
    answered 200, or "not supported" for a value that is no tool_choice). An empty `tools`
    (with any tool_choice) is no tools, as vLLM takes it (OpenAI refuses it)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if "messages" not in body:  # a completion's: it takes no tools, and vLLM ignores the field
        return
    if choice is None:
        return
    named = (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
             and isinstance(choice["function"].get("name"), str))
    if choice not in ("none", "auto", "required") and not named:
        raise Refused(f'tool_choice must be "none", "auto", "required" or {{"type": "function", "function": '
                      f'{{"name": ...}}}}, got {shown(choice)}', "invalid_value", "tool_choice")
    if choice != "none" and tools is None:
        raise Refused("tool_choice is only allowed when tools are given (vLLM: \"When using `tool_choice`, `tools` "
                      "must be set\"): leave tool_choice out, or give tools", "invalid_value", "tool_choice")


def _check_prompt_logprobs(body: dict) -> None:
    """vLLM's prompt_logprobs: k from 0 to MAX_TOP_LOGPROBS (its max_logprobs, 20), not streamed."""
    k = body.get("prompt_logprobs")
    if k is None:
        return
    if k == -1 and not isinstance(k, bool):
        raise Refused(f"prompt_logprobs: -1 (the whole vocabulary at each position) is not supported: give 0 to "
                      f"{MAX_TOP_LOGPROBS}", "invalid_value", "prompt_logprobs")
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS:
        raise Refused(f"prompt_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {shown(k)}",
                      "invalid_value", "prompt_logprobs")
    if body.get("stream"):  # vLLM refuses it too
        raise Refused("prompt_logprobs cannot be streamed: leave out stream or prompt_logprobs",
                      "unsupported_parameter", "prompt_logprobs")


def shown(value) -> str:
    """A body's value as JSON writes it (true, not True), cut short."""
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def check_context(ids: list[int], max_model_len: int, what: str, max_tokens: int | None,
                  field: str = "max_tokens", default: bool = False) -> list[int]:
    """The prompt's ids, or Refused where the prompt (`what`: "the messages", "the prompt")
    plus `max_tokens` (when the body asks for a number, in `field`; `default`: the endpoint's
    own, as /v1/completions' 16, where the body gives none) does not fit the context."""
    if len(ids) >= max_model_len:
        raise too_long(what, str(len(ids)), max_model_len)
    if max_tokens is not None and len(ids) + max_tokens > max_model_len:
        given = f"{field} {max_tokens}" + (" (the default, where the body gives none)" if default else "")
        raise Refused(f"the context holds {max_model_len} tokens, but this request asks for "
                      f"{len(ids) + max_tokens}: {len(ids)} in {what} and {given}; lower "
                      f"{field} to at most {max_model_len - len(ids)} or shorten the prompt",
                      "context_length_exceeded", field)
    return ids


def too_long(what: str, tokens: str, max_model_len: int) -> Refused:
    """The refusal of a prompt (`what`) of `tokens` tokens ("5000", "at least 80000")."""
    verb = "have" if what == "the messages" else "has"
    return Refused(f"{what} {verb} {tokens} tokens, but the context holds {max_model_len} (prompt plus at least "
                   f"one generated token): shorten it", "context_length_exceeded",
                   "messages" if what == "the messages" else "prompt")


def asked_max_tokens(body: dict, params) -> int | None:
    """`params.max_tokens` where the body gives its own max_tokens (or max_completion_tokens),
    None where it gives none (a default applies, cut at the context's end)."""
    return params.max_tokens if max_tokens_field(body) is not None else None


def _check_template_fields(body: dict) -> None:
    for name in TEMPLATE_FLAGS:
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise Refused(f"{name} must be true or false, got {body[name]!r}", "invalid_value", name)
    if body.get("continue_final_message") and body.get("add_generation_prompt", True) is not False:
        raise Refused("continue_final_message continues the last message, add_generation_prompt (true unless "
                      "set) opens a new one: set add_generation_prompt to false, as vLLM asks", "invalid_value",
                      "continue_final_message")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise Refused(f"chat_template_kwargs must be an object of template variables, got {kwargs!r}",
                      "invalid_value", "chat_template_kwargs")
    reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise Refused(f"chat_template_kwargs may not set {', '.join(reserved)}: give "
                      f"{'them' if len(reserved) > 1 else 'it'} as a body field, or leave "
                      f"{'them' if len(reserved) > 1 else 'it'} out", "invalid_value", "chat_template_kwargs")


def _tools_shown(body: dict) -> bool:
    """Tools with tool_choice "none": the model may not call one, so the answer is text, and the
    tools go to the chat template, as vLLM does (agent frameworks send their tools with every
    request). Refused where a tool is not OpenAI's {"type": "function", "function": {"name": ...}}."""
    tools = body.get("tools")
    if not tools or body.get("tool_choice") != "none":
        return False
    if not isinstance(tools, list):
        raise Refused(f"tools must be a list of tools, got {shown(tools)}", "invalid_value", "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict)
                or not isinstance(function.get("name"), str) or not function["name"]):
            raise Refused(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": '
                          f'{{...}}}}}}, got {shown(tool)}', "invalid_value", "tools")
    return True


def chat_template_options(body: dict) -> dict:
    """A checked body's chat-template options, as Tokenizer.encode_prompt takes them (vLLM's
    defaults: the assistant's turn opened, nothing more added to what the template writes)."""
    template_kwargs = dict(body.get("chat_template_kwargs") or {})
    if _tools_shown(body):
        template_kwargs["tools"] = body["tools"]
    return {"add_generation_prompt": body.get("add_generation_prompt", True) is not False,
            "continue_final_message": bool(body.get("continue_final_message")),
            "add_special_tokens": bool(body.get("add_special_tokens")),
            "template_kwargs": template_kwargs}


#: The body fields that ask for structured output, and the words their errors begin with.
STRUCTURED_FIELDS = ("structured_outputs", "response_format", "guided_choice", "guided_regex", "guided_json",
                     "guided_grammar")
STRUCTURED_WORDS = ("choices", "regex", "grammar", "json_schema", "give")


def param_named(message: str, body: dict) -> str | None:
    """The body field an error message is about (they start with its name: "top_p must be ...";
    a structured-output error names the option, which the body gave in one of its fields),
    for the error's `param`, as OpenAI fills it."""
    message = message.removeprefix("unknown option(s) ")  # the batch API's TypeError: the first is named
    first = message.removeprefix("bad ").split(" ", 1)[0].rstrip(":,;").split(".", 1)[0]
    if first in body:
        return first
    if message.startswith("give one structured-output option per call, got "):  # the second given names it
        named = message.rsplit(" and ", 1)[-1].split(" ", 1)[0]
        return named if named in body else next((f for f in STRUCTURED_FIELDS if body.get(f) is not None), None)
    if first in STRUCTURED_WORDS:
        return next((f for f in STRUCTURED_FIELDS if body.get(f) is not None), None)
    return None
