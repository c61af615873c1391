"""Interactive requests beside a big batch: chat latency and the batch's throughput, with and
without priority scheduling, on a real `batchprompt serve` process (the embedded model).

For each scheduling mode a fresh server runs on 127.0.0.1, and:
1. idle: `--requests` short chat requests (official openai client, one after another, greedy,
   `--max-tokens` tokens, each a different question): p50 and p99 latency;
2. batch alone: a Batch API job of `--rows` SMS spam rows (files.create + batches.create; the
   demo's system prompt, greedy, 8 tokens): rows/s from its creation to its last row;
3. batch + 50 chats: the same job again (its messages marked, so that the prefix cache holds
   nothing of the first run but the system prompt), and once it is under way the same number of
   chat requests: their p50 and p99 latency, and the job's rows/s over its whole run;
4. batch alone again, then idle chats again: the baselines are the mean of the two jobs alone
   and the latencies of all the idle chats, since the speed of a shared machine drifts;
5. batch + chats throughout (`--throughout`, off by default: long): the job once more, with
   chat requests one after another until its last row: the job's rows/s while chats run all along.
A batch's rows/s over its whole run is the robust measure: over a window of a few seconds, the
rows that happen to finish in it depend on how far along the ~600 rows in the engine are.
Chat requests stop when the job ends (first come, a chat waits behind the rows in the engine).

Modes: `priority` (the default: chat first, steps limited to `--priority-slowdown` 2 beside
chat requests), `slowdown=X` (the same with `--priority-slowdown X`), `admission` (chat
first, no step limit: `--priority-slowdown off`), and `fifo` (`--no-priority`: first come,
first served, as before priorities). Prints a markdown table and writes
benchmarks/results/priority.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import save_results
from server_process import ServerProcess

import httpx
import numpy as np
import openai

from batchprompt.data import SPAM_SYSTEM, read_sms

MODES = {"fifo": ["--no-priority"], "admission": ["--priority-slowdown", "off"], "priority": []}
LABELS = {"fifo": "first come (--no-priority)", "admission": "priority, no step limit (--priority-slowdown off)",
          "priority": "priority (default: --priority-slowdown 2)"}


class Server(ServerProcess):
    """The server under test, with a sync OpenAI client and its engine's counters."""

    def __init__(self, flags: list[str], tmp: Path):
        super().__init__(tmp, "server", flags)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=300)

    def stats(self) -> dict:
        return httpx.get(self.url + "/v1/batch/stats", timeout=60).json()


def question(rng: random.Random) -> str:
    return f"What is {rng.randint(10, 99)} plus {rng.randint(10, 99)}? Answer with the number only."


def chats(server: Server, n: float, max_tokens: int, rng: random.Random, stop: threading.Event | None = None,
          limit_s: float = 3600) -> list[float]:
    """Latencies (s) of up to `n` sequential chat requests, none started once `stop` is set."""
    out: list[float] = []
    start = time.monotonic()
    while len(out) < n and not (stop is not None and stop.is_set()) and time.monotonic() - start < limit_s:
        t0 = time.perf_counter()
        r = server.client.chat.completions.create(model="smollm2-135m", max_tokens=max_tokens, temperature=0,
                                                  messages=[{"role": "user", "content": question(rng)}])
        out.append(time.perf_counter() - t0)
        assert r.choices[0].message.content is not None
    return out


def pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def stats(xs: list[float]) -> dict:
    return {"n": len(xs), "p50_s": pct(xs, 50), "p99_s": pct(xs, 99), "latencies_s": xs}


def batch_file(rows: int, tag: str) -> bytes:
    texts = [t for _, t in read_sms(limit=rows)]
    while len(texts) < rows:  # more rows than the file has: it again
        texts += texts[:rows - len(texts)]
    return "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": "smollm2-135m", "max_tokens": 8, "temperature": 0,
                                        "messages": [{"role": "system", "content": SPAM_SYSTEM},
                                                     {"role": "user", "content": f"{tag}: {t}"}]}}) + "\n"
                   for i, t in enumerate(texts)).encode()


class Job:
    """A Batch API job, polled on a thread: `under_way` once `start_rows` rows are done, `ended`
    at its last row; `seconds` from its creation to then."""

    def __init__(self, server: Server, data: bytes, start_rows: int):
        self.server = server
        f = server.client.files.create(file=("rows.jsonl", data), purpose="batch")
        self.t0 = time.monotonic()
        self.batch = server.client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                  completion_window="24h")
        self.under_way, self.ended = threading.Event(), threading.Event()
        self.seconds: float | None = None
        self.rows = self.failed = 0
        self.error: str | None = None
        self._start_rows = start_rows
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        deadline = time.monotonic() + 3600
        try:
            while time.monotonic() < deadline:
                b = self.server.client.batches.retrieve(self.batch.id)
                c = b.request_counts
                if c.completed + c.failed >= self._start_rows:
                    self.under_way.set()
                if c.total and c.completed + c.failed == c.total or b.status in ("failed", "expired", "cancelled"):
                    self.seconds = time.monotonic() - self.t0
                    self.rows, self.failed = c.completed, c.failed
                    if b.status in ("failed", "expired", "cancelled"):
                        self.error = b.status
                    return
                time.sleep(0.25)
            self.error = "not done within an hour"
        finally:
            self.under_way.set()
            self.ended.set()

    def wait(self) -> dict:
        self.ended.wait()
        if self.error or self.failed:
            raise RuntimeError(f"the batch {self.batch.id} ended badly: {self.error or f'{self.failed} rows failed'}")
        return {"rows": self.rows, "seconds": self.seconds, "rows_per_s": self.rows / self.seconds}


def flags_of(mode: str) -> list[str]:
    if mode.startswith("slowdown="):
        return ["--priority-slowdown", mode.split("=", 1)[1]]
    return MODES[mode]


def label_of(mode: str) -> str:
    if mode.startswith("slowdown="):
        return f"priority, --priority-slowdown {mode.split('=', 1)[1]}"
    return LABELS[mode]


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="bench-priority-"))
    load_before = os.getloadavg()[0]  # other work on the machine skews every number: recorded
    server = Server(flags_of(mode), tmp)
    rng = random.Random(7)
    start_rows = min(200, args.rows // 10)  # under way: the shared prefix cached, steps full
    try:
        chats(server, 5, args.max_tokens, rng)  # warm-up
        result: dict = {"mode": mode, "flags": flags_of(mode)}
        idle = chats(server, args.requests, args.max_tokens, rng)
        print(f"  idle chats: p50 {pct(idle, 50):.3f} s", flush=True)
        result["batch_alone"] = Job(server, batch_file(args.rows, "A"), start_rows).wait()
        print(f"  batch alone: {result['batch_alone']['rows_per_s']:.1f} rows/s", flush=True)
        job = Job(server, batch_file(args.rows, "B"), start_rows)
        job.under_way.wait()
        busy = chats(server, args.requests, args.max_tokens, rng, stop=job.ended)
        result["batch_50_chats"] = job.wait()
        result["busy"] = stats(busy)
        print(f"  beside the batch: p50 {result['busy']['p50_s']:.3f} s ({len(busy)} chats); batch "
              f"{result['batch_50_chats']['rows_per_s']:.1f} rows/s", flush=True)
        # Alone again and idle again: the machine's speed drifts over minutes (a shared 2-core
        # VM), so the baselines are taken on both sides of the run beside chats.
        result["batch_alone_after"] = Job(server, batch_file(args.rows, "D"), start_rows).wait()
        print(f"  batch alone again: {result['batch_alone_after']['rows_per_s']:.1f} rows/s", flush=True)
        idle_after = chats(server, args.requests, args.max_tokens, rng)
        print(f"  idle chats again: p50 {pct(idle_after, 50):.3f} s", flush=True)
        result["idle"] = stats(idle + idle_after)
        if args.throughout:
            job = Job(server, batch_file(args.rows, "C"), start_rows)
            all_along = chats(server, float("inf"), args.max_tokens, rng, stop=job.ended)
            result["batch_chats_throughout"] = {**job.wait(), "chats": stats(all_along)}
            print(f"  chats throughout: batch {result['batch_chats_throughout']['rows_per_s']:.1f} rows/s", flush=True)
        alone = (result["batch_alone"]["rows_per_s"] + result["batch_alone_after"]["rows_per_s"]) / 2
        result["alone_rows_per_s"] = alone
        result["p50_ratio"] = result["busy"]["p50_s"] / result["idle"]["p50_s"] if busy else None
        result["p99_ratio"] = result["busy"]["p99_s"] / result["idle"]["p99_s"] if busy else None
        result["change_50_chats"] = result["batch_50_chats"]["rows_per_s"] / alone - 1
        if args.throughout:
            result["change_throughout"] = result["batch_chats_throughout"]["rows_per_s"] / alone - 1
        result["engine"] = {k: v for k, v in server.stats()["engine"].items()
                            if k in ("preemptions", "steps", "finished")}
        result["load_average_1min"] = {"before": load_before, "after": os.getloadavg()[0]}
        return result
    finally:
        server.stop()


def table(results: list[dict], requests: int) -> str:
    ms = lambda s: "-" if s is None else f"{1000 * s:.0f}"  # noqa: E731
    x = lambda r: "-" if r is None else f"{r:.1f}x"  # noqa: E731
    lines = ["| scheduling | chat p50 / p99 idle (ms) | beside the batch (ms) | slowdown p50 / p99 "
             "| batch rows/s alone (before / after) | with 50 chats (against the mean alone) "
             "| with chats throughout |", "|---|---|---|---|---|---|---|"]
    for r in results:
        n = r["busy"]["n"]
        note = "" if n == requests else f" ({n} chats: the batch ended)"
        along = r.get("batch_chats_throughout")
        along = "-" if along is None else f"{along['rows_per_s']:.1f} ({r['change_throughout']:+.0%})"
        lines.append(f"| {label_of(r['mode'])} | {ms(r['idle']['p50_s'])} / {ms(r['idle']['p99_s'])} "
                     f"| {ms(r['busy']['p50_s'])} / {ms(r['busy']['p99_s'])}{note} "
                     f"| {x(r['p50_ratio'])} / {x(r['p99_ratio'])} | {r['batch_alone']['rows_per_s']:.1f} / "
                     f"{r['batch_alone_after']['rows_per_s']:.1f} "
                     f"| {r['batch_50_chats']['rows_per_s']:.1f} ({r['change_50_chats']:+.0%}) | {along} |")
    return "\n".join(lines)


def main() -> None:
    # Stopped with SIGTERM: unwind, so that the server process is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=5000, help="rows in each Batch API job (default 5000)")
    ap.add_argument("--requests", type=int, default=50, help="chat requests idle and beside the batch (default 50)")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens per chat answer (default 8)")
    ap.add_argument("--throughout", action="store_true",
                    help="one more job, with chat requests all along (long: chats then take up to 4/5 "
                         "of the engine's time, and the batch runs at a fifth of its speed or more)")
    ap.add_argument("--modes", default="fifo,priority",
                    help="comma-separated, default fifo,priority: " + ", ".join(MODES) + ", slowdown=X")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES and not m.startswith("slowdown=")]
    if unknown:
        ap.error(f"unknown mode(s) {unknown}: choose from {list(MODES)} or slowdown=X")
    results = []
    for mode in modes:
        print(f"... {label_of(mode)}", flush=True)
        results.append(run_mode(mode, args))
    text = table(results, args.requests)
    save_results("priority", {"rows": args.rows, "requests": args.requests, "max_tokens": args.max_tokens,
                              "cpu_count": os.cpu_count(), "results": results, "table": text})
    print(f"\n{args.rows} Batch API rows (SMS spam, 8 tokens each) per job, chat requests of {args.max_tokens} "
          f"tokens one after another:\n")
    print(text)


if __name__ == "__main__":
    main()
