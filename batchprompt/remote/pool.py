"""EndpointPool: many OpenAI-compatible servers (vLLM, SGLang, `batchprompt serve`) as one model.

    pool = bp.EndpointPool("hosts.txt", model="smollm2-135m")
    lm = bp.LanguageModel.create(model=pool)          # sessions, batch_prompt, create_batch, ...
    results = bp.batch_prompt(prompts, model=pool)
    responses = await pool.send_all_batched(prompts)  # aurora_swarm's methods (swarm.py)

At creation every endpoint is asked GET /v1/models: the model must be served by each endpoint
that answers (a clear error names the one that does not, and what it serves); endpoints that do
not answer start as dead and are taken in once they do; none answering is an error. With no
`model`, the one model every endpoint serves is used.
"""
from __future__ import annotations

import logging
import math
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable

import httpx

from .backend import RemoteBackend, served_models
from .endpoint import Endpoint
from .errors import PoolError
from .hostfile import EndpointSpec, endpoint_specs
from .swarm import SwarmMethods
from .tokenizer import load_tokenizer
from .wire import STRUCTURED_STYLES

log = logging.getLogger("batchprompt")


class EndpointPool(SwarmMethods):
    """A pool of OpenAI-compatible endpoints that runs prompts as one model does.

    endpoints: a hostfile path, or a list of 'host:port' / URLs (see hostfile.py).
    model: the served model's name (default: the one model the endpoints serve).
    api_key: sent as `Authorization: Bearer KEY` to every endpoint.
    timeout: seconds one HTTP request may go without an answer (a streamed sub-batch: without a
        new chunk), before it is retried elsewhere.
    use_batch: True sends sub-batches (a list of prompts per /v1/completions request); False
        sends each prompt alone (the swarm methods then use /v1/chat/completions, as aurora_swarm).
    stream: sub-batches are asked as server-sent events, so each prompt is answered (and a job
        journals it) as soon as it finishes, not when its request's slowest prompt does; a server
        that answers in one JSON body anyway is read as such. False asks for one body.
    tokenizer: the model's tokenizer files, to render prompts client-side (a local model, a hub
        id, 'smollm2-135m'); default: the model's name.
    max_model_len: the context length, where neither the endpoints (vLLM's max_model_len) nor the
        tokenizer's model config says it.
    batch_tokens / batch_prompts: the most a sub-batch holds (prompt + max_tokens per prompt; prompts);
        min_batch_tokens: the least it holds while work remains (a sub-batch holds the rest of its
        endpoint's share of the work not yet answered, over the requests it may still send).
    max_in_flight: requests at once per endpoint, at most (the adaptive limit starts at
        initial_in_flight, grows on success, halves on 429/503); a request of fewer than 16
        prompts takes that part of a place (endpoint.SLOT_PROMPTS), so 16 one-prompt requests
        fill one.
    max_retries: failed tries a prompt gets before it fails with the last error.
    give_up_after: seconds work waits while no endpoint is alive (each is probed meanwhile, and
        taken back when it answers), before it fails with an error naming each endpoint's fault.
    structured: how structured output is sent: "structured_outputs" (vLLM >= 0.10, ours) or
        "guided" (guided_choice/guided_regex/guided_json/guided_grammar, older vLLM).
    """

    remote = True  # the model runs on the servers: `batchprompt run` takes its name from them

    def __init__(self, endpoints: str | Path | Iterable[str | EndpointSpec], model: str | None = None, *,
                 api_key: str | None = None, timeout: float = 300.0, use_batch: bool = True,
                 tokenizer: str | None = None, max_model_len: int | None = None, batch_tokens: int = 16384,
                 min_batch_tokens: int = 1024,
                 batch_prompts: int = 256, max_in_flight: int = 4, initial_in_flight: int = 2,
                 max_retries: int = 4, backoff_s: float = 0.5, give_up_after: float = 120.0,
                 connect_timeout: float = 5.0, structured: str = "structured_outputs", max_tokens: int = 512,
                 stream: bool = True):
        self.specs = endpoint_specs(endpoints)
        for name, value, low in (("timeout", timeout, 0), ("connect_timeout", connect_timeout, 0),
                                 ("backoff_s", backoff_s, 0), ("give_up_after", give_up_after, 0)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= low:
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
        for name, value in (("batch_tokens", batch_tokens), ("min_batch_tokens", min_batch_tokens),
                            ("batch_prompts", batch_prompts),
                            ("max_in_flight", max_in_flight), ("initial_in_flight", initial_in_flight),
                            ("max_tokens", max_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an integer >= 0, got {max_retries!r}")
        if structured not in STRUCTURED_STYLES:
            raise ValueError(f"structured must be one of {', '.join(STRUCTURED_STYLES)}, got {structured!r}")
        self.api_key, self.timeout, self.connect_timeout = api_key, float(timeout), float(connect_timeout)
        self.use_batch = bool(use_batch)
        self.use_stream = bool(stream)
        self.batch_tokens, self.batch_prompts = batch_tokens, batch_prompts
        self.min_batch_tokens = min(min_batch_tokens, batch_tokens)
        self.max_in_flight, self.initial_in_flight = max_in_flight, initial_in_flight
        self.max_retries, self.backoff_s, self.give_up_after = max_retries, float(backoff_s), float(give_up_after)
        self.structured = structured
        self.max_tokens = max_tokens  # the swarm methods' default
        self._lock = threading.Lock()
        self._backend: RemoteBackend | None = None
        self.model, self._reported_len, self._down = self._check(model)
        self._tokenizer_name = tokenizer or self.model
        self._max_model_len_arg = max_model_len
        self._tokenizer = None
        self._model_len: int | None = None

    # ---- start-up checks ----------------------------------------------------------------------
    def _check(self, model: str | None) -> tuple[str, int | None, dict[str, str]]:
        """GET /v1/models on every endpoint: (the model, the smallest context length an endpoint
        reports, {url: why} of those that did not answer)."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

        deadline = time.monotonic() + self.give_up_after

        permanent: set[str] = set()  # endpoints whose answer will not change by waiting

        def ask(spec: EndpointSpec):
            try:  # a server that takes connections but never answers waits no longer than give_up_after
                wait = max(0.5, min(self.timeout, 10.0, deadline - time.monotonic()))
                r = httpx.get(spec.url + "/v1/models", headers=headers, timeout=wait)
            except httpx.HTTPError as e:
                if _is_tls_error(e):
                    permanent.add(spec.url)  # https to a plain-HTTP server, a certificate refused
                return spec, None, f"{type(e).__name__}: {e}"
            if r.status_code in (401, 403):
                raise PoolError(f"{spec.url} refused the API key (HTTP {r.status_code}): pass api_key= (or --api-key) "
                                f"with the key the servers were started with")
            if r.status_code != 200:
                if 400 <= r.status_code < 500 and r.status_code not in (408, 429):
                    permanent.add(spec.url)  # no such route: another path or server, not one still loading
                return spec, None, f"GET /v1/models answered HTTP {r.status_code}: {r.text[:200]}"
            try:
                return spec, r.json(), None
            except ValueError:
                return spec, None, f"GET /v1/models did not answer JSON: {r.text[:200]!r}"

        # Servers still loading (a pool started beside them) get give_up_after seconds to answer,
        # as work waits that long for an endpoint: the first that answers starts the pool.
        wait, warned = min(1.0, self.backoff_s or 1.0), False
        while True:
            with ThreadPoolExecutor(max_workers=min(16, len(self.specs))) as ex:
                answers = list(ex.map(ask, self.specs))
            down = {spec.url: why for spec, data, why in answers if data is None}
            up = [(spec, data) for spec, data, _ in answers if data is not None]
            if up:
                break
            if set(down) <= permanent:
                detail = "; ".join(f"{u}: {w}" for u, w in down.items())
                raise PoolError(f"none of the {len(self.specs)} endpoints can serve, and waiting will not change "
                                f"that ({detail}); check the URLs: the server's base URL (http://host:port/v1), "
                                f"and http, not https, for a server without TLS")
            left = deadline - time.monotonic()
            if left <= 0:
                detail = "; ".join(f"{u}: {w}" for u, w in down.items())
                raise PoolError(f"none of the {len(self.specs)} endpoints answered GET /v1/models in "
                                f"{self.give_up_after:g}s (give_up_after) ({detail}); start the servers, or check "
                                f"the hostfile's host:port lines")
            if not warned:
                log.warning("none of the %d endpoints answers GET /v1/models yet: waiting up to %gs (give_up_after) "
                            "for one", len(self.specs), self.give_up_after)
                warned = True
            time.sleep(min(wait, left))
            wait = min(wait * 2, 5.0)
        served = {spec.url: served_models(data) for spec, data in up}
        if model is None:
            common = set.intersection(*(set(m) for m in served.values()))
            if len(common) != 1:
                listing = "; ".join(f"{u}: {', '.join(m) or 'none'}" for u, m in served.items())
                raise PoolError(f"give model= (or --model): the endpoints serve {listing}" if common else
                                f"the endpoints serve no model in common ({listing}); give model= (or --model) and "
                                f"a hostfile of servers that all serve it")
            model = common.pop()
        for url, models in served.items():
            if model not in models:
                raise PoolError(f"{url} does not serve the model {model!r} (it serves: {', '.join(models) or 'none'}); "
                                f"give model= (or --model) one of those, or leave that endpoint out of the hostfile")
        lens = []
        for _, data in up:
            for m in data.get("data") or []:
                if isinstance(m, dict) and m.get("id") == model and isinstance(m.get("max_model_len"), int):
                    lens.append(m["max_model_len"])
        for url, why in down.items():
            log.warning("endpoint %s did not answer (%s): it starts as down and gets work once it answers", url, why)
        return model, (min(lens) if lens else None), down

    # ---- the backend --------------------------------------------------------------------------
    @property
    def down_at_start(self) -> dict[str, str]:
        """{url: why} of the endpoints that did not answer when the pool was made."""
        return dict(self._down)

    @property
    def tokenizer(self):
        self._load_tokenizer()
        return self._tokenizer

    @property
    def max_model_len(self) -> int | None:
        self._load_tokenizer()
        return self._model_len

    def _load_tokenizer(self) -> None:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer, config_len = load_tokenizer(self._tokenizer_name)
                self._model_len = self._max_model_len_arg or self._reported_len or config_len

    def as_backend(self, model: Any = None, *, device: str = "auto", dtype: str = "auto",
                   engine_options: dict | None = None) -> RemoteBackend:
        """The pool as a backend (backends/base.py): what `LanguageModel.create(model=pool)`,
        `batch_prompt(..., model=pool)` and `batchprompt run --endpoints` run on. `device`,
        `dtype` and `engine_options` are the servers' business and ignored here."""
        if model is not None and str(model) != self.model:
            raise ValueError(f"this pool serves {self.model!r}, not {model!r}: pass model=pool alone (or "
                             f"model={self.model!r})")
        self._load_tokenizer()
        with self._lock:
            if self._backend is None or self._backend.stopped:
                endpoints = [Endpoint(i, spec, api_key=self.api_key, timeout=self.timeout,
                                      connect_timeout=self.connect_timeout, max_in_flight=self.max_in_flight,
                                      initial_in_flight=self.initial_in_flight) for i, spec in enumerate(self.specs)]
                backend = RemoteBackend(self, endpoints, self.model, self._tokenizer, self._model_len)
                for e in endpoints:
                    if e.url in self._down:
                        backend.call_on_loop(backend._mark_dead, e, self._down[e.url], False)  # warned about above
                self._backend = backend
            return self._backend

    def _backend_stopped(self, backend: RemoteBackend) -> None:
        with self._lock:
            if self._backend is backend:
                self._backend = None

    @property
    def size(self) -> int:
        return len(self.specs)

    @property
    def endpoints(self) -> list[EndpointSpec]:
        return list(self.specs)

    def stats(self):
        """The pool's counters as EngineStats (tokens, prefix-cache hits the servers report, ...)."""
        return self.as_backend().stats()

    def endpoint_stats(self) -> list[dict]:
        """Per endpoint: alive, requests sent, prompts, tokens, errors, deaths and revivals, speed."""
        return self.as_backend().endpoint_stats()

    def close(self) -> None:
        """Stop the pool's loop; work still waiting is answered 'cancelled'. Idempotent."""
        with self._lock:
            backend, self._backend = self._backend, None
        if backend is not None:
            backend.shutdown()

    def __enter__(self) -> "EndpointPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self) -> "EndpointPool":
        return self

    async def __aexit__(self, *exc) -> None:
        import asyncio

        await asyncio.to_thread(self.close)

    def __repr__(self) -> str:
        return f"EndpointPool({self.model!r}, {len(self.specs)} endpoints)"


def _is_tls_error(e: BaseException | None) -> bool:
    """Whether an error comes from TLS (ssl.SSLError somewhere in its chain)."""
    while e is not None:
        if isinstance(e, ssl.SSLError):
            return True
        e = e.__cause__ or e.__context__
    return False
