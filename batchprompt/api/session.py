"""LanguageModel: a session with a shared system prompt, in the shape of the browser Prompt API.

    lm = LanguageModel.create(system="Respond with: spam or not_spam")
    results = lm.batch_prompt(prompts, max_tokens=8)
    text = lm.prompt("one prompt")
    for piece in lm.prompt_streaming("one prompt"): print(piece, end="")
    other = lm.clone(); lm.destroy()
    other.close()  # destroy(), and release the engine if no other open session uses it

The session's prefix (the chat template up to the first user turn: system prompt and any
initial messages) is computed once when the session is created and stays pinned in the
engine's prefix cache until `destroy()`; every prompt of the session reuses it.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, AsyncIterator, Iterable, Iterator, Sequence

from jinja2.exceptions import TemplateError

from ..engine import LLMEngine
from ..engine.engine import prompt_too_long
from ..models.tokenizer import TooManyTokens
from .batch import Batch
from .items import Prepared, check_errors
from .messages import check_messages, with_default_system
from .options import GenerationOptions
from .result import EngineStoppedError, Result, SessionDestroyedError
from .streaming import atext_pieces, text_pieces
from ..backends import INTERACTIVE, Backend, get_backend

Message = dict[str, str]
Prompt = str | Sequence[Message]
_session_ids = itertools.count()
#: A session joining its backend, and close()'s "no other session: shut the engine down", one at
#: a time: close() on one thread shut the engine down under a session another was creating.
_lifetime = threading.Lock()
DESTROYED = "cancelled: the session was destroyed"


class LanguageModel:
    """Create with `LanguageModel.create(...)`. Options (max_tokens, temperature, top_p, top_k,
    seed, stop, logprobs; structured output: choices, choice_mode, regex, json_schema,
    response_format, grammar) set here are the session's defaults; each call may override them."""

    def __init__(self, service: Backend, initial_prompts: list[Message], options: GenerationOptions,
                 _pin_from: str | None = None):
        self._service = service
        self._initial = initial_prompts
        self.options = options
        self._name = f"session-{next(_session_ids)}"
        self._destroyed = False
        self._lock = threading.Lock()
        self._batches: weakref.WeakSet[Batch] = weakref.WeakSet()  # cancelled by destroy()
        self.prefix_token_ids = self._prefix_ids()
        with _lifetime:  # open from here on, for close() on any thread
            if service.stopped:
                raise EngineStoppedError(f"the engine is gone ({service.stop_reason})")
            service.add_session(self._name)
        try:
            if _pin_from is not None:
                self.pinned_tokens = service.copy_pin(_pin_from, self._name).result()
            else:
                self.pinned_tokens = service.pin_prefix(self._name, self.prefix_token_ids).result()
        except BaseException:
            service.close_session(self._name)
            raise
        self._finalizer = weakref.finalize(self, _unpin, service, self._name)

    @classmethod
    def create(cls, system: str | None = None, initial_prompts: Sequence[Message] | None = None,
               model: Any = None, *, device: str = "auto", dtype: str = "auto",
               engine_options: dict | None = None, cluster: Any = None, **options: Any) -> "LanguageModel":
        """A session on `model` (None: the embedded SmolLM2-135M; a .gguf path, a Hugging Face
        directory or hub id; an LLMEngine; or a `bp.EndpointPool` of remote servers). One engine
        per model serves the whole process. With `cluster=bp.RayCluster(...)` the model runs as
        engine replicas on Ray instead."""
        if isinstance(initial_prompts, (str, dict)):
            raise ValueError(f"initial_prompts is a list of messages ({{'role': ..., 'content': ...}}), got "
                             f"{type(initial_prompts).__name__} {initial_prompts!r:.60}; for one system prompt, "
                             f"give system=...")
        if system is not None and not isinstance(system, str):  # it met the chat template as a TypeError
            raise TypeError(f"system must be a string (the system prompt), got {type(system).__name__} "
                            f"{system!r:.60}")
        initial = _check_messages(list(initial_prompts or []), "initial_prompts")
        if system is not None:
            if initial and initial[0]["role"] == "system":
                raise ValueError("give the system prompt either as system= or as the first of "
                                 "initial_prompts, not both")
            initial.insert(0, {"role": "system", "content": system})
        opts = GenerationOptions().merged(options)
        for again in (False, True):
            service = get_backend(model, cluster=cluster, device=device, dtype=dtype, engine_options=engine_options)
            try:
                return cls(service, initial, opts)
            except EngineStoppedError:
                # Shut down as asked (another thread's close() or bp.shutdown()) between getting
                # it and joining it: the next get builds a fresh engine.
                if again or not getattr(service, "_shut_down", False):
                    raise
        raise AssertionError("unreachable")

    # ---- the prefix ------------------------------------------------------------------------
    def _render_ids(self, messages: list[Message], limit: int | None = None) -> list[int]:
        tok = self._service.tokenizer
        if tok is None:
            raise ValueError("this engine has no tokenizer: the batch API needs one to render prompts")
        return tok.encode_prompt(messages, limit=limit)

    def _prefix_ids(self) -> list[int]:
        """The tokens every prompt of this session starts with: the common start of two
        renderings that differ only in the user's text."""
        a = self._render_ids(self._initial + [{"role": "user", "content": "A"}])
        b = self._render_ids(self._initial + [{"role": "user", "content": "B"}])
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return a[:n]

    # ---- prompts ---------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._destroyed:
            raise SessionDestroyedError("this session was destroyed; create a new one with "
                                        "LanguageModel.create(...) or clone() a live one")
        if self._service.stopped:
            raise EngineStoppedError(f"this session's engine is gone ({self._service.stop_reason}); "
                                     f"create a new session with LanguageModel.create(...)")

    def _prepare(self, prompts: Iterable[Prompt], options: dict[str, Any]) -> list[Prepared]:
        self._check_alive()
        # bytes were iterated as ints (one error per byte); a set ran in no order anyone chose.
        if isinstance(prompts, (str, bytes, bytearray, dict)) or not hasattr(prompts, "__iter__"):
            raise TypeError(f"a batch takes a list of prompts, got {type(prompts).__name__} {prompts!r:.40}; "
                            f"for one prompt give [prompt], or use a session's prompt()")
        if isinstance(prompts, (set, frozenset)):
            raise TypeError("a batch takes a list of prompts, whose order its results keep; a set has none: give "
                            "a list (list(prompts), or sorted(prompts))")
        limit = getattr(self._service, "max_model_len", None)
        params, spec = self.options.merged(options).sampling_params(self._service.tokenizer, limit)
        problem = self._service.refuses(params)
        if problem:  # no row could run: refused once, as a bad option is (each row failed alone)
            raise ValueError(problem)
        out = []
        for i, prompt in enumerate(prompts):
            try:
                out.append(Prepared(i, self._render_ids(self._messages(prompt), limit), params, spec=spec))
            except TooManyTokens as e:  # by its length alone: refused without tokenizing megabytes
                out.append(Prepared(i, None, params, prompt_too_long(f"at least {e.at_least}", e.limit)))
            except (TypeError, ValueError, KeyError, TemplateError) as e:
                # A chat template's own refusal (roles that do not alternate) failed the whole call.
                # Its place is the result's index; "prompt 0 cannot ..." read oddly from prompt().
                out.append(Prepared(i, None, params, f"the prompt cannot be rendered: {e}"))
        return out

    def _messages(self, prompt: Prompt) -> list[Message]:
        if isinstance(prompt, str):
            return self._initial + [{"role": "user", "content": prompt}]
        if isinstance(prompt, dict):
            raise TypeError("a prompt is a string or a list of chat messages; this is one message: put it in a list")
        if not isinstance(prompt, (list, tuple)):
            raise TypeError(f"a prompt is a string or a list of chat messages, got {type(prompt).__name__}: "
                            f"{prompt!r:.60}")
        # A prompt's own system message replaces the session's, as a job row's replaces --system.
        return with_default_system(self._initial, _check_messages(list(prompt), "a prompt"))

    def create_batch(self, prompts: Iterable[Prompt], *, progress: bool = False, priority: int = INTERACTIVE,
                     **options: Any) -> Batch:
        """A streaming batch (not started: call start(), wait(), or iterate it). `priority`:
        `batchprompt.backends.BULK` runs it behind interactive calls (never starved), as the server runs
        background batches."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an int (batchprompt.backends.INTERACTIVE or BULK), got {priority!r}")
        batch = Batch(self._service, self._prepare(prompts, options), progress=progress, priority=priority)
        with self._lock:
            if self._destroyed:  # destroyed meanwhile, by another thread
                batch.cancel_for(DESTROYED, SessionDestroyedError)
            else:
                self._batches.add(batch)
        return batch

    def batch_prompt(self, prompts: Iterable[Prompt], *, errors: str = "return", progress: bool = False,
                     **options: Any) -> list[Result]:
        """Results in input order. A failed item carries `.error`; errors="raise" raises one
        BatchError naming the failed indices, after every other item has finished."""
        check_errors([], errors)
        return self.create_batch(prompts, progress=progress, **options).wait(errors=errors)

    async def abatch_prompt(self, prompts: Iterable[Prompt], *, errors: str = "return",
                            **options: Any) -> list[Result]:
        check_errors([], errors)
        return await self.create_batch(prompts, **options).wait_async(errors=errors)

    def prompt(self, prompt: Prompt, **options: Any) -> str:
        """One prompt's text; raises ValueError if it fails (SessionDestroyedError or
        EngineStoppedError if the session or its engine ended meanwhile)."""
        batch = self.create_batch([prompt], **options)
        result = batch.wait()[0]
        batch.raise_for(result)
        return result.text

    async def aprompt(self, prompt: Prompt, **options: Any) -> str:
        batch = self.create_batch([prompt], **options)
        result = (await batch.wait_async())[0]
        batch.raise_for(result)
        return result.text

    def prompt_streaming(self, prompt: Prompt, **options: Any) -> Iterator[str]:
        """One prompt's text in pieces as it is made (the Prompt API's promptStreaming());
        joined, they are `prompt()`'s text. Raises ValueError if it fails; leaving the loop
        early cancels it."""
        return text_pieces(self.create_batch([prompt], **options), self._service.tokenizer.decode)

    def aprompt_streaming(self, prompt: Prompt, **options: Any) -> AsyncIterator[str]:
        """prompt_streaming() for asyncio: `async for piece in lm.aprompt_streaming(...)`."""
        return atext_pieces(self.create_batch([prompt], **options), self._service.tokenizer.decode)

    # ---- lifetime --------------------------------------------------------------------------
    def clone(self, **options: Any) -> "LanguageModel":
        """A new session with the same prefix (shared, not recomputed) and options."""
        self._check_alive()
        return LanguageModel(self._service, list(self._initial), self.options.merged(options),
                             _pin_from=self._name)

    def destroy(self) -> None:
        """Release the pinned prefix; later calls on this session fail, and its batches still
        running are cancelled (what finished is kept): as the Prompt API's destroy() aborts the
        session's prompts."""
        with self._lock:
            if self._destroyed:
                return
            self._destroyed = True
            batches = list(self._batches)
        for batch in batches:
            if not batch.done:
                batch.cancel_for(DESTROYED, SessionDestroyedError)
        self._finalizer()

    def close(self) -> None:
        """destroy(), and release the engine (threads, weights, KV cache) if no other open
        session uses it; work still running on it is then cancelled. `bp.shutdown()` releases
        engines whatever uses them. The next session on the model builds a fresh engine."""
        self.destroy()
        with _lifetime:
            if self._service.open_sessions == 0:
                self._service.shutdown()

    def __enter__(self) -> "LanguageModel":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    @property
    def engine(self) -> LLMEngine:
        """The local engine (AttributeError on a remote or Ray backend, which has none here)."""
        return self._service.engine

    @property
    def backend(self) -> Backend:
        return self._service

    @property
    def system(self) -> str | None:
        return self._initial[0]["content"] if self._initial and self._initial[0]["role"] == "system" else None


def _unpin(service: Backend, name: str) -> None:
    service.close_session(name)


def _check_messages(messages: list, what: str) -> list[Message]:
    # The rules live in messages.py, shared with the jobs reader. A session may start with no
    # initial turns; a prompt given as messages needs at least one.
    return check_messages(messages, what, allow_empty=what == "initial_prompts")
