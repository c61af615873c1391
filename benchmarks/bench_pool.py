"""EndpointPool against aurora_swarm-style round-robin, on the same prompts and 3 local servers.

Three `batchprompt serve` processes (the embedded model, one torch thread each, on this
machine), each behind a FaultProxy of ours (tests/remote/fault_proxy.py) that counts the HTTP
requests. Three setups, each run by both clients on prompts of their own (a per-run salt in
the system prompts, so no run finds the previous run's prefixes cached):

- equal:  the three endpoints as they are;
- slow:   the third endpoint 3x slower: its proxy holds each answer back until 3x the time the
          server took (time only, no CPU: the other servers are not slowed by it);
- killed: the third server is killed (-9) 3 s into the run (restarted between the two clients).

Round-robin is aurora_swarm's VLLMPool.send_all_batched: prompt i to endpoint i % 3, one
/v1/completions request per endpoint with all its prompts (the same token ids the pool sends),
connection errors retried 5 times with 2**attempt s of sleep as there, then that endpoint's
prompts fail. The pool is bp.EndpointPool with its defaults. Prompts: G groups of K questions,
each group sharing a long system prompt (sessions: what prefix affinity is for); greedy.
Each run's pool and its backend are made before its clock starts (the backend loads the model's
tokenizer, 5 s here, once per process), as round-robin's prompts are ready before its clock starts.
Reports wall time, HTTP requests, prompts failed, and the servers' prefix-cache hit rate (from
their /metrics), as a markdown table; writes benchmarks/results/pool.json.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import ROOT, save_results
from server_process import ServerProcess

import httpx

sys.path.insert(0, str(ROOT))
from tests.remote.fault_proxy import FaultProxy  # noqa: E402

import batchprompt as bp  # noqa: E402
from batchprompt.engine import SamplingParams  # noqa: E402
from batchprompt.remote import wire  # noqa: E402

TOPICS = ["astronomy", "cooking", "gardening", "sailing", "chess", "geology", "music", "poetry"]


def start_server(tmp: Path, name: str) -> ServerProcess:
    return ServerProcess(tmp, name, ["--max-num-seqs", "64"], env={"OMP_NUM_THREADS": "1"})


def posts(proxies: list[FaultProxy]) -> int:
    """Completion requests the proxies passed on (GET /v1/models checks and probes left out)."""
    return sum(v for p in proxies for k, v in p.requests.items() if k.startswith("POST"))


def cache_counters(urls: list[str]) -> dict[str, tuple[float, float]]:
    """Per server that answers: (prompt tokens, of which cached), from its /metrics."""
    out = {}
    for url in urls:
        try:
            text = httpx.get(url + "/metrics", timeout=10).text
        except httpx.HTTPError:
            continue  # a killed server: its counts are lost with it
        out[url] = (_metric(text, "batchprompt_prompt_tokens_total"), _metric(text, "batchprompt_prompt_tokens_cached_total"))
    return out


def hit_rate(before: dict, after: dict) -> float | None:
    """The prefix-cache hit rate over the servers that answered before and after the run."""
    keys = before.keys() & after.keys()
    prompt = sum(after[k][0] - before[k][0] for k in keys)
    cached = sum(after[k][1] - before[k][1] for k in keys)
    return cached / prompt if prompt > 0 else None


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def make_prompts(tok, groups: int, per_group: int, salt: str) -> list[list[int]]:
    out = []
    for g in range(groups):
        topic = TOPICS[g % len(TOPICS)]
        system = (f"[{salt}-{g}] You are an expert in {topic}. " + f"You answer questions about {topic} briefly, "
                  f"clearly and correctly, in one sentence, without repeating the question. " * 4)
        for k in range(per_group):
            out.append(tok.encode_prompt([{"role": "system", "content": system},
                                          {"role": "user", "content": f"Question {k}: name one fact about {topic}."}]))
    return out


async def round_robin(urls: list[str], model: str, prompts: list[list[int]], params: SamplingParams) -> int:
    """aurora_swarm's send_all_batched: one list request per endpoint; the prompts that failed."""
    groups: dict[int, list[list[int]]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(i % len(urls), []).append(p)

    async def one(url: str, ps: list[list[int]]) -> int:
        body = wire.completion_body(model, ps, params)
        async with httpx.AsyncClient(timeout=600) as client:
            for attempt in range(6):
                try:
                    r = await client.post(url + "/v1/completions", json=body)
                    return 0 if r.status_code == 200 and len(r.json()["choices"]) == len(ps) else len(ps)
                except httpx.HTTPError:
                    if attempt < 5:
                        await asyncio.sleep(2 ** attempt)
            return len(ps)

    return sum(await asyncio.gather(*(one(urls[i], ps) for i, ps in groups.items())))


def run_pool(pool: bp.EndpointPool, prompts: list[list[int]], params: SamplingParams) -> int:
    from batchprompt.api.items import Prepared

    try:
        backend = pool.as_backend()  # made before the clock started (main): this returns it
        batch = bp.Batch(backend, [Prepared(i, p, params) for i, p in enumerate(prompts)])
        results = batch.wait()
        return sum(r.error is not None for r in results)
    finally:
        pool.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--per-group", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--setups", default="equal,slow,killed")
    ap.add_argument("--repeats", type=int, default=2, help="runs of equal and slow per client (best kept)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-pool-"))
    servers = [start_server(tmp, f"s{i}") for i in range(3)]
    proxies = [FaultProxy(s.url) for s in servers]
    urls = [p.url for p in proxies]
    tok = bp.EndpointPool(urls).tokenizer
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    rows, runs = [], 0
    print(f"{args.groups * args.per_group} prompts ({args.groups} groups sharing a system prompt), max_tokens "
          f"{args.max_tokens}, 3 servers on {os.cpu_count()} CPUs", flush=True)
    try:
        plan = [(setup, client) for setup in args.setups.split(",")
                for rep in range(1 if setup == "killed" else args.repeats)
                for client in (("round-robin", "pool") if rep % 2 == 0 else ("pool", "round-robin"))]
        for setup, client in plan:
            proxies[2].slow_factor = 3.0 if setup == "slow" else 1.0
            runs += 1
            prompts = make_prompts(tok, args.groups, args.per_group, f"run{runs}")
            if setup == "killed" and not servers[2].alive():  # restart the killed one
                servers[2] = start_server(tmp, f"s2-{runs}")
                proxies[2].close()
                proxies[2] = FaultProxy(servers[2].url, port=proxies[2].port)
            requests0 = posts(proxies)
            counts0 = cache_counters([s.url for s in servers])
            # The pool and its backend are made before the clock starts, as round-robin's prompts
            # are: the backend loads the tokenizer (5 s here), once per process, not per batch.
            pool = bp.EndpointPool(urls) if client == "pool" else None
            if pool is not None:
                pool.as_backend()
            killer = None
            if setup == "killed":
                victim = servers[2].proc
                killer = threading.Timer(3.0, lambda v=victim: v.send_signal(signal.SIGKILL))
                killer.start()
            t0 = time.perf_counter()
            if client == "round-robin":
                failed = asyncio.run(round_robin(urls, "smollm2-135m", prompts, params))
            else:
                failed = run_pool(pool, prompts, params)
            seconds = time.perf_counter() - t0
            if killer is not None:
                killer.cancel()
            counts1 = cache_counters([s.url for s in servers])
            requests = posts(proxies) - requests0
            hit = hit_rate(counts0, counts1)
            row = {"setup": setup, "client": client, "seconds": round(seconds, 1), "requests": requests,
                   "failed": failed, "prompts": len(prompts),
                   "prefix_cache_hit": None if hit is None else round(hit, 3)}
            rows.append(row)
            print(row, flush=True)
    finally:
        for p in proxies:
            p.close()
        for server in servers:
            if server.alive():
                server.proc.send_signal(signal.SIGTERM)
        for server in servers:
            server.stop()
    best: dict = {}
    for r in rows:  # the best run of each (setup, client)
        key = (r["setup"], r["client"])
        if key not in best or r["seconds"] < best[key]["seconds"]:
            best[key] = r
    rows = list(best.values())
    print(f"\n(best of {args.repeats} for equal and slow)")
    print("\n| setup | client | time (s) | HTTP requests | prompts failed | servers' prefix-cache hit |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setup']} | {r['client']} | {r['seconds']:.1f} | {r['requests']} | {r['failed']}/{r['prompts']} | "
              f"{'n/a' if r['prefix_cache_hit'] is None else format(r['prefix_cache_hit'], '.0%')} |")
    by = {(r["setup"], r["client"]): r for r in rows}
    for setup in ("equal", "slow"):
        if (setup, "pool") in by and (setup, "round-robin") in by:
            print(f"{setup}: round-robin / pool time = "
                  f"{by[(setup, 'round-robin')]['seconds'] / by[(setup, 'pool')]['seconds']:.2f}x")
    save_results("pool", {"rows": rows, "cpus": os.cpu_count(), "groups": args.groups, "per_group": args.per_group,
                          "max_tokens": args.max_tokens})


if __name__ == "__main__":
    main()
