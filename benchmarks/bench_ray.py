"""Engine replicas on Ray against one local engine, on the same machine, in one run.

The spam workload (shared system prompt, greedy, 8 tokens, the default dtype) through
`LanguageModel.batch_prompt` on 2 Ray replicas x 1 torch thread (a local Ray of 2 CPUs) and on
one local engine with 2 torch threads; the two alternate after a warm-up and the best of each is
compared: the Ray path's overhead (target within 15%). Every run takes rows of its own (see main). Then one more Ray run in which the
replica holding the most rows is killed (ray.kill) once a quarter of the results are in: the
rows re-run, the extra time the batch took, and how long Ray took to bring the replica back.
Prints a markdown table and writes benchmarks/results/ray.json.
"""
from __future__ import annotations

import threading
import time

from common import overhead_table, rows_and_repeats, save_results

import batchprompt as bp
from batchprompt.data import SPAM_SYSTEM, read_sms


def main() -> None:
    args = rows_and_repeats(__doc__, rows=400, repeats=2)
    import ray
    import torch

    # Fresh rows for every run (each repeat and the kill run): a run of rows the same engine has
    # just answered finds them in its prefix cache, which a local engine keeps whole and the
    # replicas split between them, so a repeat of the same rows favours the local engine.
    pool = [t for _, t in read_sms(limit=args.rows * (args.repeats + 1) + 32)]
    slices = [pool[32 + i * args.rows:32 + (i + 1) * args.rows] for i in range(args.repeats + 1)]
    texts = slices[-1]
    torch.set_num_threads(2)
    local = bp.LanguageModel.create(system=SPAM_SYSTEM, max_tokens=8, temperature=0.0)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    cluster = bp.RayCluster(replicas=2, replica_cpus=1, threads=1)
    t0 = time.perf_counter()
    remote = bp.LanguageModel.create(system=SPAM_SYSTEM, cluster=cluster, max_tokens=8, temperature=0.0)
    start_s = time.perf_counter() - t0
    local.batch_prompt(pool[:32])  # warm-up
    remote.batch_prompt(pool[:32])

    times: dict[str, list[float]] = {"local": [], "ray": []}
    out: dict[str, list[str]] = {"local": [], "ray": []}
    for rows in slices[:-1]:
        for key, lm in (("local", local), ("ray", remote)):
            t0 = time.perf_counter()
            results = lm.batch_prompt(rows)
            times[key].append(time.perf_counter() - t0)
            out[key] += [r.text for r in results]
    same = sum(a == b for a, b in zip(out["local"], out["ray"]))
    best, overhead = overhead_table(times, {"local": "one local engine, 2 threads",
                                            "ray": "Ray, 2 replicas x 1 thread"}, len(texts), "prompts")

    # A replica killed mid-batch.
    backend = remote.backend
    rerun0 = backend.rows_rerun
    batch = remote.create_batch(texts)
    seen, kill = [0], {}

    def on_result(index, result):
        seen[0] += 1
        if not kill and seen[0] >= len(texts) // 4:
            victim = max(backend.replicas, key=lambda r: r["in_flight"])
            kill.update(index=victim["index"], at=time.perf_counter(), in_flight=victim["in_flight"])
            ray.kill(victim["handle"], no_restart=False)
    batch.on_result(on_result)
    t0 = time.perf_counter()
    results = batch.wait()
    killed_s = time.perf_counter() - t0
    ok = sum(r.error is None for r in results)
    deadline = time.monotonic() + 300
    back = threading.Event()
    while time.monotonic() < deadline:
        r = backend.replicas[kill["index"]]
        if r["state"] == "ready" and r["restarts"] >= 1:
            back.set()
            break
        time.sleep(0.1)
    recover_s = time.perf_counter() - kill["at"] if back.is_set() else None
    rerun = backend.rows_rerun - rerun0
    print(f"| Ray, one replica killed at 25% | {killed_s:.1f} | {len(texts) / killed_s:.1f} |")
    print(f"\nRay path overhead: {overhead:+.1%} (target within 15%); identical texts {same}/{len(out['ray'])}; "
          f"replicas started in {start_s:.1f}s")
    print(f"replica killed with {kill['in_flight']} rows in flight: {rerun} rows re-run, {ok}/{len(texts)} ok, "
          f"batch took {killed_s - best['ray']:+.1f}s more than the best Ray run; replica back after "
          f"{recover_s:.1f}s" if recover_s is not None else "replica not back within 300s")
    save_results("ray", dict(rows=len(texts), times=times, best=best, overhead=overhead, same_text=same,
                             start_s=start_s, killed_s=killed_s, rows_rerun=rerun, killed_ok=ok,
                             killed_in_flight=kill["in_flight"], recover_s=recover_s))
    remote.close()
    local.close()
    ray.shutdown()


if __name__ == "__main__":
    main()
