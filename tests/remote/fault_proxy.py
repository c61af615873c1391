"""FaultProxy: an HTTP/1.1 proxy of our own, in front of one real server, that injects faults.

It runs an asyncio loop on a thread of the test (or benchmark) process and forwards every
request to the upstream server with httpx, unless a fault is planned for it:

- `plan("500" | "429" | "503" | "drop" | "delay:SECONDS", count)`: the next `count` POSTs get
  that answer (429/503 with Retry-After), have their connection closed with no answer ("drop"),
  or wait that long before being forwarded;
- `slow_factor = k`: every answer is held back until k times what the upstream took (the
  benchmark's "3x slower" endpoint: it costs the machine no CPU, only time);
- `set_down(True)`: stop listening and cut open connections (a dead endpoint); `set_down(False)`
  listens again on the same port (it comes back);
- `plan("404" | "408" | "422", count)`: those statuses, as a proxy or a server answers them;
  `"429:30"`: a 429 with Retry-After 30;
- `refuse_ids = SECONDS`: a POST whose prompts are token ids is answered 400 (a server that takes
  text only), the first at once and each later one after SECONDS (sent before the pool knew).

A client that goes away while its request is forwarded has the upstream request cancelled too
(so our server aborts it, as it does for a direct client). `requests` counts what reached the
proxy, per method and path."""
from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter, deque

import httpx

from batchprompt.server.process import free_port

REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 408: "Request Timeout", 422: "Unprocessable Entity",
           429: "Too Many Requests",
           500: "Internal Server Error", 503: "Service Unavailable"}


class FaultProxy:
    def __init__(self, upstream: str, port: int | None = None):
        self.upstream = upstream.rstrip("/")
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.slow_factor = 1.0
        self.refuse_ids: float | None = None
        self.ids_refused = 0
        self.requests: Counter[str] = Counter()
        self.faults_done: Counter[str] = Counter()
        self._plan: deque[str] = deque()
        self._lock = threading.Lock()
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.loop = asyncio.new_event_loop()
        self._client: httpx.AsyncClient | None = None
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name="fault-proxy", daemon=True)
        self._thread.start()
        started.wait(30)
        self._call(self._listen())

    # ---- control (any thread) -------------------------------------------------------------------
    def plan(self, fault: str, count: int = 1) -> None:
        with self._lock:
            self._plan.extend([fault] * count)

    def clear(self) -> None:
        with self._lock:
            self._plan.clear()

    def set_down(self, down: bool) -> None:
        self._call(self._stop_listening() if down else self._listen())

    def close(self) -> None:
        try:
            self._call(self._shutdown())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(30)

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    # ---- the proxy's loop -----------------------------------------------------------------------
    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self._client = httpx.AsyncClient(base_url=self.upstream, timeout=httpx.Timeout(600, connect=5),
                                         limits=httpx.Limits(max_connections=64))
        started.set()
        self.loop.run_forever()

    async def _listen(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, reuse_address=True)

    async def _stop_listening(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for w in list(self._writers):
            w.transport.abort()
        if server is not None:
            await server.wait_closed()

    async def _shutdown(self) -> None:
        await self._stop_listening()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    return
                method, path, headers, body = request
                self.requests[f"{method} {path}"] += 1
                fault = self._next_fault() if method == "POST" else None
                if fault is not None:
                    self.faults_done[fault] += 1
                if fault == "drop":
                    writer.transport.abort()
                    return
                if self.refuse_ids is not None and method == "POST" and _has_id_prompts(body):
                    self.ids_refused += 1
                    if self.ids_refused > 1:
                        await asyncio.sleep(self.refuse_ids)
                    await _write(writer, 400, b'{"error": {"message": "prompt must be a string", "type": '
                                              b'"invalid_request_error", "param": "prompt", "code": null}}', {})
                    continue
                if fault in ("500", "429", "503", "404", "408", "422", "429:30"):
                    status = int(fault.split(":")[0])
                    after = fault.split(":")[1] if ":" in fault else "0.2"
                    extra = {"Retry-After": after} if status in (429, 503) else {}
                    await _write(writer, status, b'{"error": {"message": "injected fault", "type": "server_error", '
                                                 b'"param": null, "code": "injected"}}', extra)
                    continue
                if fault is not None and fault.startswith("delay:"):
                    await asyncio.sleep(float(fault.split(":", 1)[1]))
                answer = await self._forward(reader, method, path, headers, body)
                if answer is None:  # the client went away: the upstream request was cancelled
                    return
                await _write(writer, *answer)
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._writers.discard(writer)
            writer.close()

    def _next_fault(self) -> str | None:
        with self._lock:
            return self._plan.popleft() if self._plan else None

    async def _forward(self, reader, method, path, headers, body):
        assert self._client is not None
        keep = {k: v for k, v in headers.items() if k not in ("host", "content-length", "connection")}
        t0 = time.monotonic()
        upstream = asyncio.ensure_future(self._client.request(method, path, headers=keep, content=body))
        gone = asyncio.ensure_future(reader.read(1))  # b"" once the client closes its connection
        done, _ = await asyncio.wait({upstream, gone}, return_when=asyncio.FIRST_COMPLETED)
        if upstream not in done:
            upstream.cancel()
            await asyncio.gather(upstream, return_exceptions=True)
            return None
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        try:
            r = upstream.result()
        except httpx.HTTPError as e:
            return 502, f'{{"error": {{"message": "proxy: upstream failed: {type(e).__name__}"}}}}'.encode(), {}
        if self.slow_factor > 1:
            await asyncio.sleep((self.slow_factor - 1) * (time.monotonic() - t0))
        extra = {"Retry-After": r.headers["retry-after"]} if "retry-after" in r.headers else {}
        return r.status_code, r.content, extra


def _has_id_prompts(body: bytes) -> bool:
    import json

    try:
        prompt = json.loads(body).get("prompt")
    except (ValueError, AttributeError):
        return False
    return isinstance(prompt, list) and any(not isinstance(p, str) for p in prompt)


async def _read_request(reader: asyncio.StreamReader):
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    n = int(headers.get("content-length", 0))
    body = await reader.readexactly(n) if n else b""
    return method, path, headers, body


async def _write(writer: asyncio.StreamWriter, status: int, body: bytes, extra: dict) -> None:
    head = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}", "Content-Type: application/json",
            f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in extra.items())]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
    await writer.drain()
