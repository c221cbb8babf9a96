"""Routers in front of two KV backends on vLLM-CPU: {our proxy, vllm-router} x {lmcache_p2p, vLLM's NixlConnector}.

One run, three phases one after the other (each stops its servers before the next starts; two vLLM servers
at most run at once):

1. reference: one plain vLLM instance (no KV transfer) answers every prompt, then stops;
2. backend ``lmcache_p2p``: one 1P1D deployment of ``lmcache-p2p launch`` (its instances also set
   ``p2p.router_control_port_offset``) serves through two fronts at once: our proxy, and vllm-router 0.1.17
   (``--vllm-pd-disaggregation``) started beside it over the same prefiller and decoder;
3. backend ``vllm-nixl``: a prefiller and a decoder that are plain vLLM servers running vLLM's NixlConnector
   (bench/anchor_nixl.py's ``vllm-nixl-placed`` recipe: the ports, cores, CPU sets, environment and vLLM flags
   the launcher gave ours in (2), without our vLLM plugin and so without its cap on idle workers' spinning),
   fronted at once by our proxy (``lmcache-p2p proxy --nixl-prefill URL --nixl-decode URL``, the launcher's
   proxy flags otherwise) and by vllm-router started as in (2).

The same seeded token-id prompts go through each front in turn (at each concurrency level: our proxy, then
vllm-router) with bench/e2e.py's streaming client; each request has ``--request-timeout-s`` for its whole
answer and counts as failed after it (its work may go on in the servers and show in the next row's counters).
Each front sees the prompts again after the first: with vLLM's prefix caching on (the default, as ``launch``
runs ours) later runs find prompt blocks in the servers' own prefix caches (``decoder_prefix_cache_hit_ratio``;
``prefill_ms_mean`` drops), so only each backend's first run moves every prompt's KV;
``--no-prefix-caching`` turns it off on every server, ours (and our decoders' buffer cache) and NixlConnector's.
Per (router, backend, concurrency) row:

- ``ttft_ms_p50/p99``: client side, request sent -> first streamed token id;
- ``handover_ms_mean``: client TTFT mean minus the prefiller's own mean request time (vLLM's
  ``e2e_request_latency`` histogram on the prefiller over the run): what the client waits beyond the prefill.
  Behind our proxy the first token is the prefiller's (with NixlConnector: for greedy requests, as here), so
  this is the proxy's own overhead there; ``handover_ms_p50/p99`` (our proxy only) are its ``/stats``: prefill
  answered -> decoder's first token (with NixlConnector the decoder's pull included);
- ``failed``, ``first_error``, ``outputs_equal`` (greedy token ids equal to the plain instance's for every prompt);
- the decoder's KV use, by backend:

  ``lmcache_p2p``, from the decoder's LMCache lookup log lines: ``kv_hit_ratio`` = prompt tokens its final
  lookup hit / prompt tokens it looked up for (behind our proxy the decoder's prompt is prompt + first token
  and its last token is never looked up); ``kv_full_hits`` (lookups that hit the whole prompt) of
  ``kv_lookups``; ``decoder_waits`` (requests looked up more than once: the decoder waited for KV still
  arriving, see vllm_plugin/foreign_router.py); ``kv_failed_transfers`` None (a failed push shows as a miss).

  ``vllm-nixl``, from the decoder's ``/metrics`` before and after (vLLM's own counters): ``kv_hit_ratio`` =
  ``vllm:external_prefix_cache_hits`` / ``vllm:external_prefix_cache_queries``: prompt tokens NixlConnector
  pulled from the prefiller / prompt tokens the decoder did not hold in its own prefix cache. vLLM counts a hit
  when the pull is planned (at admission); a pull that then fails fails its request (vLLM's default
  ``kv_load_failure_policy: fail``) and is counted in ``kv_failed_transfers``
  (``vllm:nixl_num_failed_transfers``; None where the decoder exposes no such counter). ``kv_lookups`` =
  requests the decoder finished; per-request counts are not exposed, so ``kv_full_hits`` is all of them when
  every asked-for token was pulled and None otherwise; ``decoder_waits`` None (no such step).
- ``decoder_prefix_cache_hit_ratio``: ``vllm:prefix_cache_hits`` / ``_queries`` on the decoder (both backends).

    flock /tmp/lmcache_p2p_vllm.lock .venv/bin/python bench/routers.py      # 32 requests, concurrency 1 and 4

Writes ``bench/results/routers_cpu.json`` (``{"meta", "config", "rows"}``, rows by concurrency, backend,
router) and prints the rows. Exit status 1 when a request failed or an output differed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bench import anchor_nixl as nixl  # noqa: E402
from bench.e2e import (  # noqa: E402
    RequestResult, _ms, make_prompts, percentile, prompt_vocab, request_body, resolve_model, run_load)
from bench.meta import collect  # noqa: E402
from cluster import LOOKUP_RE, Cluster, free_port, plain_vllm_child, wait_registered  # noqa: E402
from lmcache_p2p.cli import connectors, launch, routers  # noqa: E402
from lmcache_p2p.cli.layout import Instance  # noqa: E402
from lmcache_p2p.cli.processes import Child, stop_all, wait_healthy  # noqa: E402

logger = logging.getLogger("bench.routers")

REPO = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 600.0
REGISTER_TIMEOUT_S = 120.0
HTTP_TIMEOUT_S = 10.0
WARMUP_REQUESTS = 4
LMCACHE_P2P, VLLM_NIXL = "lmcache_p2p", "vllm-nixl"
OURS, VLLM_ROUTER = routers.Router.LMCACHE_P2P.value, routers.Router.VLLM_ROUTER.value
ORDER = {LMCACHE_P2P: 0, VLLM_NIXL: 1, OURS: 0, VLLM_ROUTER: 1}
E2E_SUM, E2E_COUNT = "vllm:e2e_request_latency_seconds_sum", "vllm:e2e_request_latency_seconds_count"
PREFIX_HITS, PREFIX_QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
FAILED_TRANSFERS = "vllm:nixl_num_failed_transfers_total"


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
    kv_full_hits: int | None
    kv_lookups: int | None
    decoder_waits: int | None
    kv_failed_transfers: int | None
    decoder_prefix_cache_hit_ratio: float | None
    first_error: str | None


@dataclasses.dataclass(frozen=True)
class KvFigures:
    """The decoder's KV use over one run (see the module docstring, per backend)."""

    hit_ratio: float | None
    full_hits: int | None
    lookups: int | None
    decoder_waits: int | None = None
    failed_transfers: int | None = None


@dataclasses.dataclass(frozen=True)
class Pair:
    """One running 1P1D and the fronts over it; ``decoder_log``: where an lmcache_p2p decoder logs its lookups."""

    backend: str
    fronts: dict[str, str]  # router -> URL
    prefiller_url: str
    decoder_url: str
    decoder_log: Path | None


# ---- figures (pure; tested in tests/bench/test_routers_bench.py) --------------------------------


def lookup_figures(text: str) -> KvFigures:
    """An lmcache_p2p decoder's LMCache lookups in its log ``text``: per request its last one counts."""
    last: dict[str, tuple[int, int]] = {}
    counts: dict[str, int] = {}
    for req, total, hit in LOOKUP_RE.findall(text):
        last[req] = (int(total), int(hit))
        counts[req] = counts.get(req, 0) + 1
    # vllm-router's ids name the decoder; behind our proxy the last token (the first output) is never looked up
    wanted = {r: (total if "___decode_addr_" in r else total - 1, hit) for r, (total, hit) in last.items()}
    want = sum(w for w, _ in wanted.values())
    return KvFigures(hit_ratio=round(sum(min(h, w) for w, h in wanted.values()) / want, 4) if want else None,
                     full_hits=sum(1 for w, h in wanted.values() if h >= w), lookups=len(wanted),
                     decoder_waits=sum(1 for n in counts.values() if n > 1))


def nixl_figures(before: Mapping[str, float], after: Mapping[str, float]) -> KvFigures:
    """A NixlConnector decoder's pulls from its ``/metrics`` sums (``anchor_nixl.metric_sums``) around a run."""
    use = nixl.kv_use(before, after)
    failed = round(after[FAILED_TRANSFERS] - before.get(FAILED_TRANSFERS, 0.0)) if FAILED_TRANSFERS in after else None
    return KvFigures(hit_ratio=use.hit_ratio, full_hits=use.full_hits, lookups=use.requests, failed_transfers=failed)


def delta_ratio(before: Mapping[str, float], after: Mapping[str, float], num: str, den: str) -> float | None:
    """Growth of counter ``num`` / growth of counter ``den`` (None when ``den`` did not grow)."""
    grew = after.get(den, 0.0) - before.get(den, 0.0)
    return round((after.get(num, 0.0) - before.get(num, 0.0)) / grew, 4) if grew > 0 else None


def build_row(router: str, backend: str, concurrency: int, results: Sequence[RequestResult],
              reference: Sequence[tuple[int, ...]], prefill_mean_s: float | None, stats: Mapping[str, Any] | None,
              kv: KvFigures, decoder_prefix_hit_ratio: float | None) -> Row:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    mismatched = sum(1 for r in ok if r.output_ids != reference[r.index])
    ttft_mean = sum(ttfts) / len(ttfts) if ttfts else None
    handover = (stats or {}).get("handover_ms") or {}
    return Row(
        router=router, backend=backend, concurrency=concurrency, requests=len(results), failed=len(results) - len(ok),
        ttft_ms_p50=_ms(percentile(ttfts, 50)), ttft_ms_p99=_ms(percentile(ttfts, 99)), ttft_ms_mean=_ms(ttft_mean),
        handover_ms_mean=(_ms(ttft_mean - prefill_mean_s) if ttft_mean is not None and prefill_mean_s is not None
                          else None),
        handover_ms_p50=handover.get("p50"), handover_ms_p99=handover.get("p99"), prefill_ms_mean=_ms(prefill_mean_s),
        outputs_equal=mismatched == 0 and len(ok) == len(results), outputs_mismatched=mismatched,
        kv_hit_ratio=kv.hit_ratio, kv_full_hits=kv.full_hits, kv_lookups=kv.lookups, decoder_waits=kv.decoder_waits,
        kv_failed_transfers=kv.failed_transfers, decoder_prefix_cache_hit_ratio=decoder_prefix_hit_ratio,
        first_error=next((r.error for r in results if not r.ok), None))


def row_order(row: Row) -> tuple[int, int, int]:
    """The two-by-two of each concurrency level together: ours then NixlConnector, our proxy then vllm-router."""
    return row.concurrency, ORDER[row.backend], ORDER[row.router]


# ---- the processes ------------------------------------------------------------------------------


def front_args(args: argparse.Namespace) -> argparse.Namespace:
    """The launch plan's arguments with ports of its own for one more front."""
    out = argparse.Namespace(**vars(args))
    out.proxy_port, out.proxy_control_port = free_port(), free_port()
    return out


def router_child(args: argparse.Namespace, instances: list[Instance], log_dir: Path) -> Child:
    """vllm-router over ``instances``, as ``launch --router vllm-router`` starts it."""
    a = front_args(args)
    return Child("vllm-router", routers.vllm_router_command(a, instances, "127.0.0.1"), dict(os.environ),
                 log_dir / "vllm-router.log", f"http://127.0.0.1:{a.proxy_port}/health")


def nixl_proxy_child(args: argparse.Namespace, instances: list[Instance], log_dir: Path) -> Child:
    """Our proxy as the launcher starts it, with ``instances`` registered by URL as NixlConnector ones."""
    a = front_args(args)
    a.proxy_arg = [*args.proxy_arg, *connectors.proxy_flags(instances)]
    return launch.proxy_child(a, log_dir)


def nixl_instance(inst: Instance, model: Path, args: argparse.Namespace, log_dir: Path) -> Child:
    """A NixlConnector server in ``inst``'s place: its port, the launcher's cores and vLLM flags for it."""
    flags = [*launch.tp_flags(inst.tp_size), *args.vllm_arg]
    spec = nixl.instance_launch(nixl.Variant.PLACED, inst.role, model, flags, args.max_model_len, log_dir,
                                port=inst.http_port, side_channel_port=free_port(), served_model_name=str(model),
                                cache_flags=launch.cache_flags(args.prefix_caching))
    return Child(inst.name, spec.argv, spec.env, log_dir / f"{inst.name}.log",
                 f"http://{inst.host}:{inst.http_port}/health", cpus=spec.cpus)


def url_of(child: Child) -> str:
    return child.health_url.removesuffix("/health")


@contextlib.contextmanager
def lmcache_pair(cluster: Cluster, log_dir: Path) -> Iterator[Pair]:
    router = router_child(cluster.args, cluster.instances, log_dir)
    try:
        cluster.start(STARTUP_TIMEOUT_S)
        router.start()
        wait_healthy([router], STARTUP_TIMEOUT_S)
        yield Pair(LMCACHE_P2P, {OURS: cluster.url, VLLM_ROUTER: url_of(router)}, cluster.url_of("prefiller-0"),
                   cluster.url_of("decoder-0"), cluster.children["decoder-0"].log_path)
    finally:
        router.stop()
        cluster.stop()


@contextlib.contextmanager
def nixl_pair(model: Path, args: argparse.Namespace, instances: list[Instance], log_dir: Path) -> Iterator[Pair]:
    servers = {inst.role: nixl_instance(inst, model, args, log_dir) for inst in instances}
    fronts = {OURS: nixl_proxy_child(args, instances, log_dir), VLLM_ROUTER: router_child(args, instances, log_dir)}
    children = [*fronts.values(), *servers.values()]
    try:
        for child in servers.values():
            child.start()
        wait_healthy(list(servers.values()), STARTUP_TIMEOUT_S)
        for child in fronts.values():
            child.start()
        wait_healthy(list(fronts.values()), STARTUP_TIMEOUT_S)
        wait_registered(url_of(fronts[OURS]), 1, 1, REGISTER_TIMEOUT_S, fronts[OURS].log_path)
        yield Pair(VLLM_NIXL, {name: url_of(c) for name, c in fronts.items()}, url_of(servers["prefiller"]),
                   url_of(servers["decoder"]), None)
    finally:
        stop_all(children)


# ---- measuring ----------------------------------------------------------------------------------


def metrics(url: str) -> dict[str, float]:
    resp = httpx.get(f"{url}/metrics", timeout=HTTP_TIMEOUT_S, trust_env=False)
    resp.raise_for_status()
    return nixl.metric_sums(resp.text)


def mean_seconds(before: Mapping[str, float], after: Mapping[str, float]) -> float | None:
    """Mean of the vLLM e2e request latency histogram's samples added between the two readings."""
    count = after.get(E2E_COUNT, 0.0) - before.get(E2E_COUNT, 0.0)
    return (after.get(E2E_SUM, 0.0) - before.get(E2E_SUM, 0.0)) / count if count > 0 else None


def log_since(path: Path, offset: int) -> str:
    with path.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def measure(router: str, pair: Pair, bodies: list[dict[str, Any]], concurrency: int,
            reference: list[tuple[int, ...]], timeout_s: float) -> Row:
    url = pair.fronts[router]
    offset = pair.decoder_log.stat().st_size if pair.decoder_log is not None else 0
    pre, dec = metrics(pair.prefiller_url), metrics(pair.decoder_url)
    if router == OURS:
        httpx.post(f"{url}/stats/reset", timeout=HTTP_TIMEOUT_S, trust_env=False).raise_for_status()
    results, _ = asyncio.run(run_load(url, bodies, concurrency, timeout_s))
    stats = httpx.get(f"{url}/stats", timeout=HTTP_TIMEOUT_S, trust_env=False).json() if router == OURS else None
    pre2, dec2 = metrics(pair.prefiller_url), metrics(pair.decoder_url)
    kv = (lookup_figures(log_since(pair.decoder_log, offset)) if pair.decoder_log is not None
          else nixl_figures(dec, dec2))
    return build_row(router, pair.backend, concurrency, results, reference, mean_seconds(pre, pre2), stats, kv,
                     delta_ratio(dec, dec2, PREFIX_HITS, PREFIX_QUERIES))


def measure_pair(pair: Pair, cfg: argparse.Namespace, bodies: list[dict[str, Any]], warm: list[dict[str, Any]],
                 reference: list[tuple[int, ...]]) -> list[Row]:
    for router, url in pair.fronts.items():
        results, _ = asyncio.run(run_load(url, warm, 2, cfg.request_timeout_s))
        failed = [r.error for r in results if not r.ok]
        if failed:
            logger.warning("%s over %s: %d of %d warm-up requests failed; first: %s", router, pair.backend,
                           len(failed), len(results), failed[0])
    rows = []
    for concurrency in cfg.concurrency:
        for router in pair.fronts:
            logger.info("%s over %s: %d requests, concurrency %d", router, pair.backend, len(bodies), concurrency)
            rows.append(measure(router, pair, bodies, concurrency, reference, cfg.request_timeout_s))
            logger.info("%s", rows[-1])
    return rows


def reference_outputs(model: Path, bodies: list[dict[str, Any]], log_dir: Path, timeout_s: float,
                      prefix_caching: bool) -> list[tuple[int, ...]]:
    child = plain_vllm_child(model, log_dir / "direct", port=free_port(), cpu_core=0, prefix_caching=prefix_caching)
    try:
        child.start()
        wait_healthy([child], STARTUP_TIMEOUT_S)
        results, _ = asyncio.run(run_load(url_of(child), bodies, 1, timeout_s))
    finally:
        child.stop()
    if not all(r.ok for r in results):
        raise SystemExit(f"the plain instance failed: {[r.error for r in results if not r.ok][:3]}")
    return [r.output_ids for r in results]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", default="1,4", type=lambda s: [int(c) for c in s.split(",") if c])
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--min-input", type=int, default=200)
    p.add_argument("--max-input", type=int, default=1500)
    p.add_argument("--request-timeout-s", type=float, default=60.0,
                   help="a request's whole answer must arrive within this, else it counts as failed (default 60)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="vLLM's prefix caching off on every server (launch --no-prefix-caching: our decoders' "
                        "buffer cache too), so that no front finds the prompts an earlier run left cached")
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", type=Path, default=REPO / "logs" / "bench-routers")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "routers_cpu.json")
    return p.parse_args(argv)


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
    reference = reference_outputs(model, bodies, cfg.log_dir, cfg.request_timeout_s, cfg.prefix_caching)
    # Both fronts over one deployment: the decoder's control port is its HTTP port + 20 in Cluster's layout.
    cluster = Cluster(model, cfg.log_dir / "pd", prefix_caching=cfg.prefix_caching,
                      p2p=("router_control_port_offset=20",))
    with lmcache_pair(cluster, cfg.log_dir / "pd") as pair:
        rows = measure_pair(pair, cfg, bodies, warm, reference)
    with nixl_pair(model, cluster.args, cluster.instances, cfg.log_dir / "nixl") as pair:
        rows += measure_pair(pair, cfg, bodies, warm, reference)
    rows.sort(key=row_order)
    for row in rows:
        print(json.dumps(dataclasses.asdict(row)))
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(cfg).items() if k not in ("log_dir", "out")}
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps({"meta": meta, "config": config, "rows": [dataclasses.asdict(r) for r in rows]},
                                  indent=2) + "\n")
    print(f"wrote {cfg.out}")
    return 0 if all(r.failed == 0 and r.outputs_equal for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
