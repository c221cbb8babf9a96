"""Why outputs of ``decoder_killed_mid_stream`` differ from the plain instance: experiments that decide it.

    flock /tmp/lmcache_p2p_vllm.lock .venv/bin/python bench/faults_decide.py              # every variant
    .venv/bin/python bench/faults_decide.py --variants f32 --broken drop                 # one, with a wrong proxy

Per variant of the vLLM flags (every instance and the plain reference get the same ones): ``bf16`` (the
suite's flags before), ``seqs1`` (``--max-num-seqs 1``: nothing is ever batched), ``f32``
(``--dtype float32``, each decoder's buffer doubled so it still holds 8 chunks):

1. the plain reference outputs (one plain vLLM instance, one request at a time);
2. the fault suite's ``decoder_killed_mid_stream`` long form (8 streams of 1200 tokens, decoder-1 killed
   while it streams) on 1P2D through the proxy: per stream, the instance of each decode part and its cut
   points (the proxy's ``/stats`` ``recent_decodes``) and where the output first leaves the reference;
3. on a plain instance again, per stream:
   (a) for a differing stream, the reference's top-5 tokens and logprobs at the first differing position,
       as the reference computed them (its own greedy decode, ``logprobs: 5``) and by a prefill of
       prompt + reference tokens before it; the gap between the reference's token and the one the
       deployment emitted (a numeric flip: the two within bf16 noise of each other);
   (b) each continuation body the proxy sent after a cut (prompt + the output so far, the remaining
       ``max_tokens``) replayed alone: equal to what the client got after the cut or not;
   (c) the 8 streams sent at once to the plain instance: does batching alone change an output?

Writes ``bench/results/faults_decide.json`` (``--out``), one entry per variant.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "faults"), str(ROOT / "tests")]

from fault_client import Kind, Outcome  # noqa: E402
from fault_cluster import SERVED_MODEL_NAME, ClusterSpec, FaultCluster, plain_vllm  # noqa: E402
from fault_scenarios import BY_NAME, Suite, SuiteConfig, Workload, first_difference  # noqa: E402
from fault_suite import SPEC, attach_references, build_workload, row_dict  # noqa: E402

from lmcache_p2p.cli.processes import stop_all, wait_healthy  # noqa: E402

try:
    from bench.meta import collect
except ImportError:  # run as bench/faults_decide.py: its folder is sys.path[0]
    from meta import collect

logger = logging.getLogger("faults_decide")

SCENARIO = "decoder_killed_mid_stream"
TOP = 5
HTTP_TIMEOUT_S = 600.0


def variant_spec(name: str) -> ClusterSpec:
    if name == "bf16":
        return dataclasses.replace(SPEC, vllm_args=_without_dtype(SPEC.vllm_args) + ("--dtype", "bfloat16"),
                                   buffer_size="1MB")
    if name == "seqs1":
        bf16 = variant_spec("bf16")
        return dataclasses.replace(bf16, vllm_args=bf16.vllm_args + ("--max-num-seqs", "1"))
    if name == "f32":
        return dataclasses.replace(SPEC, vllm_args=_without_dtype(SPEC.vllm_args) + ("--dtype", "float32"),
                                   buffer_size="2MB")
    if name == "suite":
        return SPEC
    raise SystemExit(f"unknown variant {name!r}: bf16, seqs1, f32, suite")


def _without_dtype(args: tuple[str, ...]) -> tuple[str, ...]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--dtype":
            skip = True
        else:
            out.append(a)
    return tuple(out)


# ---- the plain instance ------------------------------------------------------------------------

def complete(url: str, prompt: list[int], max_tokens: int, logprobs: int | None = None) -> dict[str, Any]:
    """Greedy, computed from scratch: a fresh ``cache_salt`` keeps vLLM's prefix cache out of it (a decoder
    that takes a moved stream has computed none of it either)."""
    body: dict[str, Any] = {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                            "cache_salt": uuid.uuid4().hex}
    if logprobs:
        body.update(logprobs=logprobs, return_tokens_as_token_ids=True)
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=HTTP_TIMEOUT_S, trust_env=False)
    resp.raise_for_status()
    return resp.json()["choices"][0]


def _top(entry: dict[str, float] | None) -> list[list]:
    """``{"token_id:7": -0.1, ...}`` as ``[[7, -0.1], ...]``, best first."""
    pairs = [[int(k.split(":", 1)[1]), v] for k, v in (entry or {}).items()]
    return sorted(pairs, key=lambda p: -p[1])


def at_divergence(url: str, prompt: list[int], reference: list[int], got: list[int], d: int) -> dict[str, Any]:
    """(a): the reference's top tokens at output position ``d``, where ``got`` leaves ``reference``."""
    decode = complete(url, prompt, d + 1, TOP)  # the reference's own greedy decode, as it made the reference
    decode_ids = list(decode["token_ids"])
    decode_top = _top(decode["logprobs"]["top_logprobs"][d])
    prefill = complete(url, prompt + reference[:d], 1, TOP)  # prompt + tokens before it, one prefill
    prefill_top = _top(prefill["logprobs"]["top_logprobs"][0])

    def gap(top: list[list]) -> float | None:
        lp = dict((t, v) for t, v in top)
        return None if reference[d] not in lp or got[d] not in lp else round(lp[reference[d]] - lp[got[d]], 6)

    return {"position": d, "reference_token": reference[d], "got_token": got[d],
            "reference_again_equal": decode_ids == reference[:d + 1],
            "decode_top": decode_top, "decode_gap": gap(decode_top),
            "prefill_top": prefill_top, "prefill_gap": gap(prefill_top),
            "got_is_second_best": len(decode_top) > 1 and decode_top[1][0] == got[d]}


def replay_continuation(url: str, prompt: list[int], got: list[int], reference: list[int], cut: int,
                        max_tokens: int) -> dict[str, Any]:
    """(b): the continuation body after ``cut`` tokens replayed alone on the plain instance."""
    ids = list(complete(url, prompt + got[:cut], max_tokens - cut)["token_ids"])
    diff = first_difference(ids, got[cut:])
    return {"cut": cut, "equal_to_what_the_client_got": diff is None,
            "first_difference_after_cut": None if diff is None else cut + diff,
            "equal_to_the_reference": ids == reference[cut:] and got[:cut] == reference[:cut]}


def plain_batch(url: str, prompts: list[tuple[list[int], int]]) -> list[list[int]]:
    """(c): every stream at once on the plain instance."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: list(complete(url, p[0], p[1])["token_ids"]), prompts))


@contextlib.contextmanager
def plain_instance(model: Path, log_dir: Path, spec: ClusterSpec) -> Iterator[str]:
    """One plain vLLM (the deployment's flags, no LMCache) on one core; yields its URL."""
    plain = plain_vllm(model, log_dir / "plain", spec, name="plain", cpu_core=1)
    try:
        plain.start()
        wait_healthy([plain], 600)
        yield plain.health_url.removesuffix("/health")
    finally:
        stop_all([plain])


def workload(model: Path, log_dir: Path, cache_dir: Path, spec: ClusterSpec) -> Workload:
    w = build_workload(model, with_model_b=False, models_dir=model.parent)
    attach_references(w, model, log_dir / "reference", cache_dir, spec)
    return w


# ---- one variant -------------------------------------------------------------------------------

def run_variant(name: str, model: Path, log_dir: Path, cache_dir: Path, broken: str | None) -> dict[str, Any]:
    spec = variant_spec(name)
    started = time.time()
    w = workload(model, log_dir, cache_dir, spec)
    cluster = FaultCluster(model, log_dir / "cluster", spec, broken)
    try:
        cluster.start()
        suite = Suite(cluster, w, SuiteConfig(long=True))
        row = suite.run(BY_NAME[SCENARIO])
        outcomes: list[Outcome] = list(suite.last_result.outcomes) if suite.last_result else []
    finally:
        cluster.stop()
    records = {r["prompt"]: r for r in row.streams}

    streams = []
    with plain_instance(model, log_dir, spec) as url:
        for o in outcomes:
            label = w.label(o.prompt)
            prompt, reference, got = list(o.prompt.ids), list(o.prompt.reference["a"]), list(o.ids)
            rec = records.get(label, {})
            entry: dict[str, Any] = {"prompt": label, "outcome": o.kind.value, "parts": rec.get("parts", []),
                                     "cuts": rec.get("cuts", []),
                                     "first_difference": first_difference(got, reference)
                                     if o.kind is Kind.OK else None}
            d = entry["first_difference"]
            if d is not None and d < len(got):
                entry["at_divergence"] = at_divergence(url, prompt, reference, got, d)
            if o.kind is Kind.OK:
                entry["continuations"] = [replay_continuation(url, prompt, got, reference, c, o.prompt.max_tokens)
                                          for c in entry["cuts"]]
            streams.append(entry)
            logger.info("%s: %s", label, json.dumps({k: v for k, v in entry.items() if k != "at_divergence"}))
        batch = plain_batch(url, [(list(p.ids), p.max_tokens) for p in w.stream])
        batch_diff = [first_difference(ids, list(p.reference["a"])) for ids, p in zip(batch, w.stream)]
    return {"variant": name, "vllm_args": list(spec.vllm_args), "buffer_size": spec.buffer_size,
            "broken_continuation": broken, "row": row_dict(row), "streams": streams,
            "plain_batch_first_difference": batch_diff,
            "summary": summarize(streams, batch_diff), "seconds": round(time.time() - started, 1)}


def run_plain_batch(name: str, model: Path, log_dir: Path, cache_dir: Path, rounds: int) -> dict[str, Any]:
    """(c) alone, with no deployment: the 8 streams at once on one plain instance, ``rounds`` times."""
    spec = variant_spec(name)
    started = time.time()
    w = workload(model, log_dir, cache_dir, spec)
    diffs = []
    with plain_instance(model, log_dir, spec) as url:
        for _ in range(rounds):
            batch = plain_batch(url, [(list(p.ids), p.max_tokens) for p in w.stream])
            diffs.append([first_difference(ids, list(p.reference["a"])) for ids, p in zip(batch, w.stream)])
            logger.info("%s: plain batch first differences %s", name, diffs[-1])
    return {"variant": name, "vllm_args": list(spec.vllm_args), "plain_batch_rounds_first_difference": diffs,
            "seconds": round(time.time() - started, 1)}


def run_plain_replays(name: str, model: Path, log_dir: Path, cache_dir: Path, cuts: list[int]) -> dict[str, Any]:
    """(b) with no deployment: every stream cut after each of ``cuts`` reference tokens and continued
    alone on one plain instance (prompt + the reference so far, the remaining max_tokens), as a decoder
    that takes a moved stream computes it; where each continuation leaves the reference."""
    spec = variant_spec(name)
    started = time.time()
    w = workload(model, log_dir, cache_dir, spec)
    rows = []
    with plain_instance(model, log_dir, spec) as url:
        for p in w.stream:
            reference = list(p.reference["a"])
            diffs = {}
            for cut in cuts:
                ids = list(complete(url, list(p.ids) + reference[:cut], p.max_tokens - cut)["token_ids"])
                d = first_difference(ids, reference[cut:])
                diffs[str(cut)] = None if d is None else cut + d
            rows.append({"prompt": w.label(p), "first_difference_by_cut": diffs})
            logger.info("%s %s: %s", name, w.label(p), diffs)
    replays = [d for r in rows for d in r["first_difference_by_cut"].values()]
    return {"variant": name, "vllm_args": list(spec.vllm_args), "cuts": cuts, "streams": rows,
            "summary": {"replays": len(replays), "differing": sum(d is not None for d in replays),
                        "first_differences": sorted(d for d in replays if d is not None)},
            "seconds": round(time.time() - started, 1)}


def summarize(streams: list[dict[str, Any]], batch_diff: list[int | None]) -> dict[str, Any]:
    differing = [s for s in streams if s["first_difference"] is not None]
    moved = [s for s in streams if s["cuts"]]
    gaps = [s["at_divergence"]["decode_gap"] for s in differing if "at_divergence" in s]
    replays = [c for s in streams for c in s.get("continuations", [])]
    return {
        "streams": len(streams), "moved": len(moved), "differing": len(differing),
        "differing_moved": sum(1 for s in differing if s["cuts"]),
        "differing_never_moved": sum(1 for s in differing if not s["cuts"]),
        "first_differences": sorted(s["first_difference"] for s in differing),
        "cuts": sorted(c for s in moved for c in s["cuts"]),
        "divergence_gaps_nats": gaps,
        "divergence_token_second_best": sum(1 for s in differing if s.get("at_divergence", {}).get("got_is_second_best")),
        "continuations_replayed": len(replays),
        "continuations_equal_alone": sum(1 for c in replays if c["equal_to_what_the_client_got"]),
        "plain_batch_differing": sum(1 for d in batch_diff if d is not None),
        "plain_batch_first_differences": sorted(d for d in batch_diff if d is not None),
    }


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="bf16,seqs1,f32", help="comma-separated: bf16, seqs1, f32, suite")
    ap.add_argument("--broken", default=None, choices=("drop", "duplicate"),
                    help="run the proxy with wrong continuations (tests/faults/broken_proxy.py)")
    ap.add_argument("--plain-batch-only", type=int, default=0, metavar="ROUNDS",
                    help="only (c): the streams at once on one plain instance, ROUNDS times (no deployment)")
    ap.add_argument("--plain-replays", default="", metavar="CUTS",
                    help="only (b) with no deployment: each stream continued alone after these reference tokens")
    ap.add_argument("--log-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "faults_decide.json")
    args = ap.parse_args(argv)
    from lmcache_p2p.cli.tiny_model import build_tiny_model

    model = build_tiny_model(ROOT / "models" / "tiny-llama").resolve()
    log_dir = args.log_dir or ROOT / "logs" / time.strftime("faults-decide-%Y%m%d-%H%M%S")
    meta = collect(["bench/faults_decide.py", *(sys.argv[1:] if argv is None else argv)])
    previous = json.loads(args.out.read_text()) if args.out.is_file() else {}
    results = {v["key"]: v for v in previous.get("variants", [])}
    for name in [v for v in args.variants.split(",") if v]:
        variant_spec(name)
        if args.plain_replays:
            result = run_plain_replays(name, model, log_dir / name, ROOT / "models" / ".fault-reference",
                                       [int(c) for c in args.plain_replays.split(",")])
            result["meta"], result["key"] = meta, f"{name}+plain_replays"
            results[result["key"]] = result
        elif args.plain_batch_only:
            result = run_plain_batch(name, model, log_dir / name, ROOT / "models" / ".fault-reference",
                                     args.plain_batch_only)
            result["meta"] = meta
            result["key"] = f"{name}+plain_batch"
            results[result["key"]] = result
        else:
            result = run_variant(name, model, log_dir / name, ROOT / "models" / ".fault-reference", args.broken)
            result["meta"] = meta
            result["key"] = name + (f"+{args.broken}" if args.broken else "")
            results[result["key"]] = result
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"variants": list(results.values())}, indent=1) + "\n")
        print(name, json.dumps(result.get("summary") or result["plain_batch_rounds_first_difference"]))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
