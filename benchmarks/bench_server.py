"""`batchprompt serve` under 64 concurrent OpenAI clients, against in-process `batch_prompt`
on the same prompts, and the server's memory over the run.

1. A `batchprompt serve` process (the embedded model) on 127.0.0.1, a fresh --data-dir.
2. Warm-up: 64 requests. Then `--requests` spam prompts (the demo's system prompt, greedy,
   8 tokens, the default dtype) as chat.completions requests from `--clients` concurrent `AsyncOpenAI`
   clients (each its own connection, one request at a time): errors, p50/p99 latency,
   requests/s; in two halves, the server's RSS after each.
3. `--jobs` Batch API jobs (files.create + batches.create, `--job-rows` rows each, the same
   body), one after another, each waited for; the RSS after each.
4. The same prompts through `LanguageModel.batch_prompt` in a fresh process (after the
   server's 64-prompt warm-up), before the server starts and after it stopped (nothing else of
   this benchmark runs then): prompts/s, the mean of the two against the server's (on a shared
   machine the load drifts; both runs are reported). Another fresh process sends the prompts one
   at a time from `--clients` concurrent asyncio callers: the server's concurrency without HTTP,
   which tells the cost of the server from the cost of fewer prompts in flight (a process of its
   own, so that its prompts are not in the prefix cache already).

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

JOB_S = 1800
MAX_TOKENS = 8
WARM_UP = 64


def messages(text: str) -> list[dict]:
    return [{"role": "system", "content": SPAM_SYSTEM}, {"role": "user", "content": text}]


async def _send_all(url: str, texts: list[str], clients: int) -> tuple[list[float], list[str], list[str], float]:
    """Every text as one chat request, from `clients` concurrent clients, each its own
    AsyncOpenAI (connection pool) sending one request at a time. (latencies, texts in input
    order, errors, wall seconds)."""
    queue: asyncio.Queue = asyncio.Queue()
    for i, t in enumerate(texts):
        queue.put_nowait((i, t))
    latencies: list[float] = []
    out: list[str] = [""] * len(texts)
    errors: list[str] = []

    async def client_loop() -> None:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600) as client:
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
    await asyncio.gather(*(client_loop() for _ in range(clients)))
    return latencies, out, errors, time.perf_counter() - t0


def send_all(url: str, texts: list[str], clients: int):
    return asyncio.run(_send_all(url, texts, clients))


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


def in_process(n: int, clients: int, mode: str) -> None:
    """Child process, on a fresh engine: the prompts through batch_prompt (`mode` "batch"), or
    one at a time from `clients` concurrent asyncio callers ("callers": the server's concurrency
    without HTTP, which tells the cost of the server from the cost of fewer prompts in flight).
    One mode per process, so that neither finds the other's prompts in the prefix cache. Prints
    one JSON line."""
    import batchprompt as bp

    texts = [t for _, t in read_sms(limit=n + WARM_UP)]
    warm, texts = texts[n:], texts[:n]
    lm = bp.LanguageModel.create(system=SPAM_SYSTEM, max_tokens=MAX_TOKENS, temperature=0.0)
    lm.batch_prompt(warm or texts[:WARM_UP])  # the server's warm-up: prompts after the measured ones
    if mode == "batch":
        t0 = time.perf_counter()
        results = lm.batch_prompt(texts)
        seconds = time.perf_counter() - t0
        print(json.dumps({"seconds": seconds, "errors": sum(r.error is not None for r in results),
                          "texts": [r.text for r in results]}))
        lm.destroy()
        return

    async def callers() -> int:
        queue = list(reversed(texts))
        failed = 0

        async def caller() -> None:
            nonlocal failed
            while queue:
                batch = lm.create_batch([queue.pop()])
                batch.start()
                failed += sum(r.error is not None for r in await batch.wait_async())

        await asyncio.gather(*(caller() for _ in range(clients)))
        return failed

    t0 = time.perf_counter()
    errors = asyncio.run(callers())
    print(json.dumps({"seconds": time.perf_counter() - t0, "errors": errors}))
    lm.destroy()


def run_peer(n: int, clients: int) -> dict:
    """in_process(n, clients, mode) for both modes, each in a fresh process: batch_prompt's
    seconds, errors and texts, and the concurrent callers' seconds."""
    out = {}
    for mode in ("batch", "callers"):
        child = subprocess.run([sys.executable, __file__, "--in-process", str(n), "--in-process-mode", mode,
                                "--clients", str(clients)], capture_output=True, text=True,
                               cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=3600)
        if child.returncode != 0:
            raise RuntimeError(f"the in-process run ({mode}) failed:\n{child.stderr[-4000:]}")
        out[mode] = json.loads(child.stdout.strip().splitlines()[-1])
    return {"seconds": out["batch"]["seconds"], "errors": out["batch"]["errors"] + out["callers"]["errors"],
            "texts": out["batch"]["texts"], "concurrent_seconds": out["callers"]["seconds"]}


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000, help="spam prompts sent to the server (default 1000)")
    ap.add_argument("--clients", type=int, default=64, help="concurrent AsyncOpenAI clients (default 64)")
    ap.add_argument("--jobs", type=int, default=3, help="Batch API jobs after the requests (default 3)")
    ap.add_argument("--job-rows", type=int, default=200, help="rows per Batch API job (default 200)")
    ap.add_argument("--in-process", type=int, default=None, help=argparse.SUPPRESS)  # the child's mode
    ap.add_argument("--in-process-mode", choices=("batch", "callers"), default="batch", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.in_process is not None:
        in_process(args.in_process, args.clients, args.in_process_mode)
        return

    texts = [t for _, t in read_sms(limit=args.requests + WARM_UP)]
    warm, texts = texts[args.requests:], texts[:args.requests]
    if len(texts) < args.requests:
        raise SystemExit(f"only {len(texts)} prompts in the data set")
    half = len(texts) // 2
    tmp = Path(tempfile.mkdtemp(prefix="bench-server-"))
    load = {"start": os.getloadavg()[0]}
    peers = [run_peer(args.requests, args.clients)]
    load["after in-process 1"] = os.getloadavg()[0]
    server = ServerProcess(tmp, "server")
    url = server.url
    rss = {"ready": server.rss_mib()}
    try:
        _, _, warm_errors, _ = send_all(url, warm or texts[:WARM_UP], args.clients)
        rss["after warm-up"] = server.rss_mib()
        lat1, out1, err1, s1 = send_all(url, texts[:half], args.clients)
        rss[f"after {half} requests"] = server.rss_mib()
        lat2, out2, err2, s2 = send_all(url, texts[half:], args.clients)
        rss[f"after {len(texts)} requests"] = server.rss_mib()
        load["server"] = os.getloadavg()[0]
        jobs = run_jobs(server, texts[:args.job_rows], args.jobs)
        for k, job in enumerate(jobs):
            rss[f"after Batch API job {k + 1} ({job['completed']} rows)"] = job["rss_mib"]
    finally:
        status = server.stop()
    server_texts = out1 + out2
    latencies, errors, seconds = lat1 + lat2, warm_errors + err1 + err2, s1 + s2

    peers.append(run_peer(args.requests, args.clients))
    load["end"] = os.getloadavg()[0]

    server_rps = len(texts) / seconds
    peer_rates = [len(texts) / peer["seconds"] for peer in peers]
    peer_rps = sum(peer_rates) / len(peer_rates)
    callers_rates = [len(texts) / peer["concurrent_seconds"] for peer in peers]
    callers_rps = sum(callers_rates) / len(callers_rates)
    same = sum(a == b for a, b in zip(server_texts, peers[-1]["texts"]))
    print(f"\n{len(texts)} spam prompts, {MAX_TOKENS} tokens, greedy; {args.clients} concurrent AsyncOpenAI clients\n")
    print("| path | errors | p50 latency (s) | p99 latency (s) | prompts/s |\n|---|---|---|---|---|")
    print(f"| `batchprompt serve`, {args.clients} clients | {len(errors)} | {percentile(latencies, 50):.2f} | "
          f"{percentile(latencies, 99):.2f} | {server_rps:.1f} |")
    print(f"| in-process `batch_prompt` (before / after the server: "
          f"{' / '.join(f'{r:.1f}' for r in peer_rates)}) | {sum(p['errors'] for p in peers)} | - | - | {peer_rps:.1f} |")
    print(f"| in-process, {args.clients} concurrent callers, one prompt each (before / after: "
          f"{' / '.join(f'{r:.1f}' for r in callers_rates)}) | - | - | - | {callers_rps:.1f} |")
    print(f"\nserver / in-process throughput: {server_rps / peer_rps:.2f} (target >= 0.90); server / in-process "
          f"at the same concurrency: {server_rps / callers_rps:.2f}; identical texts "
          f"{same}/{len(texts)} (in bfloat16 a different batching may flip near-ties)")
    print("\n| server RSS | MiB |\n|---|---|")
    for point, mib in rss.items():
        print(f"| {point} | {mib:.0f} |")
    for e in errors[:10]:
        print("error:", e)
    print(f"\nload average: {load}; server exit status {status}")
    save_results("server", dict(
        requests=len(texts), clients=args.clients, max_tokens=MAX_TOKENS, errors=len(errors), error_samples=errors[:10],
        latency_p50_s=percentile(latencies, 50), latency_p99_s=percentile(latencies, 99),
        server_seconds=seconds, server_halves_seconds=[s1, s2], server_prompts_per_s=server_rps,
        in_process_seconds=[p["seconds"] for p in peers], in_process_errors=sum(p["errors"] for p in peers),
        in_process_prompts_per_s=peer_rps, in_process_concurrent_seconds=[p["concurrent_seconds"] for p in peers],
        in_process_concurrent_prompts_per_s=callers_rps, ratio_same_concurrency=server_rps / callers_rps,
        ratio=server_rps / peer_rps, identical_texts=same, rss_mib=rss, jobs=jobs, load_average=load,
        server_exit_status=status))


if __name__ == "__main__":
    main()
