"""Does one plain vLLM-CPU instance give the same greedy output for a request alone and in a batch?

The fault suite's references are a plain instance answering one request at a time; its decoders
batch several long streams. If a plain instance's greedy output for a stream already changes when the
same streams run concurrently, a difference between the suite's outputs and its references says
nothing about the PD layer. This script answers that, with the suite's own workload and flags:

    flock /tmp/lmcache_p2p_vllm.lock .venv/bin/python bench/batch_variance.py

It starts one plain instance (the suite's ``plain_vllm``: the deployment's flags, no LMCache), runs
the 8 stream prompts (1200 output tokens each) one at a time, then all 8 at once, twice; then the
suite's deployment (1P2D through the proxy) with no fault, the same streams all at once and then one
at a time. It prints per prompt where each run's output first leaves the plain sequential one.
Writes bench/results/batch_variance.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "faults")]

import asyncio  # noqa: E402

from fault_client import Prompt, run_concurrent  # noqa: E402
from fault_cluster import FaultCluster, complete_ids, plain_vllm  # noqa: E402
from fault_suite import SPEC, build_workload  # noqa: E402

from lmcache_p2p.cli.processes import stop_all, wait_healthy  # noqa: E402
from lmcache_p2p.cli.tiny_model import build_tiny_model  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
from meta import collect  # noqa: E402


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first token position where ``a`` and ``b`` differ (None when equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log-dir", type=Path, default=REPO / "logs" / "batch_variance")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "batch_variance.json")
    ap.add_argument("--rounds", type=int, default=2, help="concurrent rounds after the sequential one")
    args = ap.parse_args()

    model = build_tiny_model(REPO / "models" / "tiny-llama", seed=0)
    w = build_workload(model, with_model_b=False, models_dir=REPO / "models")
    prompts = [(list(p.ids), p.max_tokens) for p in w.stream]
    child = plain_vllm(model, args.log_dir, SPEC, name="plain", cpu_core=None)
    try:
        child.start()
        wait_healthy([child], 600)
        url = child.health_url.removesuffix("/health")
        t0 = time.monotonic()
        sequential = [complete_ids(url, ids, n) for ids, n in prompts]
        seq_s = time.monotonic() - t0
        rounds = []
        for _ in range(args.rounds):
            with ThreadPoolExecutor(len(prompts)) as pool:
                rounds.append(list(pool.map(lambda p: complete_ids(url, *p), prompts)))
        again = [complete_ids(url, ids, n) for ids, n in prompts]
    finally:
        stop_all([child])

    pd_concurrent, pd_sequential = through_pd(model, args.log_dir / "pd", prompts)

    rows = []
    for i, (ids, n) in enumerate(prompts):
        rows.append({
            "prompt": i, "prompt_tokens": len(ids), "output_tokens": n,
            "plain_sequential_again": first_difference(sequential[i], again[i]),
            "plain_concurrent": [first_difference(sequential[i], r[i]) for r in rounds],
            "pd_concurrent": first_difference(sequential[i], pd_concurrent[i]),
            "pd_sequential": first_difference(sequential[i], pd_sequential[i]),
        })
    print("first token where each run leaves the plain instance's sequential output (None: equal)")
    print(f"{'prompt':>6} {'tokens':>6} {'plain again':>11} {'plain concurrent':>17} {'PD concurrent':>14} "
          f"{'PD sequential':>14}")
    for r in rows:
        print(f"{r['prompt']:>6} {r['prompt_tokens']:>6} {str(r['plain_sequential_again']):>11} "
              f"{str(r['plain_concurrent']):>17} {str(r['pd_concurrent']):>14} {str(r['pd_sequential']):>14}")
    summary = {key: sum(1 for r in rows if (any(d is not None for d in r[key]) if key == "plain_concurrent"
                                            else r[key] is not None))
               for key in ("plain_sequential_again", "plain_concurrent", "pd_concurrent", "pd_sequential")}
    print(f"prompts differing of {len(rows)}: {summary}; plain sequential took {seq_s:.0f} s")
    result = {"meta": collect(sys.argv), "flags": SPEC.vllm_args, "rows": rows, "prompts_differing": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


def through_pd(model: Path, log_dir: Path, prompts: list[tuple[list[int], int]]) -> tuple[list, list]:
    """The suite's deployment, no fault: the streams all at once, then one at a time (ids per prompt)."""
    cluster = FaultCluster(model, log_dir, SPEC)
    cluster.start()
    try:
        work = [Prompt(tuple(ids), n) for ids, n in prompts]
        by_prompt = {o.prompt.ids: list(o.ids) for o in asyncio.run(run_concurrent(cluster.url, work, len(work), 900))}
        concurrent = [by_prompt[p.ids] for p in work]
        sequential = []
        for p in work:
            sequential.append(list(asyncio.run(run_concurrent(cluster.url, [p], 1, 300))[0].ids))
        return concurrent, sequential
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
