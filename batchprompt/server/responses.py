"""Response bodies: OpenAI's chat.completion / text_completion (built by jobs/openai_io.py, the
shapes `batchprompt run` writes), their streaming chunks, and the batch endpoints' results."""
from __future__ import annotations

import json
from typing import Any, Sequence

from ..api.batch import Progress
from ..api.result import Result
from ..api.text_stream import TextStream
from ..jobs import openai_io
from ..jobs.rows import CHAT
from .errors import ApiError, error_body
from .requests import Plan


def failure(results: Sequence[Result], body: dict | None = None, several: bool | None = None) -> ApiError | None:
    """The error to answer with, if a result failed (openai_io.failed_choice: an output cut by
    max_tokens before it completed its structured output is not one; `several`: Plan.several)."""
    failed = openai_io.failed_choice(results, several)
    return None if failed is None else result_error(failed, body)


def result_error(r: Result, body: dict | None = None) -> ApiError:
    message = openai_io.with_output(r.error, r.text) if r.error else "the request failed"
    code = openai_io.failure_code(message, body or {})  # engine_error (the server's fault, a 500) or the request's
    return ApiError(openai_io.STATUS.get(code, 400), message, code, openai_io.failure_param(message, body or {}))


def response_id(plan: Plan, chat: bool) -> str:
    """The id of a request's answer, streamed or not: its plan's random id."""
    return ("chatcmpl-" if chat else "cmpl-") + plan.request_id


def body(plan: Plan, results: Sequence[Result], model: str, created: int) -> dict[str, Any]:
    """The whole answer: one prompt's n choices (chat), or every prompt's (completions: choice
    `index` is prompt * n + choice, as vLLM numbers them)."""
    n = plan.n
    parts = [openai_io.response_body(row, results[i * n:(i + 1) * n], model, created, plan.token_text)
             for i, row in enumerate(plan.rows)]
    out = parts[0]
    out["id"] = response_id(plan, plan.rows[0].url == CHAT)
    if len(parts) > 1:
        out["choices"] = [dict(c, index=k) for k, c in enumerate(c for p in parts for c in p["choices"])]
        out["usage"] = _usage(p["usage"] for p in parts)
    return out


def _usage(usages) -> dict[str, Any]:
    usages = list(usages)
    prompt = sum(u["prompt_tokens"] for u in usages)
    completion = sum(u["completion_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class Chunks:
    """Server-sent events of one streamed request. Each choice's text streams as its tokens
    are made (`tokens`), as in OpenAI and vLLM; its last piece comes with the finished result
    (`result`), then its finish chunk. Text that may still change is held back: an incomplete
    UTF-8 character (a trailing U+FFFD) and, where stop strings are set, as many characters as
    the longest of them less one, since a stop string that completes is cut from the output.
    With logprobs asked, each chunk carries those of its tokens (as vLLM streams them; a stop
    string's held-back text is not sent, the log-probs of its tokens are).
    `continuous_usage` (vLLM's stream_options.continuous_usage_stats, with include_usage): each
    chunk carries the usage so far of its own choice (its prompt's tokens and the choice's tokens
    so far, as vLLM counts it), rather than null."""

    def __init__(self, plan: Plan, chat: bool, model: str, created: int, include_usage: bool,
                 continuous_usage: bool = False):
        self.plan, self.chat, self.model, self.created = plan, chat, model, created
        self.include_usage = include_usage
        self.continuous_usage = include_usage and continuous_usage
        self._made: dict[int, int] = {}  # choice index -> its tokens so far (the usage so far)
        self.id = response_id(plan, chat)
        self.prompt_tokens: dict[int, int] = {}  # prompt -> tokens (counted once for its n choices)
        self.cached_tokens: dict[int, int] = {}
        self.completion_tokens = 0
        self._streams: dict[int, TextStream] = {}  # choice index -> its text so far
        self.streams_tokens = plan.decode is not None
        self._logprobs_sent: dict[int, int] = {}  # choice index -> its tokens whose log-probs went out
        self._offsets: dict[int, int] = {}  # completions: the text length of those tokens (text_offset)
        # vLLM's return_token_ids: each chunk carries the ids of its tokens (those of text held back
        # ride with the next chunk), the prompt's ids come with a chat's first chunk or a
        # completion choice's first.
        self.with_ids = bool(plan.rows[0].body.get("return_token_ids"))
        self._ids_unsent: dict[int, list[int]] = {}  # choice index -> its ids no chunk carried yet
        self._ids_sent: dict[int, int] = {}  # choice index -> how many of its ids chunks carried
        self._opened: set[int] = set()  # completions: the choices whose first chunk went out

    def _stream(self, index: int) -> TextStream:
        if index not in self._streams:
            self._streams[index] = TextStream(self.plan.decode, self.plan.prepared[index].params.stop)  # type: ignore[arg-type]
        return self._streams[index]

    def tokens(self, index: int, ids: list[int], logprobs: tuple | None = None) -> list[str]:
        """The chunk of choice `index`'s new text, given its new tokens (none while held back),
        and their (log-probs, top log-probs) where asked (then a chunk each time, as vLLM's)."""
        if not self.streams_tokens:
            return []
        self._made[index] = self._made.get(index, 0) + len(ids)
        if self.with_ids:
            self._ids_unsent.setdefault(index, []).extend(ids)
        piece = self._stream(index).push(ids)
        if logprobs is None:
            return [self._delta(index, piece)] if piece else []
        return [self._delta(index, piece, self._token_logprobs(index, ids, logprobs))]

    def _with_ids(self, index: int, choice: dict) -> dict:
        """`choice` with the ids no chunk of it carried yet (return_token_ids), and for a
        completion's first chunk of the choice the prompt's ids."""
        if not self.with_ids:
            return choice
        unsent = self._ids_unsent.pop(index, [])
        self._ids_sent[index] = self._ids_sent.get(index, 0) + len(unsent)
        choice = {**choice, "token_ids": unsent}
        if not self.chat and index not in self._opened:
            self._opened.add(index)
            choice["prompt_token_ids"] = list(self.plan.prepared[index].token_ids or ())
        return choice

    def _token_logprobs(self, index: int, ids: list[int], logprobs: tuple) -> dict:
        values, tops = logprobs
        n = min(len(ids), len(values))
        tops = tops[:n] if tops else None
        pieces = openai_io.token_pieces(self.plan.rows[index // self.plan.n], self.plan.token_text)
        self._logprobs_sent[index] = self._logprobs_sent.get(index, 0) + n
        if self.chat:
            return {"content": openai_io.chat_logprobs(ids[:n], values[:n], tops, pieces), "refusal": None}
        offset = self._offsets.get(index, 0)
        out = openai_io.completion_logprobs(ids[:n], values[:n], tops, pieces, offset)
        self._offsets[index] = offset + sum(map(len, out["tokens"]))
        return out

    def _unsent_logprobs(self, index: int, logprobs: dict | None) -> dict | None:
        """A finished choice's log-probs less those its chunks carried already."""
        sent = self._logprobs_sent.get(index, 0)
        if not sent or logprobs is None:
            return logprobs
        if self.chat:
            return {**logprobs, "content": logprobs["content"][sent:]}
        return {key: value[sent:] for key, value in logprobs.items()}

    def _chunk(self, choices: list[dict], index: int | None = None, prompt_ids: list[int] | None = None) -> str:
        """`index`: the choice the chunk is of (None: of none yet, as the role's opening chunk);
        `prompt_ids`: the prompt's token ids, on a chat's first chunk (return_token_ids)."""
        obj = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices}
        if prompt_ids is not None:
            obj["prompt_token_ids"] = list(prompt_ids)
        if self.chat:
            obj["system_fingerprint"] = None
        if self.include_usage:
            obj["usage"] = self._usage_so_far(index) if self.continuous_usage else None
        return event(obj)

    def _usage_so_far(self, index: int | None) -> dict[str, int]:
        # Per choice, as vLLM's: with n > 1 it summed every choice's tokens (1, 2, 3, 4 for two
        # choices of 2 tokens where vLLM says 1, 1, 2, 2).
        prompt = len(self.plan.prepared[index or 0].token_ids or ())
        made = 0 if index is None else self._made.get(index, 0)
        return {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made}

    def _delta(self, index: int, text: str, logprobs: dict | None = None) -> str:
        if not self.chat:
            return self._chunk([self._with_ids(index, {"index": index, "text": text, "logprobs": logprobs,
                                                       "finish_reason": None})], index)
        return self._chunk([self._with_ids(index, {"index": index % self.plan.n, "delta": {"content": text},
                                                   "logprobs": logprobs, "finish_reason": None})], index)

    def _rest(self, index: int, text: str) -> tuple[str, bool]:
        """What of a choice's final text was not sent yet, and whether any of it was."""
        stream = self._streams.get(index)
        if stream is None:
            return text, False
        return stream.finish(text), True

    def start(self) -> list[str]:
        """Chat opens each choice with the assistant's role, as OpenAI does, before any text."""
        if not self.chat:
            return []
        chunk = self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(self.plan.n)],
                            prompt_ids=self.plan.prepared[0].token_ids if self.with_ids else None)
        return [chunk]

    def result(self, index: int, r: Result) -> list[str]:
        prompt = index // self.plan.n
        self.prompt_tokens[prompt] = r.usage.prompt_tokens
        self.cached_tokens[prompt] = r.usage.cached_tokens
        self.completion_tokens += r.usage.completion_tokens
        self._made[index] = r.usage.completion_tokens
        row = self.plan.rows[prompt]
        choice = openai_io.response_body(row, [r], self.model, self.created, self.plan.token_text)["choices"][0]
        logprobs = self._unsent_logprobs(index, choice["logprobs"])
        if self.with_ids:  # the ids no chunk carried: those of a held-back text, and any not streamed
            if r.token_ids:
                self._ids_unsent[index] = list(r.token_ids[self._ids_sent.get(index, 0):])
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
        if not self.chat:
            last = dict(choice, index=index, text=self._rest(index, choice["text"])[0], logprobs=logprobs)
            return [self._chunk([self._with_ids(index, last)], index)]
        i = index % self.plan.n
        out = []
        rest, streamed = self._rest(index, choice["message"]["content"] or "")
        if rest or (logprobs is not None and logprobs["content"]) or not streamed:
            last = {"index": i, "delta": {"content": rest}, "logprobs": logprobs, "finish_reason": None}
            out.append(self._chunk([self._with_ids(index, last)], index))
        finish = {"index": i, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"],
                  "stop_reason": choice.get("stop_reason")}
        for extra in ("choice_probs", "error"):  # on the choice's last chunk, as on the whole answer's choice
            if extra in choice:  # score mode's probabilities; an answer of several that broke its schema
                finish[extra] = choice[extra]
        if self._ids_unsent.get(index):
            finish = self._with_ids(index, finish)
        return out + [self._chunk([finish], index)]

    def end(self) -> list[str]:
        out = []
        if self.include_usage:
            prompt, cached = sum(self.prompt_tokens.values()), sum(self.cached_tokens.values())
            usage = {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                     "total_tokens": prompt + self.completion_tokens,
                     "prompt_tokens_details": {"cached_tokens": cached}}
            obj = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                   "created": self.created, "model": self.model, "choices": [], "usage": usage}
            out.append(event(obj))
        return out + [DONE]


DONE = "data: [DONE]\n\n"
KEEP_ALIVE = ": keep-alive\n\n"  # an SSE comment: clients skip it, proxies see the stream alive


def event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def error_event(e: ApiError) -> str:
    return event(error_body(e.status, e.message, e.code, e.param))


# ---- the batch endpoints (/v1/batch/...) ------------------------------------------------------
def result_json(r: Result | None) -> dict[str, Any] | None:
    if r is None:
        return None
    out = {"index": r.index, "text": r.text, "finish_reason": r.finish_reason, "error": r.error,
           "usage": {"prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens,
                     "cached_tokens": r.usage.cached_tokens}}
    if r.logprobs is not None:
        out["logprobs"] = r.logprobs
    tops = getattr(r, "top_logprobs", None)  # getattr: api's Result gains it with top_logprobs asked
    if tops is not None:
        out["top_logprobs"] = [[{"token_id": t, "logprob": v} for t, v in pos] for pos in tops]
    if r.parsed is not None:
        out["parsed"] = r.parsed
    if r.choice_probs is not None:
        out["choice_probs"] = r.choice_probs
    return out


def progress_json(p: Progress) -> dict[str, Any]:
    return {"done": p.done, "total": p.total, "failed": p.failed, "cancelled": p.cancelled,
            "completion_tokens": p.completion_tokens, "tokens_per_s": round(p.tokens_per_s, 2), "elapsed_s": round(p.elapsed_s, 3),
            "eta_s": None if p.eta_s is None else round(p.eta_s, 3)}
