"""Engine level: what a different TP split costs against an equal one, over NIXL and Gloo.

Real LMCache engines as TP ranks (tests/backend/engine_proc.py, ``P2P_ENGINE_TP``), a
``--shape`` model (default ``medium``: 8 layers, 8 KV heads x 128, bf16; one 256-token chunk is
8 MiB): prefillers of TP 1 and 2 and decoders of TP 1 and 2, all on this machine. Per request
every prefiller rank stores the same ``--tokens`` prompt (its own heads) at once; times on one
clock (CLOCK_MONOTONIC, shared by the processes):

  ready_ms     first store call began -> the whole prompt is a hit on every decoder rank (the KV
               handover as the proxy sees it: stored, sent, split or merged, ready everywhere)
  ready_per_chunk_ms   ready_ms / chunks of the prompt
  retrieve_ms  the slowest decoder rank's LMCache retrieve of the prompt (its synchronous load)

Each row is one (transport, prefiller TP, decoder TP) over ``--requests`` requests (p50 / p99),
with the bytes every sender rank moved per request (``bytes_moved``: the decoder's KV, once),
``equal`` (every decoder rank loaded exactly its heads' slice for every chunk) and ``failed``.
``vs_equal`` compares ready_ms p50 with the equal split that feeds the same decoder (P TP2 ->
D TP1 against P TP1 -> D TP1; P TP1 -> D TP2 against P TP2 -> D TP2).

    flock /tmp/lmcache_p2p_vllm.lock .venv/bin/python bench/tp_engine.py [--transports nixl nccl]

Writes ``bench/results/tp_engine.json``: ``{"meta", "rows"}``; prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "backend"), str(ROOT / "tests")]

from tp_engines import start_instances  # noqa: E402

try:
    from bench.meta import collect
except ImportError:  # run as bench/tp_engine.py: its folder is sys.path[0]
    from meta import collect

SHAPES = {"tiny": (2, 2, 32), "medium": (8, 8, 128)}  # as engine_proc.py: layers, KV heads, head size
PAIRS = [(1, 1), (2, 1), (2, 2), (1, 2)]
CHUNK_TOKENS = 256


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def one_request(prefiller, decoder, seed: int, tokens: int) -> dict:
    """Store on every prefiller rank at once; wait until every decoder rank holds the prompt; load."""
    before = [e.call(op="slots")["bytes_sent"] for e in prefiller.ranks]
    replies: list[dict] = [{}] * prefiller.tp

    def store(rank: int) -> None:
        replies[rank] = prefiller.ranks[rank].call(op="store", seed=seed, num_tokens=tokens, end=tokens, skip=0,
                                                   req_id=f"bench-{seed}", last=True, ports=decoder.ports, stamp=True)

    threads = [threading.Thread(target=store, args=(r,)) for r in range(prefiller.tp)]
    for t in threads:
        t.start()
    ready = [e.call(op="wait_ready", seed=seed, num_tokens=tokens, timeout_s=60, stamp=True) for e in decoder.ranks]
    for t in threads:
        t.join()
    loads = [e.call(op="load", seed=seed, num_tokens=tokens, req_id=f"bench-{seed}", stamp=True) for e in decoder.ranks]
    deadline = time.monotonic() + 30
    while True:  # the senders' byte counts settle once their last writes were seen complete
        sent = [e.call(op="slots") for e in prefiller.ranks]
        if all(s["pending"] == 0 for s in sent) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    hit = all(r["hit_tokens"] == tokens for r in ready)
    return {
        "ready_s": max(r["at"] for r in ready) - min(r["started"] for r in replies) if hit else None,
        "retrieve_s": max(ld["retrieve_s"] for ld in loads),
        "equal": all(ld["equal"] and ld["retrieved"] == tokens for ld in loads),
        "bytes_moved": sum(s["bytes_sent"] - b for s, b in zip(sent, before)),
        "failed": sum(s["failed"] for s in sent),
    }


def measure(transport: str, shape: str, tokens: int, requests: int, tmp: Path) -> list[dict]:
    layers, heads, head_size = SHAPES[shape]
    env = {"P2P_ENGINE_SHAPE": shape}
    specs = [dict(name=f"p{tp}", role="sender", tp=tp, heads=heads, env=env, lmcache={"max_local_cpu_size": 0.5})
             for tp in (1, 2)]
    specs += [dict(name=f"d{tp}", role="receiver", tp=tp, heads=heads, env=env, buffer="512MB") for tp in (1, 2)]
    engines = start_instances(tmp / transport, specs, transport=transport)
    rows = []
    try:
        seed = 1000
        for p_tp, d_tp in PAIRS:
            prefiller, decoder = engines[f"p{p_tp}"], engines[f"d{d_tp}"]
            one_request(prefiller, decoder, seed, tokens)  # warm-up: pairing, first registrations
            seed += 1
            runs = []
            for _ in range(requests):
                runs.append(one_request(prefiller, decoder, seed, tokens))
                seed += 1
            ready = [r["ready_s"] * 1e3 for r in runs if r["ready_s"] is not None]
            chunks = -(-tokens // CHUNK_TOKENS)
            retrieve = [r["retrieve_s"] * 1e3 for r in runs]
            rows.append({
                "transport": transport, "p_tp": p_tp, "d_tp": d_tp, "shape": shape, "tokens": tokens,
                "requests": requests, "ready_ms_p50": statistics.median(ready) if ready else None,
                "ready_ms_p99": pct(ready, 0.99) if ready else None,
                "ready_per_chunk_ms_p50": statistics.median(ready) / chunks if ready else None,
                "retrieve_ms_p50": statistics.median(retrieve), "retrieve_ms_p99": pct(retrieve, 0.99),
                "bytes_moved": runs[0]["bytes_moved"],
                "model_kv_bytes": 2 * layers * tokens * heads * head_size * 2,
                "equal": all(r["equal"] for r in runs), "failed": sum(r["failed"] for r in runs)
                + sum(r["ready_s"] is None for r in runs),
            })
    finally:
        for inst in engines.values():
            inst.close()
    by = {(r["p_tp"], r["d_tp"]): r for r in rows}
    for r in rows:
        base = by.get((r["d_tp"], r["d_tp"]))
        if r["p_tp"] != r["d_tp"] and base and base["ready_ms_p50"] and r["ready_ms_p50"]:
            r["vs_equal"] = round(r["ready_ms_p50"] / base["ready_ms_p50"], 3)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transports", nargs="+", default=["nixl", "nccl"])
    parser.add_argument("--shape", default="medium", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "tp_engine.json"))
    args = parser.parse_args()
    meta = collect()
    rows = []
    with tempfile.TemporaryDirectory(prefix="tp-engine-") as tmp:
        for transport in args.transports:
            rows += measure(transport, args.shape, args.tokens, args.requests, Path(tmp))
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"{'transport':9} {'P->D':6} {'ready p50/p99 ms':>17} {'per chunk':>9} {'retrieve p50':>12} "
          f"{'bytes moved':>12} {'model KV':>10} {'vs equal':>8} equal failed")
    for r in rows:
        print(f"{r['transport']:9} {r['p_tp']}->{r['d_tp']:<3} {r['ready_ms_p50'] or 0:8.1f}/{r['ready_ms_p99'] or 0:<8.1f} "
              f"{r['ready_per_chunk_ms_p50'] or 0:9.2f} {r['retrieve_ms_p50']:12.1f} {r['bytes_moved']:12d} "
              f"{r['model_kv_bytes']:10d} {r.get('vs_equal', ''):>8} {r['equal']} {r['failed']}")
    return 0 if all(r["equal"] and not r["failed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
