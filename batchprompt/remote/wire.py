"""The wire format: SamplingParams as an OpenAI /v1/completions body, and the answer back as
RequestOutputs.

Prompts go as token ids (our server, vLLM and SGLang accept a list of token-id lists), so a
remote server runs exactly the tokens a local engine would; an endpoint that refuses ids gets
the same tokens as text (see RemoteBackend). Structured output goes as vLLM's
`structured_outputs` object (or the older `guided_*` fields, `structured="guided"`), JSON
mode as OpenAI's `response_format`; our server reads all of them as `batchprompt run` does.

Generated token ids: where the server returns them (ours and vLLM >= 0.10.2 with
`return_token_ids`, older vLLM with `return_tokens_as_token_ids` and logprobs asked) they are
used as they are; otherwise the text is encoded again with the pool's tokenizer, plus the EOS
token when the output ended on it, so a count may differ from the server's own by a token
where the model produced an unusual tokenization.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from ..engine import RequestOutput, SamplingParams
from .errors import EndpointError

STRUCTURED_STYLES = ("structured_outputs", "guided")
FINISH = {"stop": "stop", "length": "length", "eos": "stop", "stop_sequence": "stop"}


def unsupported(params: SamplingParams) -> str | None:
    """Why these parameters cannot run on a remote OpenAI-compatible server (None: they can)."""
    if params.score_choices:
        return ("choice_mode='score' needs the engine's label scoring, which OpenAI-compatible servers do not offer: "
                "use choice_mode='decode' (the default) with a pool of endpoints")
    if params.prompt_logprobs_from is not None:
        return ("prompt log-probs (a completion's echo with logprobs, or prompt_logprobs) are not available from a "
                "pool of endpoints: run this model locally, or leave them out")
    return None


def completion_body(model: str, prompts: Sequence[Sequence[int] | str], params: SamplingParams,
                    structured: str = "structured_outputs", stream: bool = False) -> dict[str, Any]:
    """One /v1/completions request for `prompts`, which share `params`; `stream`: asked as
    server-sent events (see `streams`), with the usage in a last chunk."""
    p = params
    body: dict[str, Any] = {"model": model, "prompt": [list(x) if not isinstance(x, str) else x for x in prompts],
                            "max_tokens": p.max_tokens, "temperature": p.temperature}
    if p.top_p != 1.0:
        body["top_p"] = p.top_p
    if p.top_k > 0:
        body["top_k"] = p.top_k
    if p.seed is not None:
        body["seed"] = p.seed
    if p.stop:
        body["stop"] = list(p.stop)
    if p.stop_token_ids:
        body["stop_token_ids"] = list(p.stop_token_ids)
    if p.ignore_eos:
        body["ignore_eos"] = True
    for name, off in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                      ("min_p", 0.0), ("min_tokens", 0)):
        if getattr(p, name) != off:
            body[name] = getattr(p, name)
    if p.logit_bias:
        body["logit_bias"] = {str(k): v for k, v in p.logit_bias.items()}
    if p.include_stop_str_in_output:
        body["include_stop_str_in_output"] = True
    if p.n > 1:
        body["n"] = p.n
    if p.best_of is not None and p.best_of > p.n:
        body["best_of"] = p.best_of
    body["return_token_ids"] = True  # vLLM >= 0.10.2 and ours: each choice's token ids; others ignore it
    if p.logprobs:
        body["logprobs"] = p.top_logprobs  # completions: k alternatives per position (0: the chosen token's)
        body["return_tokens_as_token_ids"] = True  # vLLM and ours: "token_id:123"; others ignore it
    if p.grammar is not None:
        body.update(structured_fields(p.grammar, structured))
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def streams(params: SamplingParams) -> bool:
    """Whether a sub-batch with these parameters is asked as a stream: always, so that each
    prompt is answered (and a job journals it) as soon as it finishes, not when the slowest
    prompt of its request does; except with best_of > n, which vLLM and ours refuse to stream."""
    return not (params.best_of is not None and params.best_of > params.n)


def structured_fields(grammar, style: str = "structured_outputs") -> dict[str, Any]:
    """A Grammar as request fields: `structured_outputs` (vLLM >= 0.10, ours) or `guided_*`."""
    kind, src = grammar.kind, grammar.source
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "choices":
        value: Any = json.loads(src)["labels"]
    elif kind == "json_schema":
        value = json.loads(src)
    else:  # regex, lark
        value = src
    key = {"choices": "choice", "regex": "regex", "json_schema": "json", "lark": "grammar"}[kind]
    if style == "guided":
        return {f"guided_{'json' if key == 'json' else key}": value}
    return {"structured_outputs": {key: value}}


@dataclass
class Sample:
    text: str
    finish_reason: str
    token_ids: list[int] | None  # as the server gave them, when it did
    logprobs: list[float] | None
    top_logprobs: list[dict[str, float]] | None
    stop_reason: str | int | None = None


def parse_completions(data: Any, n_prompts: int, n: int, where: str) -> list[list[Sample]]:
    """The answer's choices, grouped per prompt (choice index = prompt * n + sample, as vLLM
    and our server number them); EndpointError('server') when the shape is wrong."""
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list):
        raise EndpointError("server", f"{where}: the answer has no list of choices (its `choices`: "
                                      f"{type(choices).__name__})", 200)
    if len(choices) != n_prompts * n:
        raise EndpointError("server", f"{where}: expected {n_prompts * n} choices, got {len(choices)}", 200)
    try:
        ordered = sorted(choices, key=lambda c: c.get("index", 0))
        samples = [_sample(c) for c in ordered]
    except (AttributeError, TypeError, ValueError, KeyError) as e:
        raise EndpointError("server", f"{where}: malformed choice ({type(e).__name__}: {e})", 200) from None
    return [samples[i * n:(i + 1) * n] for i in range(n_prompts)]


class CompletionStream:
    """A streamed /v1/completions answer, read chunk by chunk: each choice's pieces (text,
    token ids, log-probs) are joined until its finish_reason comes; `feed` returns the prompts
    whose n choices are then all complete, with their samples."""

    def __init__(self, n_prompts: int, n: int, where: str):
        self.n_prompts, self.n, self.where = n_prompts, n, where
        self._choices: dict[int, dict[str, Any]] = {}
        self._finished: dict[int, int] = {}  # prompt -> its choices finished
        self.done = 0  # prompts complete
        self.usage: dict | None = None

    def feed(self, chunk: Any) -> list[tuple[int, list[Sample]]]:
        if not isinstance(chunk, dict):
            raise EndpointError("server", f"{self.where}: a stream chunk is not a JSON object: {chunk!r:.200}", 200)
        if chunk.get("error") is not None:
            raise stream_error(chunk["error"], self.where)
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        choices = chunk.get("choices") or []
        if not isinstance(choices, list):
            raise EndpointError("server", f"{self.where}: a stream chunk's choices are not a list", 200)
        complete = []
        for c in choices:
            # No index: choice 0 where it is the only one; of several, no choice (every prompt's
            # pieces were joined into prompt 0's answer, an ok result).
            index = c.get("index", 0 if self.n_prompts * self.n == 1 else None) if isinstance(c, dict) else None
            if not isinstance(index, int) or not 0 <= index < self.n_prompts * self.n:
                raise EndpointError("server", f"{self.where}: a stream chunk has a choice of index {index!r} "
                                              f"(expected 0 to {self.n_prompts * self.n - 1})", 200)
            whole = self._choices.setdefault(index, {"text": "", "finish_reason": None})
            if whole["finish_reason"] is not None:
                continue  # a choice's pieces after its end (none expected): ignored
            _join(whole, c)
            if c.get("stop_reason") is not None:
                whole["stop_reason"] = c["stop_reason"]
            if not c.get("finish_reason"):
                continue
            whole["finish_reason"] = c["finish_reason"]
            prompt = index // self.n
            self._finished[prompt] = self._finished.get(prompt, 0) + 1
            if self._finished[prompt] == self.n:
                self.done += 1
                try:
                    samples = [_sample(self._choices[prompt * self.n + k]) for k in range(self.n)]
                except (AttributeError, TypeError, ValueError, KeyError) as e:
                    raise EndpointError("server", f"{self.where}: malformed choice ({type(e).__name__}: {e})",
                                        200) from None
                complete.append((prompt, samples))
        return complete

    def unfinished(self) -> int:
        return self.n_prompts - self.done


def _join(whole: dict[str, Any], piece: dict) -> None:
    """Add one chunk's piece of a choice to what came before it."""
    text = piece.get("text")
    if text is not None and not isinstance(text, str):
        raise EndpointError("server", f"a stream chunk's text is a {type(text).__name__}", 200)
    whole["text"] += text or ""
    ids = piece.get("token_ids")
    if isinstance(ids, list):
        whole["token_ids"] = whole.get("token_ids", []) + ids
    lp = piece.get("logprobs")
    if isinstance(lp, dict):
        have = whole.setdefault("logprobs", {"token_logprobs": [], "tokens": [], "top_logprobs": []})
        for key in ("token_logprobs", "tokens", "top_logprobs"):
            if isinstance(lp.get(key), list):
                have[key] = have[key] + lp[key]


def stream_error(err: Any, where: str) -> EndpointError:
    """An error event inside a stream (vLLM's and ours: {"error": {...}}), by the status its
    code or type names: a request's fault splits the sub-batch, an overload moves it."""
    if not isinstance(err, dict):
        return EndpointError("server", f"{where}: error in the stream: {err!r:.300}")
    message = str(err.get("message") or err)
    code, kind_name = err.get("code"), str(err.get("type") or "").lower()
    status = code if isinstance(code, int) and not isinstance(code, bool) else None
    if status in (429, 503) or code in ("shutting_down", "overloaded") or "unavailable" in kind_name \
            or "rate_limit" in kind_name:
        return EndpointError("overloaded", f"{where}: error in the stream: {message}")
    if (status is not None and status >= 500) or "server" in kind_name or "internal" in kind_name:
        return EndpointError("server", f"{where}: error in the stream: {message}")
    return EndpointError("request", f"{where}: error in the stream: {message}")


def usage_of(data: Any) -> tuple[int, int, int]:
    """(prompt, cached, completion) tokens the answer reports (0 where it says nothing)."""
    u = data.get("usage") if isinstance(data, dict) else None
    if not isinstance(u, dict):
        return 0, 0, 0
    details = u.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    return int(u.get("prompt_tokens") or 0), int(cached or 0), int(u.get("completion_tokens") or 0)


def _sample(c: dict) -> Sample:
    text = c.get("text")
    if not isinstance(text, str):
        raise ValueError("a choice has no text")
    lp = c.get("logprobs")
    logprobs = tops = None
    ids = c.get("token_ids")  # return_token_ids
    if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        ids = None
    if isinstance(lp, dict) and lp.get("token_logprobs") is not None:
        logprobs = [float(v) if v is not None else 0.0 for v in lp["token_logprobs"]]
        tokens = lp.get("tokens") or []
        if ids is None and tokens and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
            ids = [int(t[len("token_id:"):]) for t in tokens]
        tops = lp.get("top_logprobs")
    stop = c.get("stop_reason")
    stop = stop if isinstance(stop, str) or (isinstance(stop, int) and not isinstance(stop, bool)) else None
    return Sample(text, FINISH.get(c.get("finish_reason") or "stop", "stop"), ids, logprobs, tops, stop)


def to_output(rid: str, prompt_ids: list[int], samples: list[Sample], params: SamplingParams, tokenizer,
              cached: int = 0) -> RequestOutput:
    """One item's RequestOutput (its n samples in `samples`, for n > 1)."""
    outs = [_one(rid, prompt_ids, s, params, tokenizer, cached) for s in samples]
    out = outs[0]
    if len(outs) > 1:
        out.samples = outs
    return out


def _one(rid: str, prompt_ids: list[int], s: Sample, params: SamplingParams, tokenizer, cached: int) -> RequestOutput:
    ids = s.token_ids
    if ids is None:
        ids = tokenizer.encode(s.text, add_special_tokens=False) if s.text else []
        eos = getattr(tokenizer, "eos_token_ids", ())
        if s.finish_reason == "stop" and not params.stop and not params.ignore_eos and eos and len(ids) < params.max_tokens:
            ids.append(min(eos))  # it stopped on EOS, which the text does not show
    tops = None
    if params.top_logprobs and s.top_logprobs is not None:
        tops = [_top(pos, tokenizer) for pos in s.top_logprobs]
    return RequestOutput(rid, list(prompt_ids), list(ids), s.text, s.finish_reason,
                         logprobs=s.logprobs if params.logprobs else None, top_logprobs=tops,
                         num_cached_tokens=cached, stop_reason=s.stop_reason if s.finish_reason == "stop" else None,
                         grammar_complete=None)  # a server does not say


def _top(pos: Any, tokenizer) -> list[tuple[int, float]]:
    """One position's alternatives as (token id, log-prob), most likely first."""
    out = []
    for tok, lp in (pos or {}).items():
        if tok.startswith("token_id:"):
            tid = int(tok[len("token_id:"):])
        else:
            enc = tokenizer.encode(tok, add_special_tokens=False)
            if not enc:
                continue
            tid = enc[0]
        out.append((tid, float(lp)))
    return sorted(out, key=lambda x: -x[1])
