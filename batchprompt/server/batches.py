"""Async batches (POST /v1/batch/async): kept in memory, bounded, each with its webhook.

Bounds: a finished batch is kept for `batch_retention_s` (default an hour) after it finished,
and at most `max_batches` (default 1000) are kept at all; when full, the oldest finished one
goes first, and a new batch is refused (429) only if all of them are still running."""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

import httpx

from ..api.batch import Batch
from ..api.session import LanguageModel
from .errors import ApiError
from .responses import progress_json, result_json

log = logging.getLogger("batchprompt")


@dataclass(eq=False)
class AsyncBatch:
    batch: Batch
    session: LanguageModel
    model: str
    callback_url: str | None = None
    id: str = field(default_factory=lambda: "batch_" + uuid.uuid4().hex)
    created_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    cancel_asked: bool = False
    webhook: dict[str, Any] | None = None  # {"url", "status", "attempts", "last_error"}
    task: asyncio.Task | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # set once finished_at is

    @property
    def status(self) -> str:
        if self.finished_at is None:
            return "cancelling" if self.cancel_asked else "running"
        # A cancel (or a stop) that came as the last prompt finished cancelled nothing: the batch
        # completed (it said "cancelled" with every result there).
        if any(r is None or r.finish_reason == "cancelled" for r in self.batch.results):
            return "cancelled"
        return "completed"

    def to_json(self) -> dict[str, Any]:
        """Status and progress; the results (input order) once finished."""
        out = {"id": self.id, "object": "batch.async", "model": self.model, "status": self.status,
               "created_at": int(self.created_at),
               "completed_at": None if self.finished_at is None else int(self.finished_at),
               "progress": progress_json(self.batch.progress), "webhook": self.webhook}
        if self.finished_at is not None:
            out["results"] = [result_json(r) for r in self.batch.results]
        return out


class BatchStore:
    def __init__(self, retention_s: float, max_batches: int):
        self.retention_s, self.max_batches = retention_s, max_batches
        self._batches: OrderedDict[str, AsyncBatch] = OrderedDict()  # oldest first

    def add(self, job: AsyncBatch) -> None:
        self.prune()
        if len(self._batches) >= self.max_batches:
            oldest = next((b for b in self._batches.values() if b.finished_at is not None), None)
            if oldest is None:
                raise ApiError(429, f"{len(self._batches)} async batches are running, the most this server keeps "
                                    f"(--max-batches); wait for some to finish", "too_many_batches")
            del self._batches[oldest.id]
        self._batches[job.id] = job

    def get(self, batch_id: str) -> AsyncBatch:
        self.prune()
        job = self._batches.get(batch_id)
        if job is None:
            raise ApiError(404, f"no batch {batch_id!r}: unknown, finished more than {self.retention_s:.0f}s ago "
                                f"and dropped (--batch-retention), or made before the server last started (async "
                                f"batches live in memory; the Batch API's survive a restart)", "batch_not_found",
                           "batch_id")
        return job

    def prune(self) -> None:
        horizon = time.time() - self.retention_s
        for job in [b for b in self._batches.values() if b.finished_at is not None and b.finished_at < horizon]:
            del self._batches[job.id]

    def running(self) -> int:
        return sum(b.finished_at is None for b in self._batches.values())

    def __len__(self) -> int:
        return len(self._batches)

    def all(self) -> list[AsyncBatch]:
        return list(self._batches.values())


def check_callback_url(url: Any) -> str:
    why = "must be an http:// or https:// URL with a host"
    try:  # urlsplit refuses "http://[::1", its port "http://h:99999"; httpx a NUL or a bad IP address
        parts = urlsplit(url) if isinstance(url, str) else None
        ok = parts is not None and parts.scheme in ("http", "https") and bool(parts.hostname)
        if ok:
            try:
                if parts.port == 0:  # urlsplit takes 0; no receiver listens there
                    raise ValueError
            except ValueError:  # urlsplit's, out of range
                why = "has a port that is not a number from 1 to 65535"
                raise
            httpx.URL(url)
            if not _host_name_ok(parts.hostname):
                why = "has a host that is not a valid name or address"
                raise ValueError
    except (ValueError, httpx.InvalidURL):
        ok = False
    if not ok:
        raise ApiError(400, f"callback_url {why}, got {url!r}", "invalid_callback_url", "callback_url")
    return url


def redacted(url: str) -> str:
    """`url` with the password of its user part hidden, for status bodies and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1)).geturl()


def _without_credentials(url: str) -> tuple[str, tuple[str, str] | None]:
    """(`url` without its user part, that user part as basic auth or None)."""
    parts = urlsplit(url)
    if parts.username is None:
        return url, None
    host = parts.netloc.rsplit("@", 1)[1]
    return parts._replace(netloc=host).geturl(), (unquote(parts.username), unquote(parts.password or ""))


def _host_name_ok(host: str) -> bool:
    """An IP address, or a DNS name: dot-separated labels of letters, digits, hyphens (not at a
    label's ends) and underscores (container service names have them), 63 characters at most;
    non-ASCII names as IDNA. ("exa mple.com", "a_b..c" and "-bad-.com" were taken, and failed
    only at delivery, after every retry.)"""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        if host.replace(".", "").isdigit():  # digits and dots are an IPv4 address, and not a valid one (999.1.1.1)
            return False
    try:
        ascii_name = host.rstrip(".").encode("idna").decode("ascii")
    except UnicodeError:
        return False
    return all(0 < len(label) <= 63 and not label.startswith("-") and not label.endswith("-")
               and all(c.isascii() and (c.isalnum() or c in "-_") for c in label)
               for label in ascii_name.split("."))


#: A webhook posted as the server stops (the batch "cancelled") waits at most this long for its
#: receiver: a receiver that never answers held the stop for the whole timeout (10 s by default).
STOP_TIMEOUT_S = 3.0


class Webhooks:
    """POSTs a finished batch to its callback_url, on the event loop (never on the engine's
    threads): a timeout per attempt, and retries with doubling waits on a network error, a 5xx,
    408 or 429. Another 4xx is final."""

    def __init__(self, attempts: int, backoff_s: float, timeout_s: float):
        self.attempts, self.backoff_s, self.timeout_s = attempts, backoff_s, timeout_s
        self._client: httpx.AsyncClient | None = None
        self.stopping = False  # the server is stopping: a failed post is not tried again

    async def deliver(self, job: AsyncBatch) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(follow_redirects=False, headers={"User-Agent": "batchprompt"})
        record = job.webhook
        payload = job.to_json()
        payload.pop("webhook", None)  # its own delivery, "pending" while it is being made: not the receiver's
        for attempt in range(1, self.attempts + 1):
            record["attempts"] = attempt
            try:
                url, auth = _without_credentials(job.callback_url)  # as basic auth: httpx logs the URL
                timeout = min(self.timeout_s, STOP_TIMEOUT_S) if self.stopping else self.timeout_s
                resp = await self._client.post(url, json=payload, timeout=timeout, auth=auth,
                                               headers={"X-Batchprompt-Batch-Id": job.id})
                if 200 <= resp.status_code < 300:
                    record.update(status="delivered", last_error=None)
                    return
                record["last_error"] = f"HTTP {resp.status_code}"
                if resp.status_code < 500 and resp.status_code not in (408, 429):
                    break
            except httpx.HTTPError as e:
                # A timeout's message is empty: its type alone says what happened.
                record["last_error"] = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            except Exception as e:  # noqa: BLE001 - a URL nothing can be sent to: final, never pending for ever
                record["last_error"] = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                break
            if self.stopping:
                break
            if attempt < self.attempts:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
        record["status"] = "failed"
        log.warning("webhook for %s to %s failed after %d attempt(s): %s", job.id, redacted(job.callback_url),
                    record["attempts"], record["last_error"])

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
