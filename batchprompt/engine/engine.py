"""LLMEngine: continuous batching over the scheduler, the KV cache and the model runner."""
from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch

from ..device import check_dtype, resolve_device, resolve_dtype
from ..models import Tokenizer, build_model, check_tokenizer_files, load_hf_weights, resolve_model
from ..models.llama import LlamaModel
from ..steps import ModelRunnerOutput, SchedulerOutput
from ..structured import GrammarCompiler, GrammarError
from .block_pool import BlockPool
from .config import EngineConfig, EngineConfigError
from .grammar_step import advance_grammar
from .kv_cache import KVCacheManager
from .outputs import RequestOutput
from .request import Request
from .samples import (SampleGroups, attach_sampling_state, child_params, prompt_ids_problem, sample_id,
                      sampling_problem)
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .scoring import add_candidate_score, choose_best, start_scoring
from .stats import EngineStats
from .stop import check_stop

log = logging.getLogger("batchprompt")

if TYPE_CHECKING:
    from ..runner.model_runner import ModelRunner

# A step predicted to take at least this long pauses between its layers for urgent requests
# (see LLMEngine.step); a shorter one is over before pausing would gain much.
PAUSE_MIN_S = 0.1
# The steps run inside one step take at most this many times its predicted time (and at least
# PAUSE_MIN_S that many times), or that many times its own time so far where that is more (a
# step slower than predicted, or one of a size never measured, as a fresh engine's first):
# under a steady stream of urgent requests, the step's own requests still get a fifth of the time.
INSIDE_SHARE = 4.0


def prompt_too_long(tokens: str, max_model_len: int) -> str:
    """A prompt's error where it has `tokens` tokens ("5000", "at least 80000"), too many for
    the context ("shorten the prompt": the code context_length_exceeded, openai_io.failure_code)."""
    return (f"the prompt has {tokens} tokens, but the context holds {max_model_len} (prompt plus at least one "
            f"generated token): shorten the prompt")


class LLMEngine:
    """Add requests at any time; each `step()` runs one batch and returns finished requests."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer | None, config: EngineConfig | None = None):
        """`runner` runs the model and holds the KV cache (its `block_size` and `max_blocks`
        size the block pool); `from_model` and `from_pretrained` build one from `config`."""
        self.config = config = (config or EngineConfig()).for_device(runner.device.type)
        if runner.block_size != config.block_size:
            raise ValueError(f"the runner's KV blocks hold {runner.block_size} tokens, but "
                             f"block_size is {config.block_size}: build both from the same config")
        self.runner, self.model, self.tokenizer = runner, runner.model, tokenizer
        args = self.model.args
        if config.max_model_len is not None and config.max_model_len > args.max_position:
            # As vLLM: positions past what the model was trained for would give garbage, not an error.
            raise EngineConfigError(f"max_model_len {config.max_model_len} is longer than the model's context of "
                             f"{args.max_position} tokens: give at most {args.max_position}, or leave it out "
                             f"for the model's own")
        self.max_model_len = config.max_model_len or args.max_position
        max_blocks = runner.max_blocks
        self.pool = BlockPool(max_blocks)
        self.kv = KVCacheManager(self.pool, config.block_size, config.enable_prefix_caching,
                                 watermark_blocks=int(config.watermark * max_blocks))
        self.scheduler = Scheduler(config, self.kv)
        self.eos_token_ids = tokenizer.eos_token_ids if tokenizer else frozenset(args.eos_token_ids)
        self._requests: dict[str, Request] = {}
        self._rejected: list[Request] = []
        self._held: list[RequestOutput] = []  # others' outputs that a generate() call stepped past
        self._ids = itertools.count()
        self._stats = EngineStats()
        self._samples = SampleGroups()  # requests with n / best_of > 1
        self.grammars = GrammarCompiler(tokenizer.hf, args.vocab_size, self.eos_token_ids) if tokenizer else None
        self._outer: SchedulerOutput | None = None  # the step in progress, while it may pause
        self._inside_s = 0.0  # the time of the steps run inside it so far ...
        self._inside_max_s = 0.0  # ... and their limit from its predicted time
        self._outer_t0 = 0.0  # when it began
        self.inside_pending = False  # whether it left out requests that its first pause should run
        self._left_out_unrun = False  # the last step left requests out and did not run them
        # Set by a session's service that runs this engine on its own thread (api/service.py):
        # that thread, and how to run a function there between its steps. While it runs, another
        # thread's generate() goes through it, and its add_request() or step() are refused: they
        # raced the service's (each took the other's requests).
        self.driver: tuple[threading.Thread, Callable[[Callable[[], Any]], Any]] | None = None
        # generate() calls of several threads run one after another; the thread whose call runs,
        # meanwhile the only one whose add_request(), step() or abort() is taken (two calls took
        # each other's requests: KeyError, failed rows, or a step that failed).
        self._generate_lock = threading.RLock()
        self._generating: threading.Thread | None = None
        self._discarded: set[str] = set()  # requests of a generate() that raised: their outputs are dropped
        self._stepping: threading.Thread | None = None  # the thread inside step(), while it is

    @classmethod
    def from_pretrained(cls, model: str | None = None, *, dtype: str | torch.dtype = "auto",
                        device: str = "auto", **config) -> "LLMEngine":
        """Load `model` (see `resolve_model`) and build an engine; `config` goes to EngineConfig."""
        cfg = EngineConfig.from_options(config)
        dev = resolve_device(device)
        check_dtype(dtype)  # before the weights are read
        source = resolve_model(model)
        check_tokenizer_files(source)  # before the weights are read
        args, weights = load_hf_weights(source)
        net = build_model(args, weights, resolve_dtype(dtype, dev), dev)
        del weights
        return cls.from_model(net, Tokenizer.load(source, args.eos_token_ids), cfg)

    @classmethod
    def from_model(cls, model: LlamaModel, tokenizer: Tokenizer | None = None,
                   config: EngineConfig | None = None) -> "LLMEngine":
        """An engine over a built model, with a runner whose KV cache follows `config`."""
        # Imported here, not at the top: the engine works with the runner it is handed, and
        # only this builder needs the concrete class.
        from ..runner.model_runner import ModelRunner

        config = config or EngineConfig()
        runner = ModelRunner(model, config.block_size, config.kv_cache_memory, config.kv_memory_fraction)
        return cls(runner, tokenizer, config)

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0) -> str:
        """Queue a prompt (text, encoded without a chat template, or token ids). A prompt that
        cannot run fails alone: its error comes back from the next `step()`. A higher
        `priority` is admitted first and preempted last, without starving lower ones (see
        scheduler.py; ignored when `priority_scheduling` is off)."""
        self._check_not_driven("add_request")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):  # vLLM's order is add_request(request_id, prompt, params)
            raise TypeError(f"add_request(prompt, params=None, request_id=None, priority=0): params must be a "
                            f"SamplingParams, got a {type(params).__name__} (vLLM's LLMEngine takes the request id "
                            f"first; here it is request_id=...)")
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got a {type(request_id).__name__}")
        priority = int(priority) if self.config.priority_scheduling else 0
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids, problem = _prompt_ids(prompt, self.tokenizer)
        req = self._new_request(request_id, ids, params, priority)
        added: list[Request] = []
        try:
            problem = (problem or self._validate(ids) or sampling_problem(params, self.model.args.vocab_size)
                       or self._prepare_structured(req))
            if problem:
                req.finish("error", problem)
                self._rejected.append(req)
            elif params.num_samples > 1:  # samples queued together: the prompt's blocks are shared
                req.matcher = None
                children = [self._new_request(sample_id(request_id, i), ids, child_params(params, i), priority)
                            for i in range(params.num_samples)]
                added.extend(children)
                self._samples.add(req, children)
                for child in children:
                    self._prepare_structured(child)
                    self.scheduler.add(child)
            else:
                self.scheduler.add(req)
        except BaseException:  # nothing of it stays: a ghost request kept has_unfinished() true for ever
            for r in (req, *added):
                self._requests.pop(r.request_id, None)
                self.scheduler.finish(r)
            self._samples.discard(req)
            raise
        return request_id

    def _new_request(self, request_id: str, ids: list[int], params: SamplingParams, priority: int = 0) -> Request:
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        req = Request(request_id, ids, params, generator=gen, priority=priority,
                      by_driver=self.driver is not None and self.driver[0] is threading.current_thread())
        self._requests[request_id] = req
        return req

    def has_callers_requests(self) -> bool:
        """Whether requests that a caller added itself (not a session's service) are in the engine."""
        return any(not r.by_driver and rid not in self._discarded for rid, r in self._requests.items())

    def _validate(self, ids: list[int]) -> str | None:
        if not ids:
            return "the prompt is empty: give at least one token"
        if len(ids) >= self.max_model_len:
            return prompt_too_long(str(len(ids)), self.max_model_len)
        problem = prompt_ids_problem(ids, self.model.args.vocab_size)
        if problem is not None:
            return problem
        if self.kv.blocks_needed(len(ids) + 1) > self.pool.max_blocks:
            return (f"the prompt needs more KV cache ({len(ids)} tokens) than the budget holds "
                    f"({self.pool.max_blocks * self.config.block_size} tokens): raise kv_cache_memory")
        return None

    def _prepare_structured(self, req: Request) -> str | None:
        p = req.params
        if p.grammar is not None:
            if self.grammars is None:
                return "structured output needs the model's tokenizer, and this engine has none"
            try:
                req.matcher = self.grammars.matcher(p.grammar)
            except GrammarError as e:
                return f"{e} (fix it; it applies to this request only)"
            longest = p.grammar.longest_choice()
            if longest is not None and req.num_prompt_tokens + longest > self.max_model_len:
                return (f"the prompt ({req.num_prompt_tokens} tokens) and the longest choice ({longest}) "
                        f"do not fit the context of {self.max_model_len} tokens: shorten the prompt")
        if p.score_choices:
            longest = max(len(c) for c in p.score_choices)
            if req.num_prompt_tokens + longest >= self.max_model_len:
                return (f"the prompt ({req.num_prompt_tokens} tokens) and the longest choice ({longest}) "
                        f"do not fit the context of {self.max_model_len} tokens: shorten the prompt")
            if self.kv.blocks_needed(req.num_prompt_tokens + longest) > self.pool.max_blocks:
                return (f"the prompt ({req.num_prompt_tokens} tokens) and the longest choice ({longest}) need more "
                        f"KV cache than the budget holds ({self.pool.max_blocks * self.config.block_size} "
                        f"tokens): raise kv_cache_memory")
            vocab = self.model.args.vocab_size
            if any(not 0 <= t < vocab for c in p.score_choices for t in c):
                return f"a choice has token ids outside the vocabulary [0, {vocab})"
        return None

    def _driven_from_elsewhere(self) -> Callable[[Callable[[], Any]], Any] | None:
        """How to run a function on the thread of the service that steps this engine, when that
        is not this thread (else None)."""
        driver = self.driver
        if driver is None or driver[0] is threading.current_thread() or not driver[0].is_alive():
            return None
        return driver[1]

    def _check_not_driven(self, what: str) -> None:
        generating = self._generating
        if generating is not None and generating is not threading.current_thread():
            raise RuntimeError(
                f"{what}() from another thread while {generating.name}'s generate() runs this engine: the two would "
                f"take each other's requests. Call generate() (calls of several threads run one after another), "
                f"or use a LanguageModel session, which any thread may call")
        if self._driven_from_elsewhere() is not None:
            raise RuntimeError(
                f"{what}() from another thread while a LanguageModel session's engine thread steps this engine: the "
                f"two would take each other's requests. Use generate() (it runs between the sessions' steps), "
                f"or release the engine first (close() its last session, or bp.shutdown(engine))")

    def abort(self, request_id: str | Iterable[str]) -> bool:
        """Stop a request (or each of several, as vLLM's abort_request takes them); it comes back
        from the next `step()` with finish_reason 'abort'. Whether one was stopped."""
        self._check_not_driven("abort")
        if not isinstance(request_id, str):
            return any([self.abort(rid) for rid in request_id])
        req = self._requests.get(request_id)
        if req is None or req.is_finished or req.parent is not None:
            return False
        self._drop_children(req)
        self.scheduler.finish(req)
        req.finish("abort")
        self._rejected.append(req)
        return True

    def _drop_children(self, parent: Request) -> None:
        for cid in parent.pending_children:
            child = self._requests.pop(cid)
            self.scheduler.finish(child)
            child.finish("abort")
        parent.pending_children.clear()

    # ---- pinned prefixes (a session's system prompt) ---------------------------------------
    def pin_prefix(self, name: str, token_ids: list[int]) -> int:
        """Keep the cached blocks that start `token_ids` alive under `name` until `unpin`.
        Returns how many tokens are pinned (whole blocks that are in the cache now)."""
        return self.kv.pin_tokens(name, list(token_ids))

    def copy_pin(self, source: str, name: str) -> int:
        return self.kv.pin_copy(source, name)

    def unpin(self, name: str) -> None:
        self.kv.unpin(name)

    def has_unfinished(self) -> bool:
        # An interrupted generate()'s requests, stopped, whose outputs the next step drops, count as done.
        return bool(self._held) or any(rid not in self._discarded for rid in self._requests)

    def output_ids(self, request_id: str) -> list[int] | None:
        """The tokens a running request has made so far (a copy), for streaming them as they
        come; None once it finished (its output has them all) or for an unknown id. They only
        grow: a preempted request keeps its tokens and recomputes their K/V."""
        req = self._requests.get(request_id)
        if req is None or req.finish_reason is not None:
            return None
        return list(req.output_token_ids)

    def output_logprobs(self, request_id: str, start: int) -> tuple[list[float], list[list[tuple[int, float]]]] | None:
        """A running request's log-probs from its token `start` on, and the top ones where asked
        (for streaming them with the tokens); None as output_ids gives None."""
        req = self._requests.get(request_id)
        if req is None or req.finish_reason is not None:
            return None
        return list(req.logprobs[start:]), list(req.top_logprobs[start:])

    def num_output_tokens(self, request_id: str) -> int:
        """How many tokens a request in the engine has made so far (0 for an unknown id)."""
        req = self._requests.get(request_id)
        return 0 if req is None else len(req.output_token_ids)

    # ---- the loop --------------------------------------------------------------------------
    def step(self, pause: Callable[[], None] | None = None) -> list[RequestOutput]:
        """Run one step; returns the requests it finished.

        `pause` (the service passes one), with priorities and their step limit on, is called
        between the model's layers in a step predicted to take `PAUSE_MIN_S` or more. There the
        caller may add requests and call `step_inside()` until it returns None, to run at once
        the requests that outrank every request of the step (a chat request beside a batch's
        rows) instead of after it. And while the lower classes have the tokens for such a step,
        the step leaves the top class out (Scheduler.deferrable) and `inside_pending` tells the
        pause to run it (the step pauses once before its first layer for it): alone, so as fast as on an idle engine, while the batch's steps stay
        full."""
        self._check_not_driven("step")
        self._inside_s = 0.0
        self._stepping = threading.current_thread()
        try:
            done = self._samples.collect(self._step(pause), self._requests, self._drop_sample)
        finally:
            self._stepping = None
        if self._discarded:
            kept = [o for o in done if o.request_id not in self._discarded]
            self._discarded.difference_update(o.request_id for o in done)
            done = kept
        if self._held:
            held, self._held = self._held, []
            return held + done
        return done

    def step_inside(self) -> list[RequestOutput] | None:
        """Called from a step's `pause`: run one step of the requests that outrank every request
        of the step in progress (Scheduler.schedule_inside), which stays half computed meanwhile,
        and return what it finished. None when there is nothing to run (or no free memory for
        it), outside a pause, or once the steps inside this one took `INSIDE_SHARE` times its
        predicted time or its own time so far, whichever is more: its own requests still get
        their turn."""
        outer = self._outer
        own_s = time.perf_counter() - self._outer_t0 - self._inside_s
        if outer is None or self._inside_s >= max(self._inside_max_s, INSIDE_SHARE * own_s):
            self.inside_pending = False
            return None
        t0 = time.perf_counter()
        sched = self.scheduler.schedule_inside(outer)
        if sched is not None and not self.runner.holds(sched):  # growing the KV tensors would move them under `outer`
            self.scheduler.undo(sched)
            sched = None
        if sched is None:
            self.inside_pending = False
            return None
        self._stats.inside_steps += 1
        attach_sampling_state(sched.chunks, self._requests, self.eos_token_ids)
        try:
            out = self.runner.execute(sched)
        except (torch.OutOfMemoryError, MemoryError):
            self.scheduler.undo(sched)  # they run in a later step, where the limits apply
            self.inside_pending = False
            return None
        except Exception as e:  # each request runs alone: the one at fault fails, the others go on
            sched, out, failed = self._execute_apart(sched, e)
            done, decode_chunks = self._apply(sched, out)
            done = failed + done
        else:
            done, decode_chunks = self._apply(sched, out)
            self._account(sched, out, decode_chunks, time.perf_counter() - t0)
        self._inside_s += time.perf_counter() - t0
        return self._samples.collect(done, self._requests, self._drop_sample)

    def _drop_sample(self, req: Request) -> None:
        self.scheduler.finish(req)
        req.finish("abort")

    def _step(self, pause: Callable[[], None] | None) -> list[RequestOutput]:
        t0 = time.perf_counter()
        rejected, self._rejected = self._rejected, []  # taken first: one that raised was retried at every step
        done = [self._finish_output(r) for r in rejected]
        if not self.scheduler.has_work:
            return done
        while True:  # more than once only when the device ran out of memory
            defer = self._deferrable(pause)
            sched = self.scheduler.schedule(defer)
            if defer is not None and not sched.chunks:  # the lower classes could not run after all
                defer, sched = None, self.scheduler.schedule()
            if not sched.chunks:
                # Nothing ran, so nothing will free memory: the first waiting request cannot run
                # even alone. _validate checks only the prompt. A lone request whose output outgrew
                # the KV budget preempts itself and comes here, as does one for which pinned
                # prefixes and the admission watermark leave too little room. Fail it, never spin.
                req = self.scheduler.waiting[0]
                free = self.pool.num_free * self.config.block_size
                pins = self.kv.pins
                pinned = len({id(b) for blocks in pins.values() for b in blocks}) * self.config.block_size
                held = (f"; {pinned} tokens are held by the system prompts of {len(pins)} open session"
                        f"{'' if len(pins) == 1 else 's'}: destroy() those no longer used" if pinned else "")
                return done + self._fail(req, f"the request needs KV cache for {req.num_tokens} tokens, more than "
                                              f"is free with nothing else running ({free} tokens{held}): raise "
                                              f"kv_cache_memory or lower max_tokens")
            attach_sampling_state(sched.chunks, self._requests, self.eos_token_ids)
            try:
                out = self._execute(sched, pause, defer is not None)
                break
            except (torch.OutOfMemoryError, MemoryError) as e:
                failed = self._out_of_memory(sched, e)
                if failed:
                    return done + failed
            except Exception as e:  # each request runs alone: the one at fault fails, the others go on
                sched, out, failed = self._execute_apart(sched, e)
                done += failed
                break
        self.scheduler.limits.step_succeeded()
        finished, decode_chunks = self._apply(sched, out)
        # The steps run inside this one measured themselves.
        self._account(sched, out, decode_chunks, time.perf_counter() - t0 - self._inside_s)
        return done + finished

    def _pausing(self, pause: Callable[[], None] | None) -> bool:
        cfg = self.config
        return pause is not None and cfg.priority_scheduling and cfg.priority_slowdown is not None

    def _deferrable(self, pause: Callable[[], None] | None) -> int | None:
        """The priority to leave out of this step and run inside it (Scheduler.deferrable).
        Never twice in a row without a step run inside: requests left out and then not run (no
        free memory without preempting, or no pause came) are scheduled as usual."""
        if not self._pausing(pause) or self._left_out_unrun:
            self._left_out_unrun = False
            return None
        return self.scheduler.deferrable(PAUSE_MIN_S)

    def _execute(self, sched: SchedulerOutput, pause: Callable[[], None] | None, deferred: bool):
        if not self._pausing(pause):
            return self.runner.execute(sched)
        predicted = self.scheduler.cost.seconds(sched.num_tokens)
        if not deferred and predicted is not None and predicted < PAUSE_MIN_S:
            return self.runner.execute(sched)
        self._outer, before = sched, self._stats.inside_steps
        self._inside_max_s = INSIDE_SHARE * max(predicted or 0.0, PAUSE_MIN_S)
        self._outer_t0 = time.perf_counter()
        self.inside_pending = deferred  # the first pause runs them, whether or not more came
        try:
            if deferred:  # ... and comes before the first layer: they need not wait for it
                pause()
            return self.runner.execute(sched, pause)
        finally:
            self._outer, self.inside_pending = None, False
            self._left_out_unrun = deferred and self._stats.inside_steps == before

    def _apply(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> tuple[list[RequestOutput], int]:
        """Take a step's results (sampled tokens, log-probs, scores). Returns the requests it
        finished, and how many of its chunks were decoding (a request's next token)."""
        done: list[RequestOutput] = []
        decode_chunks = 0
        for rid, pairs in out.prompt_logprobs.items():
            self._requests[rid].prompt_logprobs.update(pairs)
        for rid, tops in out.prompt_top.items():
            self._requests[rid].prompt_top.update(tops)
        for rid, ranks in out.prompt_ranks.items():
            self._requests[rid].prompt_ranks.update(ranks)
        for req in self.scheduler.advance(sched):
            if req.num_tokens > req.num_prompt_tokens:
                decode_chunks += 1
            if req.params.score_choices:  # the prompt is in: score the candidates now
                done += self._start_scoring(req, out.choice_logprobs[req.request_id])
                continue
            if req.parent is not None:  # a candidate's tokens are scored
                done += self._child_done(req)
                continue
            token = out.sampled[req.request_id]
            req.append_token(token, out.logprobs.get(req.request_id))
            reason = error = None
            if req.matcher is not None:
                reason, error = advance_grammar(req, token, self.config.jump_forward, self.max_model_len,
                                                self.tokenizer, self.eos_token_ids)
            if reason != "error":  # a grammar's last piece may hold a stop string too (cut there, as vLLM)
                stopped = check_stop(req, self.eos_token_ids, self.max_model_len, self.tokenizer)
                reason = stopped if stopped == "stop" or reason is None else reason
            if reason:
                self.scheduler.finish(req)  # first: it takes a request off the running list while it runs
                req.finish(reason, error)
                done.append(self._finish_output(req))
        return done, decode_chunks

    def _account(self, sched: SchedulerOutput, out: ModelRunnerOutput, decode_chunks: int, seconds: float) -> None:
        s = self._stats
        s.steps += 1
        s.decode_tokens += len(out.sampled)
        s.prefill_tokens += sched.num_tokens - decode_chunks
        s.preemptions = self.scheduler.num_preemptions
        s.busy_seconds += seconds
        self.scheduler.cost.observe(sched.num_tokens, seconds)  # for the priority classes' step limit

    # ---- scoring: each candidate's log-likelihood, the prompt's KV shared (see scoring.py) -----
    def _start_scoring(self, req: Request, first: list[float]) -> list[RequestOutput]:
        self.scheduler.finish(req)  # its blocks stay findable in the prefix cache
        for child in start_scoring(req, first):
            self._requests[child.request_id] = child
            self.scheduler.add(child, front=True)
        return [] if req.pending_children else [self._finish_scoring(req)]

    def _child_done(self, child: Request) -> list[RequestOutput]:
        self.scheduler.finish(child)
        self._finish_child(child)
        parent = add_candidate_score(child)
        return [] if parent.pending_children else [self._finish_scoring(parent)]

    def _finish_child(self, child: Request) -> None:
        del self._requests[child.request_id]
        s = self._stats
        s.prompt_tokens += child.num_prompt_tokens
        s.cached_prompt_tokens += max(child.num_cached_tokens, 0)

    def _finish_scoring(self, req: Request) -> RequestOutput:
        choose_best(req)
        return self._finish_output(req)

    def _out_of_memory(self, sched: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """The step ran out of device memory and computed nothing: undo it and lower the step
        limits below it, so that the caller schedules a smaller one (fewer sequences, fewer
        tokens). Only a step of one token of one request fails that request (returned)."""
        self.scheduler.undo(sched)
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()  # hand back what the failed step left cached, against fragmentation
        if self.scheduler.limits.shrink(len(sched.chunks), sched.num_tokens):
            return []
        req = self._requests[sched.chunks[0].request_id]
        return self._fail(req, f"the model ran out of memory running this request alone, one token at a "
                               f"time ({type(error).__name__}: {error}): shorten the prompt, or leave the "
                               f"model more memory (a lower kv_cache_memory or kv_memory_fraction)")

    def _execute_apart(self, sched: SchedulerOutput, error: Exception
                       ) -> tuple[SchedulerOutput, ModelRunnerOutput, list[RequestOutput]]:
        """A step raised (not for memory): a value no check foresaw in one request, a kernel's
        bug on one shape. Run each request's chunk of it alone, in the step's order, so that
        only a request that fails alone fails (with the error it raised) and the others go on.
        Returns the step of the chunks that ran, their output, and the failed requests' outputs."""
        self.pool.drop_free_cached()  # blocks the failed step may have half written
        if len(sched.chunks) > 1:
            log.warning("a step of %d requests failed (%s: %s); running them one by one", len(sched.chunks),
                        type(error).__name__, error)
        merged, ran, failed = ModelRunnerOutput({}), [], []
        for chunk in sched.chunks:
            req = self._requests.get(chunk.request_id)
            if req is None or req.is_finished:  # a candidate whose request already failed
                continue
            try:
                out = error if len(sched.chunks) == 1 else self.runner.execute(
                    SchedulerOutput([chunk], num_blocks=sched.num_blocks))
                if isinstance(out, Exception):
                    raise out
            except Exception as e:  # noqa: BLE001  (this request's own failure)
                failed += self._fail(req, f"the model failed on this step: {type(e).__name__}: {e}")
                self.pool.drop_free_cached()
                continue
            ran.append(chunk)
            merged.sampled.update(out.sampled)
            merged.logprobs.update(out.logprobs)
            merged.prompt_logprobs.update(out.prompt_logprobs)
            merged.prompt_top.update(out.prompt_top)
            merged.prompt_ranks.update(out.prompt_ranks)
            merged.choice_logprobs.update(out.choice_logprobs)
        # A scoring candidate that failed fails its whole request: its siblings' chunks are dropped.
        ran = [c for c in ran if c.request_id in self._requests and not self._requests[c.request_id].is_finished]
        return SchedulerOutput(ran, sched.preempted, sched.num_blocks, sched.admitted), merged, failed

    def _fail(self, req: Request, message: str) -> list[RequestOutput]:
        """Finish `req` with an error; a scoring candidate fails its whole request."""
        if req.parent is not None:
            self.scheduler.finish(req)
            self._finish_child(req)
            req.parent.pending_children.discard(req.request_id)
            req = req.parent
            self._drop_children(req)
        self.scheduler.finish(req)
        req.finish("error", message)
        return [self._finish_output(req)]

    def _finish_output(self, req: Request) -> RequestOutput:
        del self._requests[req.request_id]
        s = self._stats
        s.finished += 1
        s.failed += req.error is not None
        cached = max(req.num_cached_tokens, 0)
        if req.num_cached_tokens >= 0:
            s.prompt_tokens += req.num_prompt_tokens
            s.cached_prompt_tokens += cached
        ids = req.output_token_ids
        text = self.tokenizer.decode(ids) if (self.tokenizer and ids) else ""
        if req.stop_text_len is not None:
            text = text[:req.stop_text_len]
        # A character whose bytes the output ended inside (max_tokens cut an emoji's tokens) is
        # left out, as vLLM's detokenizer leaves it, not written as U+FFFD.
        cut_char = text.endswith("\ufffd")
        text = text.rstrip("\ufffd")
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            output_token_ids=list(ids), text=text, finish_reason=req.finish_reason or "error",
            error=req.error, logprobs=list(req.logprobs) if req.params.logprobs else None,
            top_logprobs=list(req.top_logprobs) if req.params.top_logprobs else None,
            num_cached_tokens=cached, num_preemptions=req.num_preemptions,
            prompt_logprobs=self._prompt_logprobs(req),
            prompt_top_logprobs=self._prompt_tops(req),
            prompt_ranks=self._prompt_ranks(req),
            choice_logprobs=list(req.choice_logprobs) if req.params.score_choices and req.error is None else None,
            grammar_complete=self._grammar_complete(req, text if cut_char else None),
            stop_reason=req.stop_reason if req.finish_reason == "stop" else None,
        )

    def _grammar_complete(self, req: Request, cut_text: str | None) -> bool:
        """Whether the output is a whole match of its grammar. `cut_text`: the output's text where
        it ended inside a character (left out of the text): the match is judged on the text
        written, without the tokens that hold only that character's first bytes."""
        m = req.matcher
        if m is None or req.error is not None or m.is_error():
            return False
        if m.is_accepting() or cut_text is None:
            return m.is_accepting()
        ids = req.output_token_ids
        for k in range(1, min(4, len(ids)) + 1):  # a character is at most 4 bytes
            if self.tokenizer.decode(ids[:-k]).rstrip("\ufffd") != cut_text:
                return False  # that token wrote some of the text: the text is no whole match
            m.rollback(1)  # the request is finished: its matcher is not used again
            if m.is_accepting():
                return True
        return False

    @staticmethod
    def _prompt_logprobs(req: Request) -> list[float] | None:
        first = req.params.prompt_logprobs_from
        if first is None or req.error is not None:
            return None
        return _positions(req.prompt_logprobs, first, req.num_prompt_tokens)

    @staticmethod
    def _prompt_tops(req: Request) -> list[list[tuple[int, float]]] | None:
        first = req.params.prompt_logprobs_from
        if first is None or not req.params.prompt_top_logprobs or req.error is not None:
            return None
        return _positions(req.prompt_top, first, req.num_prompt_tokens)

    @staticmethod
    def _prompt_ranks(req: Request) -> list[int] | None:
        first = req.params.prompt_logprobs_from
        if first is None or not req.params.prompt_ranks or req.error is not None:
            return None
        return _positions(req.prompt_ranks, first, req.num_prompt_tokens)

    @property
    def stats(self) -> EngineStats:
        s = self._stats
        s.running, s.waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        s.kv_blocks_used, s.kv_blocks_total = self.pool.num_used, self.pool.max_blocks
        s.kv_bytes = self.runner.kv.nbytes
        return s

    def generate(self, prompts: Iterable[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 progress: bool = False) -> list[RequestOutput]:
        """Run prompts to completion; outputs in input order. One string, or one list of token
        ids, is one prompt (as in vLLM). `params`: one for all, or one per prompt. Requests added
        with add_request() run along; their outputs come from the next step()."""
        run_there = self._driven_from_elsewhere()
        if run_there is not None:  # a session's service steps this engine: run there, between its steps
            return run_there(lambda: self.generate(prompts, params, progress))
        if self._stepping is threading.current_thread():  # a signal handler, or a function a step calls
            raise RuntimeError("generate() inside a step of this engine (from a signal handler, or from a function "
                               "the step calls): the step's requests would be taken from under it; call it after "
                               "the step, or from another thread")
        with self._generate_lock:  # another thread's call runs first, whole
            outer = self._generating
            self._generating = threading.current_thread()
            try:
                return self._generate(prompts, params, progress)
            finally:
                self._generating = outer

    def _generate(self, prompts, params, progress: bool) -> list[RequestOutput]:
        if isinstance(prompts, (bytes, bytearray)):
            raise TypeError("generate() takes text as str (decode the bytes) or token ids as a list of ints")
        if getattr(prompts, "ndim", None) == 0:
            raise TypeError(f"generate() takes prompts, not a single number ({type(prompts).__name__} of 0 dimensions)")
        if prompts is None or isinstance(prompts, (int, float)):  # it was "'NoneType' object is not iterable"
            raise TypeError(f"generate() takes a prompt (a string, or a list of token ids) or a list of prompts, got "
                            f"{type(prompts).__name__} {prompts!r}")
        one = (isinstance(prompts, (str, dict)) or getattr(prompts, "ndim", None) == 1  # token ids as an array
               or (isinstance(prompts, (list, tuple)) and bool(prompts) and all(type(t) is int for t in prompts)))
        prompts = [prompts] if one else list(prompts)
        if params is None or isinstance(params, SamplingParams):
            plist = [params] * len(prompts)
        elif isinstance(params, (list, tuple)):
            plist = list(params)
            if len(plist) != len(prompts):
                raise ValueError(f"give one SamplingParams for all prompts or one per prompt: got {len(plist)} "
                                 f"for {len(prompts)} prompts")
        else:
            raise TypeError(f"params must be a SamplingParams or a list of them, got {type(params).__name__}")
        bad = next((p for p in plist if p is not None and not isinstance(p, SamplingParams)), None)
        if bad is not None:
            raise TypeError(f"params must be a SamplingParams or a list of them, got a {type(bad).__name__} in it")
        ids: list[str] = []
        results: dict[str, RequestOutput] = {}
        bar = None
        try:
            for p, sp in zip(prompts, plist):
                ids.append(self.add_request(p, sp))
            mine = set(ids)
            if progress:
                from tqdm import tqdm

                from ..progress_bar import width_options
                bar = tqdm(total=len(ids), unit="prompt", **width_options())
            while len(results) < len(ids):
                finished = [o for o in self.step() if o.request_id in mine or self._held.append(o)]
                for o in finished:
                    results[o.request_id] = o
                if bar is not None and finished:
                    bar.update(len(finished))
        except BaseException:  # Ctrl-C, or a step that raised: the call's requests stop, and their outputs
            self._drop_unreturned([i for i in ids if i not in results])  # are not handed to a later step()
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]

    def _drop_unreturned(self, ids: list[str]) -> None:
        for rid in ids:
            req = self._requests.get(rid)
            if req is None:  # gone already: no output of it is to come (kept, the id would drop a later one's)
                continue
            if not req.is_finished:
                self.abort(rid)
            self._discarded.add(rid)
        self._held = [o for o in self._held if o.request_id not in self._discarded]


def _positions(values: dict, first: int, end: int) -> list | None:
    """`values` at prompt positions first..end-1, or None where some were never computed (a
    request stopped before its prompt was: reading them raised KeyError, and every later step
    raised again, for good)."""
    if any(p not in values for p in range(first, end)):
        return None
    return [values[p] for p in range(first, end)]


def _prompt_ids(prompt, tokenizer) -> tuple[list[int], str | None]:
    """A prompt's token ids, or an error for what is neither text nor token ids."""
    if isinstance(prompt, dict):  # vLLM's TextPrompt and TokensPrompt
        keys = set(prompt) - {"multi_modal_data", "mm_processor_kwargs", "cache_salt"}
        if keys == {"prompt_token_ids"} or keys == {"prompt"}:
            (key,) = keys
            if prompt.get("multi_modal_data"):
                return [], "multi_modal_data: this engine runs text models only"
            if isinstance(prompt[key], str) != (key == "prompt"):
                return [], f"a prompt dict's {key!r} is {'text' if key == 'prompt' else 'a list of token ids'}"
            return _prompt_ids(prompt[key], tokenizer)
        return [], (f"a prompt dict (vLLM's TextPrompt or TokensPrompt) has one of 'prompt' (text) or "
                    f"'prompt_token_ids', got the keys {sorted(map(str, prompt))}")
    if isinstance(prompt, str):
        if tokenizer is None:
            return [], "this engine has no tokenizer: give the prompt as token ids"
        try:
            return tokenizer.encode(prompt), None
        except (ValueError, TypeError, UnicodeError) as e:  # a lone surrogate: this prompt fails, not the call
            return [], str(e) or f"the prompt cannot be tokenized ({type(e).__name__})"
    if isinstance(prompt, bytes) or not hasattr(prompt, "__iter__"):
        return [], f"a prompt is a string or a list of token ids, got {type(prompt).__name__}"
    raw = list(prompt)
    if all(type(t) is int for t in raw):
        return raw, None
    try:  # numpy and torch integers are ints by value: take them as such
        ids = [int(t) for t in raw if not isinstance(t, (bool, str, float)) and int(t) == t]
    except (TypeError, ValueError):
        ids = []
    if len(ids) != len(raw):
        return [], "a prompt of token ids must hold integers only"
    return ids, None
