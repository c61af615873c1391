"""Bodies that `batchprompt run`, the server's endpoints and its Batch API all refuse, with
OpenAI's error codes: fields that change what a request means and that batchprompt cannot
honour (tools, echo, beam search, ...), and an explicit max_tokens that does not fit the
context beside the prompt (vLLM's rule, rather than an answer cut short at the context's end)."""
from __future__ import annotations

#: field -> is the value a no-op? (The sampling options, from presence_penalty to best_of and
#: top_logprobs, go to the engine through run.row_params.)
_NOOP = {
    "echo": lambda v: not v,
    "suffix": lambda v: v in (None, ""),
    "tools": lambda v: not v,
    "functions": lambda v: not v,
    "use_beam_search": lambda v: not v,
    "prompt_logprobs": lambda v: v is None,
    "guided_whitespace_pattern": lambda v: v is None,  # JSON here is always compact
}


class Refused(ValueError):
    """A body refused: the message, OpenAI's error `code` and the field (`param`) it is about."""

    def __init__(self, message: str, code: str, param: str | None = None):
        super().__init__(message)
        self.code, self.param = code, param


def refuse_unsupported(body: dict) -> dict:
    """The body to run, or Refused naming a field batchprompt cannot honour."""
    for name, noop in _NOOP.items():
        if name in body and not noop(body[name]):
            raise Refused(f"{name}={body[name]!r}: batchprompt does not support it; leave it out",
                          "unsupported_parameter", name)
    if body.get("best_of") is not None and body.get("best_of") == (body.get("n") or 1):
        # best_of = n picks all n: a no-op clients send, not the best-of-n search (which needs n = 1).
        body = {k: v for k, v in body.items() if k != "best_of"}
    return body


def check_context(ids: list[int], max_model_len: int, what: str, max_tokens: int | None) -> list[int]:
    """The prompt's ids, or Refused where the prompt (`what`: "the messages", "the prompt")
    plus `max_tokens` (when the body asks for a number) does not fit the context."""
    verb = "have" if what == "the messages" else "has"
    if len(ids) >= max_model_len:
        raise Refused(f"{what} {verb} {len(ids)} tokens, but the context holds {max_model_len} (prompt plus at "
                      f"least one generated token): shorten it", "context_length_exceeded",
                      "messages" if what == "the messages" else "prompt")
    if max_tokens is not None and len(ids) + max_tokens > max_model_len:
        raise Refused(f"the context holds {max_model_len} tokens, but this request asks for "
                      f"{len(ids) + max_tokens}: {len(ids)} in {what} and max_tokens {max_tokens}; lower "
                      f"max_tokens to at most {max_model_len - len(ids)} or shorten the prompt",
                      "context_length_exceeded", "max_tokens")
    return ids


def asked_max_tokens(body: dict, params) -> int | None:
    """`params.max_tokens` where the body gives its own max_tokens (or max_completion_tokens),
    None where it gives none (a default applies, cut at the context's end)."""
    return params.max_tokens if body.get("max_completion_tokens", body.get("max_tokens")) is not None else None
