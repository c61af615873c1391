"""Endpoint: one server of the pool, as the pool's event loop sees it.

Its HTTP client, whether it is alive, how much work it holds (requests and tokens in flight),
how many requests it may hold at once (adaptive: grows by one after each success, halves on
429/503 or a timeout, as TCP's AIMD; a request of fewer than SLOT_PROMPTS prompts takes that
part of a place, so rows that cannot share a request still keep the server busy), how fast it has been (tokens per busy second, for
sizing its sub-batches), and its counters. Everything here runs on the pool's loop thread."""
from __future__ import annotations

import contextlib
import json
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

import httpx

from .errors import EndpointError
from .hostfile import EndpointSpec

#: The rate is measured over about this many busy seconds (older work counts less and less).
RATE_HORIZON_S = 30.0
#: A request takes a whole place of the endpoint's limit from this many prompts up; a smaller one
#: that part (one prompt: 1/16). Rows whose parameters differ (a seed each at temperature > 0,
#: a max_tokens each) go one request each, and a limit of 4 requests held a vLLM server to 4
#: sequences at once; they now fill 64 (16 per place), as many as a client sending one prompt
#: per request would keep in flight.
SLOT_PROMPTS = 16


def places(prompts: int | None) -> float:
    """The part of the endpoint's limit a request of `prompts` prompts takes (None: a whole place)."""
    return 1.0 if prompts is None else min(1.0, max(1, prompts) / SLOT_PROMPTS)


@dataclass
class EndpointCounters:
    requests: int = 0  # HTTP requests sent (answered or not)
    prompts: int = 0  # prompts it answered
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    errors: int = 0  # requests that failed (any kind)
    overloaded: int = 0  # 429 / 503 answers
    deaths: int = 0  # times it was found dead and drained
    revivals: int = 0  # times it answered again and was taken back


class Endpoint:
    def __init__(self, index: int, spec: EndpointSpec, *, api_key: str | None, timeout: float,
                 connect_timeout: float, max_in_flight: int, initial_in_flight: int):
        self.index, self.spec, self.url = index, spec, spec.url
        self.weight = spec.weight
        self.api_key = api_key
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.max_in_flight = max_in_flight
        self.limit = float(min(initial_in_flight, max_in_flight))
        self.in_flight = 0  # requests
        self.places_used = 0.0  # of the limit, by the requests in flight (see places)
        self.outstanding_tokens = 0
        self.alive = True
        self.dead_reason: str | None = None
        self.failures = 0  # consecutive endpoint faults
        self.timeout_warned = False  # a request of it got no answer within the timeout (said once)
        self.server_errors = 0  # consecutive 5xx answers (none succeeded since)
        self.refusals = 0  # consecutive 4xx refusals of lone prompts (none succeeded since)
        self.backoff_until = 0.0
        self.unproven = False  # taken back on its GET /v1/models, and no request answered since
        self.flaps = 0  # times it went down again while unproven (its list answers, its requests do not)
        self.max_model_len: int | None = None  # as the endpoint reports it (vLLM's model card)
        self.accepts_token_ids: bool | None = None  # None until a token-id prompt was answered or refused
        self.counters = EndpointCounters()
        self._done_tokens = 0.0
        self._busy_s = 0.0
        self._since = time.monotonic()
        self._client: httpx.AsyncClient | None = None

    # ---- HTTP --------------------------------------------------------------------------------
    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            most = self.max_in_flight * SLOT_PROMPTS + 4
            limits = httpx.Limits(max_connections=most, max_keepalive_connections=most)
            self._client = httpx.AsyncClient(base_url=self.url, headers=headers, limits=limits,
                                             timeout=httpx.Timeout(self.timeout, connect=self.connect_timeout))
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    async def get_json(self, path: str, timeout: float | None = None) -> dict:
        return await self._call("GET", path, None, timeout)

    async def post_json(self, path: str, body: dict, timeout: float | None = None) -> dict:
        return await self._call("POST", path, body, timeout)

    async def _call(self, method: str, path: str, body: dict | None, timeout: float | None) -> dict:
        self.counters.requests += 1
        t = httpx.Timeout(timeout or self.timeout, connect=min(self.connect_timeout, timeout or self.timeout))
        try:
            r = await self.client.request(method, path, json=body, timeout=t)
        except httpx.TimeoutException as e:
            raise self._fail(EndpointError("timeout", f"{self.url}{path}: no answer within "
                                           f"{timeout or self.timeout:g}s ({type(e).__name__})"))
        except httpx.HTTPError as e:  # refused, reset, closed mid-answer, DNS
            raise self._fail(EndpointError("connection", f"{self.url}{path}: {type(e).__name__}: {e or 'connection lost'}"))
        if r.status_code == 200:
            try:
                return r.json()
            except ValueError:
                raise self._fail(EndpointError("server", f"{self.url}{path}: the answer is not JSON: {r.text[:200]!r}",
                                               200))
        raise self._fail(_http_error(self.url + path, r))

    async def post_stream(self, path: str, body: dict, on_event: Callable[[Any], None],
                          timeout: float | None = None) -> dict | bool:
        """POST `body` asking for server-sent events; `on_event(chunk)` for each `data:` chunk as
        it arrives (it may raise EndpointError, which ends the request: its connection closes and
        the server aborts what is left). True once `data: [DONE]` came, False when the stream
        ended without it; a server that answers in one JSON body (it does not stream) returns
        that body."""
        self.counters.requests += 1
        t = httpx.Timeout(timeout or self.timeout, connect=min(self.connect_timeout, timeout or self.timeout))
        where = self.url + path
        try:
            async with self.client.stream("POST", path, json=body, timeout=t) as r:
                if r.status_code != 200:
                    await r.aread()
                    raise self._fail(_http_error(where, r))
                if "text/event-stream" in r.headers.get("content-type", ""):
                    lines = r.aiter_lines()
                else:  # one body: JSON, or events behind a proxy that buffers and relabels them
                    raw = await r.aread()
                    if not raw.lstrip().startswith((b"data:", b":")):
                        try:
                            return json.loads(raw)
                        except ValueError:
                            raise self._fail(EndpointError("server", f"{where}: the answer is not JSON: {raw[:200]!r}",
                                                           200)) from None
                    lines = _lines(raw.decode("utf-8", "replace").splitlines())
                limit = timeout or self.timeout
                last, done = time.monotonic(), False
                async with contextlib.aclosing(lines):  # closed here, also when a chunk raises
                    async for line in lines:
                        if not line.startswith("data:"):  # blank lines, comments (keep-alives), event names
                            if time.monotonic() - last > limit:  # alive, but nothing comes: as a timeout
                                raise self._fail(EndpointError("timeout", f"{where}: no new chunk within {limit:g}s "
                                                                          f"(only keep-alives)"))
                            continue
                        last = time.monotonic()
                        data = line[5:].strip()
                        if data == "[DONE]":
                            done = True  # read on to the end of the body: the connection is then reused
                            continue
                        try:
                            chunk = json.loads(data)
                        except ValueError:
                            raise self._fail(EndpointError("server", f"{where}: a stream chunk is not JSON: "
                                                                     f"{data[:200]!r}", 200)) from None
                        try:
                            on_event(chunk)
                        except EndpointError as e:
                            raise self._fail(e) from None
        except httpx.TimeoutException as e:
            raise self._fail(EndpointError("timeout", f"{where}: no answer within "
                                           f"{timeout or self.timeout:g}s ({type(e).__name__})"))
        except httpx.HTTPError as e:  # refused, reset, closed mid-answer, DNS
            raise self._fail(EndpointError("connection", f"{where}: {type(e).__name__}: {e or 'connection lost'}"))
        return done

    def _fail(self, e: EndpointError) -> EndpointError:
        self.counters.errors += 1
        self.counters.overloaded += e.kind == "overloaded"
        return e

    # ---- load and health ---------------------------------------------------------------------
    def has_room(self, now: float) -> bool:
        return self.alive and now >= self.backoff_until and self.places_used < int(self.limit) - 1e-9

    @property
    def free_places(self) -> int:
        """Whole places of the limit not taken (at least 1)."""
        return max(1, int(int(self.limit) - self.places_used + 1e-9))

    def begin(self, tokens: int, prompts: int | None = None) -> None:
        self._account()
        self.in_flight += 1
        self.places_used += places(prompts)
        self.outstanding_tokens += tokens

    def end(self, tokens: int, done_tokens: int = 0, prompts: int | None = None) -> None:
        self._account()
        self.in_flight -= 1
        self.places_used = max(0.0, self.places_used - places(prompts)) if self.in_flight else 0.0
        self.outstanding_tokens -= tokens
        self._done_tokens += done_tokens

    def on_success(self) -> None:
        self.unproven = False
        self.failures = self.server_errors = self.refusals = 0
        self.limit = min(float(self.max_in_flight), self.limit + 1.0 / max(self.limit, 1.0))

    def on_overload(self, retry_after: float | None, base_s: float, attempt: int | None = None) -> float:
        """A 429/503 or a timeout: send less (the limit halves) and wait a while (Retry-After,
        or exponential backoff with jitter); returns the wait. `attempt`: the failed work's own
        tries, where the backoff follows them (a 5xx) rather than the endpoint's faults, which
        every sub-batch in flight adds to."""
        self.failures += 1
        self.limit = max(1.0, self.limit / 2)
        wait = retry_after if retry_after is not None else backoff(base_s, attempt or self.failures)
        self.backoff_until = max(self.backoff_until, time.monotonic() + wait)
        return wait

    def mark_dead(self, reason: str) -> None:
        if self.alive:
            self.counters.deaths += 1
        self.alive, self.dead_reason = False, reason
        self.limit = 1.0

    def mark_alive(self) -> None:
        if not self.alive:
            self.counters.revivals += 1
            self.unproven = True
        self.alive, self.dead_reason, self.failures, self.backoff_until = True, None, 0, 0.0
        self.limit = max(self.limit, 1.0)

    @property
    def rate(self) -> float | None:
        """Tokens (prompt + generated) per busy second, once it has finished some work."""
        self._account()
        return self._done_tokens / self._busy_s if self._busy_s > 0.5 and self._done_tokens else None

    def _account(self) -> None:
        now = time.monotonic()
        dt = now - self._since
        self._since = now
        if self.in_flight > 0:
            self._busy_s += dt
            if self._busy_s > RATE_HORIZON_S:  # forget old work in proportion
                keep = RATE_HORIZON_S / self._busy_s
                self._busy_s *= keep
                self._done_tokens *= keep

    def describe(self) -> dict:
        c = self.counters
        return {"url": self.url, "alive": self.alive, "dead_reason": self.dead_reason, "in_flight": self.in_flight,
                "limit": round(self.limit, 2), "outstanding_tokens": self.outstanding_tokens,
                "requests": c.requests, "prompts": c.prompts, "prompt_tokens": c.prompt_tokens,
                "cached_tokens": c.cached_tokens, "completion_tokens": c.completion_tokens, "errors": c.errors,
                "overloaded": c.overloaded, "deaths": c.deaths, "revivals": c.revivals,
                "tokens_per_s": None if self.rate is None else round(self.rate, 1),
                "token_ids": self.accepts_token_ids}


def backoff(base_s: float, attempt: int, cap_s: float = 30.0) -> float:
    """Exponential backoff with full jitter: uniform in [base/2, base * 2^attempt], capped."""
    high = min(cap_s, base_s * (2 ** max(attempt - 1, 0)))
    return random.uniform(min(base_s / 2, high), high)


def _http_error(where: str, r: httpx.Response) -> EndpointError:
    message = _error_message(r)
    status = r.status_code
    text = f"{where}: HTTP {status}: {message}"
    if status in (429, 503, 408):  # 408: the server (or a proxy) timed the request out, as a 503 says busy
        return EndpointError("overloaded", text, status, _retry_after(r))
    if status in (502, 504):  # a proxy or load balancer whose server is down or hung
        return EndpointError("gateway", text, status)
    if status in (401, 403):
        return EndpointError("auth", f"{text} (check the pool's api_key)", status)
    if status == 404 and "model" in message.lower():
        return EndpointError("model", text, status)
    if 400 <= status < 500:
        return EndpointError("request", text, status)
    return EndpointError("server", text, status)


def _error_message(r: httpx.Response) -> str:
    try:
        body = r.json()
    except (ValueError, json.JSONDecodeError):
        return r.text[:300] or r.reason_phrase
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])
    if isinstance(err, str):
        return err
    if isinstance(body, dict) and body.get("message"):  # vLLM's older and SGLang's shapes
        return str(body["message"])
    if isinstance(body, dict) and body.get("detail"):
        return str(body["detail"])
    return r.text[:300]


def _retry_after(r: httpx.Response) -> float | None:
    value = r.headers.get("retry-after")
    try:
        return min(max(float(value), 0.0), 60.0) if value is not None else None
    except ValueError:
        return None


async def _lines(lines: list[str]):
    for line in lines:
        yield line
