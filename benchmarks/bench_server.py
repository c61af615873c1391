"""`batchprompt serve` under 64 concurrent OpenAI clients, against in-process `batch_prompt`
on the same prompts, and the server's memory over the run.

Three paths, each in a process of its own, loaded and warmed up (64 prompts after the measured
ones) before anything is timed:
- a `batchprompt serve` process (the embedded model) on 127.0.0.1, a fresh --data-dir, sent
  chat.completions requests from `--clients` concurrent `AsyncOpenAI` clients (each its own
  connection, one request at a time; made once, before anything is timed, and kept for the run);
- `LanguageModel.batch_prompt` over the prompts;
- the prompts sent one at a time from `--clients` concurrent asyncio callers in process: the
  server's concurrency without HTTP, which tells the cost of the server from the cost of fewer
  prompts in flight.
The `--requests` spam prompts (the demo's system prompt, greedy, 8 tokens, the default dtype)
are cut into `--rounds` equal slices; each slice runs through the three paths one after the
other, in an order that rotates from round to round, so that the shared machine's drift in
speed falls on every path alike. Each path sees each prompt once (its own prefix cache). Then
`--jobs` Batch API jobs (files.create + batches.create, `--job-rows` rows each, the same body),
one after another, each waited for. The server's RSS after the warm-up, each round and each job.

Prints markdown tables and writes benchmarks/results/server.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, save_results
from server_process import ServerProcess

import numpy as np
import openai

from batchprompt.data import SPAM_SYSTEM, read_sms
from batchprompt.server.process import pin_to

JOB_S = 1800
PATHS = ["server", "batch", "callers"]  # "batch": in-process batch_prompt; "callers": in-process, one prompt each
MAX_TOKENS = 8
WARM_UP = 64


def messages(text: str) -> list[dict]:
    return [{"role": "system", "content": SPAM_SYSTEM}, {"role": "user", "content": text}]


class Clients:
    """`n` AsyncOpenAI clients (each its own connection pool), made once on an event loop kept
    for the whole run, as a long-running client program keeps them: making 64 of them costs
    about a second of CPU on this machine's 2 cores, which is the client's start, not the
    server's throughput. `client_cpu_s` adds up this process's CPU during each `send`."""

    def __init__(self, url: str, n: int):
        self._runner = asyncio.Runner()
        self.client_cpu_s = 0.0

        async def make() -> list[openai.AsyncOpenAI]:
            return [openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
                    for _ in range(n)]

        self._clients = self._runner.run(make())

    def send(self, texts: list[str]) -> tuple[list[float], list[str], list[str], float]:
        """Every text as one chat request, each client sending one request at a time.
        (latencies, texts in input order, errors, wall seconds)"""
        cpu0 = time.process_time()
        try:
            return self._runner.run(self._send_all(texts))
        finally:
            self.client_cpu_s += time.process_time() - cpu0

    async def _send_all(self, texts: list[str]) -> tuple[list[float], list[str], list[str], float]:
        queue: asyncio.Queue = asyncio.Queue()
        for i, t in enumerate(texts):
            queue.put_nowait((i, t))
        latencies: list[float] = []
        out: list[str] = [""] * len(texts)
        errors: list[str] = []

        async def client_loop(client: openai.AsyncOpenAI) -> None:
            while True:
                try:
                    i, text = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                t0 = time.perf_counter()
                try:
                    r = await client.chat.completions.create(model="smollm2-135m", messages=messages(text),
                                                             max_tokens=MAX_TOKENS, temperature=0)
                    latencies.append(time.perf_counter() - t0)
                    out[i] = r.choices[0].message.content or ""
                    if r.choices[0].finish_reason not in ("stop", "length"):
                        errors.append(f"request {i}: finish_reason {r.choices[0].finish_reason}")
                except Exception as e:  # noqa: BLE001  (counted and shown: the benchmark's errors)
                    errors.append(f"request {i}: {type(e).__name__}: {e}")

        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(c) for c in self._clients))
        return latencies, out, errors, time.perf_counter() - t0

    def close(self) -> None:
        async def close_all() -> None:
            for c in self._clients:
                await c.close()

        self._runner.run(close_all())
        self._runner.close()


def run_jobs(server: ServerProcess, texts: list[str], jobs: int) -> list[dict]:
    """`jobs` Batch API jobs of `texts`, one after another; each one's status, time and the RSS after it."""
    lines = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": "smollm2-135m", "messages": messages(t),
                                         "max_tokens": MAX_TOKENS, "temperature": 0}}) + "\n"
                    for i, t in enumerate(texts)).encode()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    done = []
    for k in range(jobs):
        t0 = time.perf_counter()
        f = client.files.create(file=(f"job{k}.jsonl", lines), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + JOB_S
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"Batch API job {k} did not end within {JOB_S}s: {batch}")
            time.sleep(0.5)
            batch = client.batches.retrieve(batch.id)
        seconds = time.perf_counter() - t0
        counts = batch.request_counts
        output = client.files.content(batch.output_file_id).text if batch.output_file_id else ""
        done.append({"status": batch.status, "completed": counts.completed, "failed": counts.failed,
                     "output_lines": len(output.splitlines()), "seconds": seconds, "rss_mib": server.rss_mib()})
    return done


def worker(n: int, clients: int, mode: str) -> None:
    """Child process: a fresh engine, warmed up as the server is, then for each line "A B" on
    stdin the prompts [A, B) through batch_prompt (`mode` "batch") or one at a time from
    `clients` concurrent asyncio callers ("callers"); one JSON line on stdout for each."""
    import batchprompt as bp

    texts = [t for _, t in read_sms(limit=n + WARM_UP)]
    warm, texts = texts[n:], texts[:n]
    lm = bp.LanguageModel.create(system=SPAM_SYSTEM, max_tokens=MAX_TOKENS, temperature=0.0)
    lm.batch_prompt(warm or texts[:WARM_UP])  # the server's warm-up: prompts after the measured ones
    print(json.dumps({"ready": True}), flush=True)

    async def callers(queue: list[str]) -> int:
        failed = 0

        async def caller() -> None:
            nonlocal failed
            while queue:
                batch = lm.create_batch([queue.pop()])
                batch.start()
                failed += sum(r.error is not None for r in await batch.wait_async())

        await asyncio.gather(*(caller() for _ in range(clients)))
        return failed

    for line in sys.stdin:
        a, b = map(int, line.split())
        t0 = time.perf_counter()
        if mode == "batch":
            results = lm.batch_prompt(texts[a:b])
            out = {"errors": sum(r.error is not None for r in results), "texts": [r.text for r in results]}
        else:
            out = {"errors": asyncio.run(callers(list(reversed(texts[a:b])))), "texts": []}
        print(json.dumps({"seconds": time.perf_counter() - t0, **out}), flush=True)
    lm.destroy()


class Worker:
    """A `worker` child process of this script (wait_ready before the first run)."""

    def __init__(self, n: int, clients: int, mode: str, cpus: set[int] | None = None):
        self.mode = mode
        self.proc = subprocess.Popen([sys.executable, __file__, "--in-process", str(n), "--in-process-mode", mode,
                                      "--clients", str(clients)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                                     preexec_fn=pin_to(cpus))

    def _answer(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):  # anything else a library printed is not an answer
                return json.loads(line)
        raise RuntimeError(f"the in-process worker ({self.mode}) ended (exit status {self.proc.wait()})")

    def wait_ready(self) -> None:
        self._answer()

    def run(self, a: int, b: int) -> dict:
        self.proc.stdin.write(f"{a} {b}\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def soak(n: int, clients: int, slice_size: int = 250) -> None:
    """The server alone: `n` requests (distinct prompts) in slices, its RSS after each."""
    texts = [t for _, t in read_sms(limit=n + WARM_UP)]
    warm, texts = texts[len(texts) - WARM_UP:], texts[:len(texts) - WARM_UP]
    server = ServerProcess(Path(tempfile.mkdtemp(prefix="bench-server-soak-")), "server")
    rows, errors, senders = [("ready", server.rss_mib(), None)], 0, None
    try:
        senders = Clients(server.url, clients)
        errors += len(senders.send(warm)[2])
        rows.append(("after warm-up", server.rss_mib(), None))
        for a in range(0, len(texts), slice_size):
            _, _, err, sec = senders.send(texts[a:a + slice_size])
            errors += len(err)
            b = min(a + slice_size, len(texts))
            rows.append((f"after {b} requests", server.rss_mib(), (b - a) / sec))
            print(f"{b}/{len(texts)} requests: RSS {rows[-1][1]:.0f} MiB", flush=True)
    finally:
        if senders is not None:
            senders.close()
        status = server.stop()
    print(f"\n{len(texts)} spam prompts (after {len(warm)} to warm up), {MAX_TOKENS} tokens, greedy; {clients} "
          f"concurrent AsyncOpenAI clients; {errors} errors; server exit status {status}\n")
    print("| point | server RSS (MiB) | prompts/s in the slice |\n|---|---|---|")
    for point, mib, rate in rows:
        print(f"| {point} | {mib:.0f} | {'-' if rate is None else f'{rate:.1f}'} |")
    after = [mib for point, mib, _ in rows[2:]]
    if after:
        print(f"\nafter the first slice: {min(after[1:] or after):.0f} to {max(after[1:] or after):.0f} MiB")
    save_results("server_soak", dict(requests=len(texts), clients=clients, errors=errors, exit_status=status,
                                     rss_mib={p: m for p, m, _ in rows}))


def cpu_list(text: str) -> set[int]:
    """'0', '0,1' or '0-3' -> a set of CPU numbers."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000,
                    help="spam prompts, each run through every path (default 1000)")
    ap.add_argument("--clients", type=int, default=64, help="concurrent AsyncOpenAI clients (default 64)")
    ap.add_argument("--jobs", type=int, default=3, help="Batch API jobs after the requests (default 3)")
    ap.add_argument("--job-rows", type=int, default=200, help="rows per Batch API job (default 200)")
    ap.add_argument("--rounds", type=int, default=4, help="slices of the prompts, each run through the three paths "
                    "in a rotating order (default 4)")
    ap.add_argument("--soak", type=int, default=0, metavar="N",
                    help="instead: only the server, sent N requests in slices of 250 after the warm-up, with its "
                         "RSS after each slice (memory per request)")
    ap.add_argument("--engine-cpus", type=cpu_list, default=None, metavar="LIST",
                    help="CPUs for the server and the in-process paths, e.g. 0 (default: all, shared with the clients)")
    ap.add_argument("--client-cpus", type=cpu_list, default=None, metavar="LIST",
                    help="CPUs for the AsyncOpenAI clients, e.g. 1: clients that do not take the engine's CPU, as "
                         "clients on other machines would not (default: all)")
    ap.add_argument("--in-process", type=int, default=None, help=argparse.SUPPRESS)  # the child's mode
    ap.add_argument("--in-process-mode", choices=("batch", "callers"), default="batch", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.in_process is not None:
        worker(args.in_process, args.clients, args.in_process_mode)
        return
    if args.soak:
        soak(args.soak, args.clients)
        return

    texts = [t for _, t in read_sms(limit=args.requests + WARM_UP)]
    warm, texts = texts[args.requests:], texts[:args.requests]
    if len(texts) < args.requests:
        raise SystemExit(f"only {len(texts)} prompts in the data set")
    if not 1 <= args.rounds <= args.requests:
        raise SystemExit(f"--rounds must be from 1 to --requests ({args.requests}), got {args.rounds}")
    cuts = [len(texts) * k // args.rounds for k in range(args.rounds + 1)]
    tmp = Path(tempfile.mkdtemp(prefix="bench-server-"))
    load = {"start": os.getloadavg()[0]}
    if args.client_cpus is not None:
        os.sched_setaffinity(0, args.client_cpus)  # this process: the clients
    workers = {mode: Worker(args.requests, args.clients, mode, args.engine_cpus) for mode in ("batch", "callers")}
    server = senders = None
    try:
        for w in workers.values():
            w.wait_ready()
        server = ServerProcess(tmp, "server", cpus=args.engine_cpus)
        rss = {"ready": server.rss_mib()}
        senders = Clients(server.url, args.clients)
        _, _, warm_errors, _ = senders.send(warm or texts[:WARM_UP])
        senders.client_cpu_s = 0.0  # from here on: the measured requests only
        rss["after warm-up"] = server.rss_mib()
        seconds = {path: [] for path in PATHS}
        latencies, errors, server_texts, batch_texts, peer_errors = [], list(warm_errors), [], [], 0
        for r in range(args.rounds):
            a, b = cuts[r], cuts[r + 1]
            for path in PATHS[r % 3:] + PATHS[:r % 3]:
                if path == "server":
                    lat, out, err, sec = senders.send(texts[a:b])
                    latencies += lat
                    errors += err
                    server_texts += out
                else:
                    got = workers[path].run(a, b)
                    sec = got["seconds"]
                    peer_errors += got["errors"]
                    batch_texts += got["texts"]
                seconds[path].append(sec)
            rss[f"after round {r + 1} ({b} requests)"] = server.rss_mib()
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{p} {len(texts[a:b]) / seconds[p][-1]:.1f}/s"
                                                               for p in PATHS), flush=True)
        load["rounds"] = os.getloadavg()[0]
        client_ms = 1000 * senders.client_cpu_s / len(texts)
        for w in workers.values():
            w.close()
        jobs = run_jobs(server, texts[:args.job_rows], args.jobs)
        for k, job in enumerate(jobs):
            rss[f"after Batch API job {k + 1} ({job['completed']} rows)"] = job["rss_mib"]
    finally:
        for w in workers.values():
            if w.proc.poll() is None:
                w.proc.kill()
        if senders is not None:
            senders.close()
        status = server.stop() if server is not None else None
    load["end"] = os.getloadavg()[0]

    rate = {p: len(texts) / sum(seconds[p]) for p in PATHS}
    server_rps, peer_rps, callers_rps = rate["server"], rate["batch"], rate["callers"]
    round_ratios = [(cuts[r + 1] - cuts[r]) / seconds["server"][r] / ((cuts[r + 1] - cuts[r]) / seconds["batch"][r])
                    for r in range(args.rounds)]
    same = sum(x == y for x, y in zip(server_texts, batch_texts))
    pinned = args.engine_cpus is not None or args.client_cpus is not None
    cpus = "" if not pinned else (
        f"; server and in-process paths on CPUs {sorted(args.engine_cpus or os.sched_getaffinity(0))}, "
        f"clients on CPUs {sorted(args.client_cpus or os.sched_getaffinity(0))}")
    print(f"\n{len(texts)} spam prompts, {MAX_TOKENS} tokens, greedy; {args.clients} concurrent AsyncOpenAI clients"
          f"{cpus}\n")
    print("| path | errors | p50 latency (s) | p99 latency (s) | prompts/s |\n|---|---|---|---|---|")
    print(f"| `batchprompt serve`, {args.clients} clients | {len(errors)} | {percentile(latencies, 50):.2f} | "
          f"{percentile(latencies, 99):.2f} | {server_rps:.1f} |")
    print(f"| in-process `batch_prompt` | {peer_errors} | - | - | {peer_rps:.1f} |")
    print(f"| in-process, {args.clients} concurrent callers, one prompt each | - | - | - | {callers_rps:.1f} |")
    print(f"\nserver / in-process throughput: {server_rps / peer_rps:.2f} (target >= 0.90; by round: "
          f"{', '.join(f'{x:.2f}' for x in round_ratios)}); server / in-process at the same concurrency: "
          f"{server_rps / callers_rps:.2f}; identical texts {same}/{len(texts)} (in bfloat16 a different batching "
          f"may flip near-ties)")
    where = (f"on CPU {','.join(map(str, sorted(args.client_cpus)))}, the server on "
             f"{','.join(map(str, sorted(args.engine_cpus or [])))}" if pinned else "on the same cores as the server")
    print(f"the clients' own CPU, {where}: {client_ms:.1f} ms a request")
    print("\n| server RSS | MiB |\n|---|---|")
    for point, mib in rss.items():
        print(f"| {point} | {mib:.0f} |")
    for e in errors[:10]:
        print("error:", e)
    print(f"\nload average: {load}; server exit status {status}")
    save_results("server_pinned" if pinned else "server", dict(
        engine_cpus=sorted(args.engine_cpus or []), client_cpus=sorted(args.client_cpus or []),
        requests=len(texts), clients=args.clients, max_tokens=MAX_TOKENS, errors=len(errors), error_samples=errors[:10],
        latency_p50_s=percentile(latencies, 50), latency_p99_s=percentile(latencies, 99),
        rounds=args.rounds, seconds_by_round=seconds, server_prompts_per_s=server_rps, in_process_errors=peer_errors,
        in_process_prompts_per_s=peer_rps, in_process_concurrent_prompts_per_s=callers_rps,
        client_cpu_ms_per_request=client_ms, ratio_same_concurrency=server_rps / callers_rps,
        ratio=server_rps / peer_rps, ratio_by_round=round_ratios, identical_texts=same,
        rss_mib=rss, jobs=jobs, load_average=load, server_exit_status=status))


if __name__ == "__main__":
    main()
