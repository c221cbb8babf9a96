"""Re-reads the long-prompt passes' rows and engine traces into summary.json and the README's tables.

    python3 bench/long_prompts_summary.py RUN_DIR...   (each: e2e_gpu.json and x/<system>/trace/)

Per row: the client's TTFT p50/p99, vLLM's own prefill time (mean, exact), the proxy's phases, and from the
prefiller's trace per request (bench/e2e_gpu.py request_timelines): engine time, LMCache stores and their
gathers, the sender's sync and submit, the GPU idle time between the request's steps. Requests are matched
to rows by prompt length and path (ids with "cmpl-bench-" came straight from the bench: --direct-prefiller).
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("e2e_gpu", REPO / "bench" / "e2e_gpu.py")
e2e_gpu = importlib.util.module_from_spec(spec)
sys.modules["e2e_gpu"] = e2e_gpu
spec.loader.exec_module(e2e_gpu)


def bucket(tokens: int) -> int:
    return min((8000, 16000, 32000, 64000), key=lambda b: abs(b - tokens))


def per_request_stores(events: list[dict]) -> dict[str, dict]:
    """Store-level view by request id (works without the runner's exec events): stores, their ms and gathers."""
    gathers = [e for e in events if e.get("ev") == "gather"]
    syncs = [e for e in events if e.get("ev") == "sync"]
    out: dict[str, dict] = {}
    for s in (e for e in events if e.get("ev") == "store"):
        r = out.setdefault(s["req"], {"tokens": 0, "stores": 0, "store_ms": 0.0, "gather_ms": 0.0, "sync_ms": 0.0})
        r["tokens"] = max(r["tokens"], s.get("tokens") or 0)
        r["stores"] += 1
        r["store_ms"] += (s["t1"] - s["t0"]) * 1e3
        r["gather_ms"] += sum((g["t1"] - g["t0"]) * 1e3 for g in gathers if s["t0"] <= g["t0"] <= s["t1"])
        r["sync_ms"] += sum((g["t1"] - g["t0"]) * 1e3 for g in syncs if s["t0"] <= g["t0"] <= s["t1"])
    return out


def mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 2) if values else None


def summarise_run(run: Path) -> list[dict]:
    result = json.loads((run / "e2e_gpu.json").read_text())
    traces = {}
    for system in ("single", "lmcache_p2p-nixl"):
        traces[system] = e2e_gpu.read_traces(run / "x" / system / "trace")
        if not traces[system]:  # no exec events (the first pass): keep the store-level view
            traces[system] = {}
            for path in sorted((run / "x" / system / "trace").glob("trace-*.jsonl")):
                events = [json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}")]
                argv = next((e.get("argv") or [] for e in events if e.get("ev") == "proc"), [])
                port = next((int(argv[i + 1]) for i, a in enumerate(argv[:-1]) if a == "--port"), None)
                traces[system][port] = events
    rows = []
    for row in result["rows"]:
        system = row["system"]
        port = 8300 if system == "single" else 7100
        events = traces.get(system, {}).get(port, [])
        for path in ("proxy", "direct") if system != "single" else ("single",):
            if path == "direct" and not row.get("direct_prefiller"):
                continue
            src = row if path != "direct" else row["direct_prefiller"]
            metrics = (src.get("vllm_metrics") or {})
            metrics = metrics.get("prefiller") or metrics.get("single") or metrics
            keep = lambda req: bucket_of.get(req) == row["input_len"] and (("cmpl-bench-" in req) == (path == "direct")
                                                                           or system == "single")
            stores = per_request_stores(events)
            bucket_of = {req: bucket(v["tokens"]) for req, v in stores.items()}
            timelines = [t for t in e2e_gpu.request_timelines(events, 0.0, float("inf"))
                         if bucket(t["tokens"]) == row["input_len"]
                         and (("cmpl-bench-" in t["req"]) == (path == "direct") or system == "single")]
            mine = {req: v for req, v in stores.items() if keep(req)}
            tl = (row.get("proxy_stats") or {}).get("timeline_ms") or {}
            out = {"system": system, "path": path, "point": row["point"], "input_len": row["input_len"],
                   "requests": src.get("completed"), "failed": src.get("failed"),
                   "ttft_ms_p50": src.get("ttft_ms_p50"), "ttft_ms_p99": src.get("ttft_ms_p99"),
                   "vllm_prefill_ms_mean": (metrics.get("request_prefill_time_seconds") or {}).get("mean_ms"),
                   "vllm_ttft_ms_mean": (metrics.get("time_to_first_token_seconds") or {}).get("mean_ms"),
                   "stores_per_request": mean([v["stores"] for v in mine.values()]),
                   "store_ms_per_request": mean([v["store_ms"] for v in mine.values()]),
                   "gather_ms_per_request": mean([v["gather_ms"] for v in mine.values()]),
                   "gather_ms_per_store": mean([v["gather_ms"] / v["stores"] for v in mine.values() if v["stores"]]),
                   "sync_ms_per_request": mean([v["sync_ms"] for v in mine.values()])}
            if timelines:
                out.update(engine_ms_mean=mean([t["engine_ms"] for t in timelines]),
                           gpu_idle_between_steps_ms=mean([t["gpu_gap_ms"] for t in timelines]),
                           submit_ms_per_request=mean([t["submit_ms"] for t in timelines]),
                           host_chunks_per_request=mean([t["host_chunks"] for t in timelines]),
                           traced_requests=len(timelines))
            if path == "proxy":
                out.update({f"proxy_{k}_ms_p50": (tl.get(k) or {}).get("p50") for k in
                            ("queue", "prefill", "first_byte", "decode_start")},
                           proxy_queue_ms_p99=(tl.get("queue") or {}).get("p99"),
                           handover_ms_p50=row.get("handover_ms_p50"), handover_ms_p99=row.get("handover_ms_p99"),
                           kv_bytes_per_request=row.get("kv_bytes_per_request"), kv_hit_ratio=row.get("kv_hit_ratio"),
                           kv_full_hits=row.get("kv_full_hits"), kv_transfer_ms_p50=row.get("kv_transfer_ms_p50"))
            rows.append(out)
    return rows


def main(argv: list[str]) -> None:
    runs = {}
    for arg in argv:
        label, _, path = arg.partition("=")
        runs[label] = summarise_run(Path(path))
    print(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
