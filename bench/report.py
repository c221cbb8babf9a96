"""Every table and plot of BENCHMARKS.md from the results files, in one command.

    .venv/bin/python bench/report.py             # or: make figures
    .venv/bin/python bench/report.py --results DIR --docs DIR --markdown FILE --no-plots

Reads ``bench/results/*.json`` (each written by a script in bench/, with its ``meta`` block from
bench/meta.py where the script had one), prints a markdown table per file, writes the plots as
PNGs under ``docs/`` and, in each ``--markdown`` file (default BENCHMARKS.md and README.md), replaces
the text between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->`` with table NAME (``NAME`` = the
results file's name without ``.json``; a file that is not a list of rows fills the blocks WHOLE_FILE names,
e.g. ``test_suite.json``, the suite's timed run, fills ``test_suite``, a sentence, and ``test_suite_slowest``,
its 10 slowest tests; a study packed in ``bench/results/STUDY.tar.xz`` fills the blocks FROM_ARCHIVE names
from its members). Plots, from ``anchor_cpu.json`` (bench/anchor.py):

  docs/anchor_ttft_cdf.png       client TTFT CDF per system, one panel per closed-loop load
  docs/anchor_handover_cdf.png   handover CDF per system (where per-request handovers exist)
  docs/anchor_rate.png           output tokens/s and TTFT p99 against the open-loop request rate
  docs/multiturn_cpu.png         TTFT, KV bytes moved and prefill tokens computed per turn (bench/multiturn.py)
  docs/anchor_timeline.png       per-request phases (mean ms) as stacked bars, per system and load:
                                 the phases that follow one another from arrival to the first decoded
                                 byte stacked, the ones that run beside them (first_byte, the
                                 prefiller's store / submit / transfer) as thin bars of their own

matplotlib is imported only to draw (``--no-plots`` needs only the standard library).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import tarfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SYSTEM_ORDER = ("single", "lmcache_p2p", "lmcache_p2p-early", "lmcache-pd", "vllm-nixl", "vllm-nixl-placed", "vllm-nixl-spin",
                "vllm-nixl-push", "vllm-nixl-lmcache-mp")
# One after the other from the request's arrival to its first decoded byte (stacked); the proxy's
# first_byte runs beside kv_wait and the prefiller's store / submit / transfer inside prefill
# (drawn as thin bars of their own, not stacked). See lmcache_p2p/proxy/observe/timeline.py.
SEQUENTIAL_PHASES = ("queue", "tokenize", "prefill", "kv_wait", "decode_start", "decode_first")
SIDE_PHASES = ("first_byte", "store", "submit", "transfer")
MARKER = re.compile(r"(<!-- table:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /table:(?P=name) -->)", re.S)


# ---- reading ------------------------------------------------------------------------------------


def rows_of(data: Any) -> list[dict[str, Any]]:
    """A results file's rows: ``{"rows": [...]}`` or an older bare list."""
    if isinstance(data, list):
        return data
    if isinstance(data, dict) and isinstance(data.get("rows"), list):
        return data["rows"]
    return []


def meta_of(data: Any) -> dict[str, Any] | None:
    return data.get("meta") if isinstance(data, dict) else None


def load_results(results: Path) -> dict[str, Any]:
    out = {}
    for path in sorted(results.glob("*.json")):
        try:
            out[path.stem] = json.loads(path.read_text())
        except ValueError as exc:
            print(f"skip {path}: not JSON ({exc})", file=sys.stderr)
    return out


def load_key(load: str) -> tuple[int, float]:
    """c1 < c4 < c8 < rate=1 < rate=2 ..."""
    if load.startswith("c") and load[1:].isdigit():
        return 0, float(load[1:])
    if load.startswith("rate="):
        return 1, float(load[5:])
    return 2, 0.0


def system_key(system: str) -> int:
    return SYSTEM_ORDER.index(system) if system in SYSTEM_ORDER else len(SYSTEM_ORDER)


# ---- tables -------------------------------------------------------------------------------------


def cell(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def pair(row: Mapping[str, Any], a: str, b: str, digits: int = 1) -> str:
    if row.get(a) is None and row.get(b) is None:
        return "-"
    return f"{cell(row.get(a), digits)} / {cell(row.get(b), digits)}"


def markdown(head: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(line) + " |" for line in lines]
    return "\n".join(out)


def anchor_table(rows: Sequence[Mapping[str, Any]]) -> str:
    ordered = sorted(rows, key=lambda r: (load_key(r["load"]), system_key(r["system"])))
    return markdown(
        ["system", "load", "TTFT p50 / p99 ms", "TPOT p99 ms", "ITL p99 ms", "handover p50 / p99 ms", "out tok/s",
         "failed", "= single", "KV hit", "full hits"],
        [[r["system"], r["load"], pair(r, "ttft_ms_p50", "ttft_ms_p99"), cell(r.get("tpot_ms_p99"), 1),
          cell(r.get("itl_ms_p99"), 1), pair(r, "handover_ms_p50", "handover_ms_p99"),
          cell(r.get("output_tokens_per_s"), 0), f"{r.get('failed')}/{r.get('requests', '?')}",
          "(ref)" if r["system"] == "single" else cell(r.get("outputs_equal_single")), cell(r.get("kv_hit_ratio"), 3),
          f"{r['kv_full_hits']}/{r.get('kv_lookups')}" if r.get("kv_full_hits") is not None else "-"]
         for r in ordered])


def early_decode_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """``early_decode_cpu.json``: the anchor's rows of each run, the runs of one (load, system) side by side."""
    ordered = sorted(rows, key=lambda r: (load_key(r["load"]), system_key(r["system"]), r["run"]))
    return markdown(
        ["system", "load", "run", "TTFT p50 / p99 ms", "handover p50 / p99 ms", "out tok/s", "failed", "= single",
         "full hits"],
        [[r["system"], r["load"], str(r["run"]), pair(r, "ttft_ms_p50", "ttft_ms_p99"),
          pair(r, "handover_ms_p50", "handover_ms_p99"), cell(r.get("output_tokens_per_s"), 0),
          f"{r.get('failed')}/{r.get('requests', '?')}",
          "(ref)" if r["system"] == "single" else cell(r.get("outputs_equal_single")),
          f"{r['kv_full_hits']}/{r.get('kv_lookups')}" if r.get("kv_full_hits") is not None else "-"]
         for r in ordered])


def _chunk(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def transfer_table(rows: Sequence[Mapping[str, Any]]) -> str:
    return markdown(
        ["path", "chunk", "GB/s", "ceiling", "ceiling GB/s", "ratio", "equal"],
        [[r["path"], _chunk(r["chunk_bytes"]), cell(r["gbps"], 2), r.get("ceiling_name", "memcpy"),
          cell(r["ceiling_gbps"], 2), cell(r["ratio"], 2),
          cell(r.get("bytes_equal")) if "bytes_equal" in r else "not checked (older bench)"] for r in rows])


def e2e_cpu_table(rows: Sequence[Mapping[str, Any]]) -> str:
    first_direct = next((r for r in rows if r["path"] == "direct"), None)
    lines = []
    for r in rows:
        eq = ("(reference)" if r is first_direct else "yes (vs c=1)" if r["outputs_equal_single"] else "NO (vs c=1)"
              ) if r["path"] == "direct" else cell(r["outputs_equal_single"])
        lookups = ("-" if r.get("kv_lookups") is None
                   else f"{r['kv_full_hits']} / {r['kv_full_chunk_hits']} / {r['kv_lookups']}")
        lines.append([r["path"], str(r["concurrency"]), f"{r['failed']}/{r['requests']}",
                      pair(r, "ttft_ms_p50", "ttft_ms_p99"), pair(r, "proxy_ttft_ms_p50", "proxy_ttft_ms_p99"),
                      pair(r, "handover_ms_p50", "handover_ms_p99"), pair(r, "kv_wait_ms_p50", "kv_wait_ms_p99"),
                      cell(r["output_tokens_per_s"], 0), cell(r.get("proxy_overhead_ms_p50")),
                      cell(r.get("tpot_ms_p50")),
                      eq, lookups])
    return markdown(["path", "conc", "failed", "TTFT p50 / p99 ms", "proxy-side TTFT p50 / p99", "handover p50 / p99",
                     "KV wait p50 / p99", "output tok/s", "proxy overhead p50", "TPOT p50", "outputs equal",
                     "decoder lookups full / chunks / all"], lines)


def e2e_gpu_table(rows: Sequence[Mapping[str, Any]]) -> str:
    lines = []
    for r in rows:
        transfer = pair(r, "kv_transfer_ms_p50", "kv_transfer_ms_p99")
        if r.get("kv_transfer_vs_ceiling_p50") is not None:
            transfer += f" ({cell(r['kv_transfer_vs_ceiling_p50'], 3)})"
        writes = cell(r.get("kv_write_ms_p50"), 2)
        if r.get("kv_write_vs_ceiling_p50") is not None:
            writes += f" ({cell(r['kv_write_vs_ceiling_p50'], 3)})"
        load = (f"{r['input_len'] // 1000}k in, one at a time" if r.get("sequential") and r.get("input_len")
                else f"{cell(r['rate'], 0)} req/s")
        lines.append([r["system"], str(r["gpus"]), cell(r.get("proxy_workers")), load,
                      cell(r.get("num_prompts")), cell(r["output_tok_s_per_gpu"], 0),
                      pair(r, "ttft_ms_p50", "ttft_ms_p99"), pair(r, "tpot_ms_p50", "tpot_ms_p99", 2),
                      cell(r["itl_ms_p99"]), pair(r, "handover_ms_p50", "handover_ms_p99"),
                      pair(r, "kv_wait_ms_p50", "kv_wait_ms_p99", 2), transfer, writes, cell(r.get("kv_hit_ratio"), 2),
                      str(r["failed"]), "ref" if r["system"] == "single" else cell(r.get("outputs_equal_single"))])
    return markdown(["system", "GPUs", "proxy procs", "load", "prompts", "out tok/s /GPU", "TTFT p50 / p99 ms",
                     "TPOT p50 / p99 ms", "ITL p99 ms", "handover p50 / p99 ms", "KV wait p50 / p99 ms",
                     "KV transfer p50 / p99 ms (ceiling / p50)", "its writes p50 ms (ceiling / p50)", "KV hit", "failed",
                     "= single"], lines)


def multiturn_table(rows: Sequence[Mapping[str, Any]]) -> str:
    lines = [[r["system"], r["policy"], str(r["turn"]), pair(r, "ttft_ms_p50", "ttft_ms_p99"),
              cell(r.get("kv_bytes_per_request"), 0), cell(r.get("prefill_tokens_per_request"), 0),
              cell(r.get("decoder_reused_tokens_per_request"), 0), cell(r.get("same_decoder_as_previous_turn"), 2),
              "ref" if r["system"] == "single" else cell(r.get("outputs_equal_single")), cell(r.get("failed"))]
             for r in rows]
    return markdown(["system", "policy", "turn", "TTFT p50 / p99 ms", "KV bytes / request", "prefill tokens / request",
                     "decoder reused tokens / request", "same decoder as last turn", "= single", "failed"], lines)


def proxy_relay_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Medians over repetitions per (variant, workers, point)."""
    groups: dict[tuple[str, int, str], list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["variant"], r.get("workers") or 1, r["point"]), []).append(r)

    def median(rs: Sequence[Mapping[str, Any]], key: str) -> float | None:
        values = sorted(v for r in rs if (v := r.get(key)) is not None)
        return values[len(values) // 2] if values else None

    lines = [[variant, str(workers), point, str(len(rs)), cell(median(rs, "tokens_s"), 0),
              cell(median(rs, "proxy_us_token"), 1), cell(median(rs, "proxy_cpu_util"), 2),
              cell(median(rs, "coordinator_cpu_util"), 2), cell(median(rs, "gap_ms_p99"), 1),
              str(sum(r.get("failed") or 0 for r in rs))]
             for (variant, workers, point), rs in groups.items()]
    return markdown(["variant", "workers", "point", "reps", "tokens/s", "proxy CPU us / token", "proxy CPU (cores)",
                     "coordinator CPU (cores)", "token gap p99 ms", "failed"], lines)


def proxy_handover_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Per (variant, workers, streams): each rep's p50 / p99, averaged over the reps (as the bench's summary)."""
    groups: dict[tuple[str, int, int], list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["variant"], r.get("workers") or 1, r["streams"]), []).append(r)

    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    def avg(rs: Sequence[Mapping[str, Any]], key: str, field: str) -> float | None:
        return mean([v for r in rs if (v := (r.get(key) or {}).get(field)) is not None])

    def phase(rs: Sequence[Mapping[str, Any]], name: str) -> float | None:
        return mean([v for r in rs if (v := ((r.get("proxy_timeline_ms") or {}).get(name) or {}).get("p50")) is not None])

    lines = [[variant, str(workers), str(streams), str(len(rs)),
              f"{cell(avg(rs, 'proxy_handover_ms', 'p50'))} / {cell(avg(rs, 'proxy_handover_ms', 'p99'))}",
              cell(avg(rs, "answer_to_decode_ms", "p50")), cell(phase(rs, "first_byte")),
              cell(phase(rs, "decode_start")), str(sum(r.get("failed") or 0 for r in rs))]
             for (variant, workers, streams), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0]))]
    return markdown(["variant", "workers", "streams", "reps", "proxy handover p50 / p99 ms",
                     "prefill answer -> decode request at the decoder p50 ms", "first_byte p50 ms",
                     "decode_start p50 ms", "failed"], lines)


def faults_table(rows: Sequence[Mapping[str, Any]]) -> str:
    cols = ["scenario", "requests", "succeeded", "clean_errors", "unclean_errors", "hung", "leaked_slots",
            "held_slots_after_settle", "wrong_outputs", "recovered"]
    return markdown(cols, [[cell(r.get(c)) for c in cols] for r in rows])


def faults_peers_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """bench/faults_peers.py: per scenario and system, how the client's requests ended."""
    ordered = sorted(rows, key=lambda r: (r["scenario"], r["system"] != "lmcache_p2p"))
    return markdown(["scenario", "system", "requests", "served, equal", "clean errors", "hung", "wrong", "unclean ends"],
                    [[r["scenario"], r["system"], cell(r.get("requests")), cell(r.get("served")),
                      cell(r.get("clean_errors")), cell(r.get("hung")), cell(r.get("wrong")),
                      cell(r.get("unclean_errors"))] for r in ordered])


def tp_cpu_table(rows: Sequence[Mapping[str, Any]]) -> str:
    lines = [[r["system"], r.get("dtype") or "bfloat16", str(r["concurrency"]), f"{r['failed']}/{r['requests']}", pair(r, "ttft_ms_p50", "ttft_ms_p99"),
              pair(r, "handover_ms_p50", "handover_ms_p99"), pair(r, "kv_transfer_ms_p50", "kv_transfer_ms_p99"),
              "-" if r.get("kv_bytes_per_request") is None else
              f"{cell(r['kv_bytes_per_request'], 0)} ({cell(r.get('kv_bytes_equal_model_kv'))})",
              "(ref)" if r.get("d_tp") is None else
              f"{cell(r.get('outputs_equal'))} / {cell(r.get('outputs_equal_other_tp'))}",
              "-" if r.get("d_tp") is None else (r.get("rule") or "not checked (older bench)"),
              cell(r.get("output_rule_violations")), cell(r.get("kv_hit_ratio"), 3),
              "-" if r.get("kv_lookups") is None else f"{r['ranks_loaded_whole']}/{r['kv_lookups']}"] for r in rows]
    return markdown(["system", "dtype", "conc", "failed", "TTFT p50 / p99 ms", "handover p50 / p99",
                     "KV transfer p50 / p99", "KV B/request (= model KV)", "= plain at D's TP / other TP", "rule",
                     "rule breaks", "KV hit",
                     "ranks loaded whole"], lines)


def _vs_single(r: Mapping[str, Any]) -> str:
    over = r.get("prefill_side_overhead_vs_single_p50")
    if over is None:
        return "ref" if str(r.get("system", "")).startswith("single") else "-"
    return f"{1 + over:.2f}x" if over >= 0.5 else f"{over * 100:+.1f} %"


def e2e_gpu_long_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """bench/e2e_gpu_long.py's rows (runs 4-13 of the long-prompt study), in the file's order."""
    lines = []
    for r in rows:
        single = str(r.get("system", "")).startswith("single")
        label = r.get("label") or r["system"]
        queue, first = r.get("proxy_queue_ms_p50"), r.get("proxy_first_byte_ms_p50")
        kv = r.get("kv_bytes_per_request")
        lines.append([label if r.get("run") == 4 else f"**run {r.get('run')}** {label}",
                      f"{r['prompt_tokens'] // 1000}k", pair(r, "ttft_ms_p50", "ttft_ms_p99"), _vs_single(r),
                      cell(r.get("engine_ms_p50")), "-" if single else cell(r.get("lmcache_store_ms_per_request")),
                      "-" if queue is None or first is None else f"{queue:.1f} + {first:.1f}",
                      pair(r, "handover_ms_p50", "handover_ms_p99"), "-" if kv is None else f"{kv / 1e9:.2f} GB",
                      "-" if single else cell(r.get("kv_hit_ratio"), 2), cell(r.get("failed"))])
    return markdown(["system", "prompt", "TTFT p50 / p99 ms", "vs single (p50)", "engine p50 ms",
                     "LMCache store ms / request", "proxy queue + first byte p50 ms", "handover p50 / p99 ms",
                     "KV / request", "hit", "failed"], lines)


def tp_engine_table(rows: Sequence[Mapping[str, Any]]) -> str:
    return markdown(["transport", "P -> D", "ready p50 / p99 ms", "per chunk ms", "retrieve p50 ms",
                     "bytes moved / model KV", "vs equal", "vs same P", "equal", "failed"],
                    [[r["transport"], f"{r['p_tp']} -> {r['d_tp']}", pair(r, "ready_ms_p50", "ready_ms_p99"),
                      cell(r.get("ready_per_chunk_ms_p50")), cell(r.get("retrieve_ms_p50")),
                      f"{r['bytes_moved'] >> 20} / {r['model_kv_bytes'] >> 20} MiB",
                      "" if r.get("vs_equal") is None else cell(r["vs_equal"], 2),
                      "" if r.get("vs_same_prefiller") is None else cell(r["vs_same_prefiller"], 2),
                      cell(r.get("equal")), cell(r.get("failed"))] for r in rows])


def multihost_rtt_table(data: Mapping[str, Any]) -> str:
    """bench/multihost.py's latency sweep (``rtt_rows``), with the commit of its own run (``rtt_meta``)."""
    rows = data.get("rtt_rows") or []
    return markdown(["added RTT ms", "TTFT p50 / p99 PD", "TTFT p50 / p99 single", "handover p50 / p99",
                     "KV wait p50", "target (p50)", "met", "failed PD / single"],
                    [[f"{r['added_rtt_ms']:g}", pair(r, "ttft_ms_p50_pd", "ttft_ms_p99_pd"),
                      pair(r, "ttft_ms_p50_single", "ttft_ms_p99_single"), pair(r, "handover_ms_p50", "handover_ms_p99"),
                      cell(r.get("kv_wait_ms_p50"), 2), cell(r.get("ttft_target_ms")), cell(r.get("meets_target")),
                      f"{r.get('pd_failed')} / {r.get('single_failed')}"] for r in rows])


def routers_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """bench/routers.py's rows; a figure a backend does not have (NixlConnector: per-request hits, waits) is "-"."""
    return markdown(["router", "backend", "concurrency", "requests", "TTFT p50 / p99 ms", "handover mean ms",
                     "handover p50 / p99 ms", "failed", "= single", "KV hit", "full hits", "decoder waits"],
                    [[r["router"], r["backend"], str(r["concurrency"]), str(r["requests"]),
                      pair(r, "ttft_ms_p50", "ttft_ms_p99"), cell(r.get("handover_ms_mean")),
                      pair(r, "handover_ms_p50", "handover_ms_p99"), str(r["failed"]),
                      "yes" if r.get("outputs_equal") else "NO", cell(r.get("kv_hit_ratio"), 2),
                      f"{cell(r.get('kv_full_hits'))}/{cell(r.get('kv_lookups'))}", cell(r.get("decoder_waits"))]
                     for r in rows])


def one_gpu_arena_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """``e2e_gpu_one_gpu.json``: the KV transfer with the VRAM send arena against host-memory chunks."""
    return markdown(["system", "rate req/s", "KV transfer p50 / p99 ms", "failed", "decoder hit", "full hits"],
                    [[r["system"], cell(r["rate"], 0), pair(r, "kv_transfer_ms_p50", "kv_transfer_ms_p99", 2),
                      cell(r.get("failed")), cell(r.get("kv_hit_ratio"), 2),
                      f"{r.get('kv_full_hits')}/{r.get('kv_lookups')}"] for r in rows])


def handover_split_table(data: Mapping[str, Any]) -> str:
    """An e2e_gpu.py file's rows beside the decoder's own vLLM TTFT (``handover_split``), by rate, else as filed."""
    split = {(h["system"], h["rate"]): h for h in data.get("handover_split") or []}
    rows = sorted(rows_of(data), key=lambda r: r["rate"])
    return markdown(["system", "rate req/s", "TTFT p50 / p99 ms", "TPOT p50 / p99 ms", "handover p50 / p99 ms",
                     "decoder vLLM TTFT p50 ms", "outside the decoder (mean) ms", "KV hit", "failed"],
                    [[r["system"], cell(r["rate"], 0), pair(r, "ttft_ms_p50", "ttft_ms_p99"),
                      pair(r, "tpot_ms_p50", "tpot_ms_p99", 2), pair(r, "handover_ms_p50", "handover_ms_p99"),
                      cell(split.get((r["system"], r["rate"]), {}).get("decoder_ttft_ms_p50")),
                      cell(split.get((r["system"], r["rate"]), {}).get("outside_decoder_ms_mean")),
                      cell(r.get("kv_hit_ratio"), 2), cell(r.get("failed"))] for r in rows])


def gpu_equality_table(data: Mapping[str, Any]) -> str:
    """``equality`` of e2e_gpu.json: per model, 1P1D's greedy outputs and decoder lookups against a single instance."""
    transports = ("lmcache_p2p-nixl", "lmcache_p2p-nccl")
    lines = []
    for name, model in (data.get("equality") or {}).items():
        systems = model.get("systems") or {}
        line = [f"`{name}` ({model.get('model')})", "yes" if model.get("tokenizer") else "none",
                str(len(model.get("cases") or []))]
        for transport in transports:
            s = systems.get(transport)
            ids = f"{s.get('token_ids_equal')}/{s.get('token_ids_compared')}" if s else ""
            line += ["-", "-", "-"] if s is None else [
                f"{ids} (texts {s.get('texts_equal')}/{s.get('cases')})",
                f"{s.get('decoder_full_prompt_hits')}/{s.get('decoder_lookups')}", cell(s.get("failed"))]
        lines.append(line)
    head = ["model", "tokenizer", "cases"]
    for transport in transports:
        head += [f"{transport}: token ids = single", f"{transport}: KV = prompt", f"{transport}: failed"]
    return markdown(head, lines)


def round_trips_table(data: Mapping[str, Any]) -> str:
    """bench/multihost.py's ``round_trips``: the PD path's trips beyond a single instance's."""
    return markdown(["step", "between", "on the TTFT path"],
                    [[r["step"], r["between"], "yes" if r.get("in_ttft") else "no"]
                     for r in data.get("round_trips") or []])


def ab_runs_table(members: Mapping[str, Any]) -> str:
    """A study's e2e.py files (``TREE-REP.json``), by repetition, then in the order they ran."""
    def key(item: tuple[str, Any]) -> tuple[str, str]:
        return Path(item[0]).stem.rsplit("-", 1)[-1], str((meta_of(item[1]) or {}).get("date"))

    lines = []
    for name, data in sorted(members.items(), key=key):
        tree, rep = Path(name).stem.rsplit("-", 1)
        commit = str((meta_of(data) or {}).get("commit") or "?")[:7]
        lines += [[f"{tree} ({commit})", rep, str(r["concurrency"]), pair(r, "ttft_ms_p50", "ttft_ms_p99"),
                   pair(r, "handover_ms_p50", "handover_ms_p99"), cell(r.get("output_tokens_per_s")),
                   f"{r['failed']}/{r['requests']}", f"{r.get('kv_full_hits')}/{r.get('kv_lookups')}"]
                  for r in rows_of(data)]
    return markdown(["tree", "rep", "conc", "TTFT p50 / p99 ms", "handover p50 / p99 ms", "output tok/s", "failed",
                     "full KV hits"], lines)


TABLES: dict[str, Callable[[Sequence[Mapping[str, Any]]], str]] = {
    "tp_engine": tp_engine_table,
    "e2e_gpu_long": e2e_gpu_long_table,
    "tp_cpu": tp_cpu_table,
    "anchor_cpu": anchor_table,
    "anchor_cpu_quick": anchor_table,
    "early_decode_cpu": early_decode_table,
    "e2e_cpu": e2e_cpu_table,
    "e2e_gpu": e2e_gpu_table,
    "e2e_gpu_anchor": e2e_gpu_table,
    "routers_cpu": routers_table,
    "faults": faults_table,
    "faults_peers": faults_peers_table,
    "multiturn_cpu": multiturn_table,
    "proxy_relay": proxy_relay_table,
    "proxy_handover": proxy_handover_table,
    "e2e_gpu_one_gpu": one_gpu_arena_table,
}


def test_suite_sentence(data: Mapping[str, Any]) -> str:
    """README's figure for ``make test``, from ``test_suite.json`` (written by the suite's timed run)."""
    minutes = data["wall_s"] / 60
    note = f" ({data['note']})" if data.get("note") else ""
    commit = str(data["commit"])
    commit = commit[:10] if re.fullmatch(r"[0-9a-f]+", commit) else commit  # a hash, or words naming several
    return (f"`make test` took {minutes:.0f} minutes of wall time ({data['passed']} passed, {data['skipped']} skipped, "
            f"{data['failed']} failed) at commit {commit}{note} (`bench/results/test_suite.json`).")


def test_suite_slowest(data: Mapping[str, Any]) -> str:
    return markdown(["test", "seconds"], [[f"`{t['test']}`", cell(float(t["seconds"]))] for t in data["slowest"]])


def handover_phases_table(data: Mapping[str, Any]) -> str:
    """``handover_gpu.json``: per run and rate, where the handover's mean goes against the decoder's own vLLM
    TTFT (``bench/e2e_gpu.py``'s ``handover_split``), beside what one HTTP hop through a vLLM API server costs
    the single instance of the same run (its client TTFT less its own vLLM TTFT)."""
    lines = []
    for run in data.get("runs") or []:
        result = run["data"]
        hop = {h["rate"]: h["client_ttft_less_vllm_ttft_ms_mean"] for h in result.get("single_outside_engine") or []}
        for h in result.get("handover_split") or []:
            egress = None
            if None not in (h.get("decode_first_ms_mean"), h.get("decode_accept_ms_mean")):
                egress = h["decode_first_ms_mean"] - h["decode_accept_ms_mean"] - h["decoder_ttft_ms_mean"]
            lines.append([f"{run['label']} ({str(run['commit'])[:7]})", h["system"], cell(h["rate"], 0),
                          cell(h["handover_ms_mean"]), cell(h["decoder_ttft_ms_mean"]),
                          cell(h["outside_decoder_ms_mean"]), cell(h.get("kv_wait_ms_mean")),
                          cell(h.get("decode_start_ms_mean")), cell(h.get("decode_accept_ms_mean")), cell(egress),
                          cell(hop.get(h["rate"]))])
    return markdown(["run", "system", "req/s", "handover", "decoder vLLM TTFT", "outside the decoder's TTFT",
                     "kv_wait", "decode_start", "decode_accept (decoder intake)", "rest of decode_first (egress)",
                     "single: client TTFT - vLLM TTFT"], lines)


# Results files that are not a list of rows: each gives blocks of its own (block name -> render).
WHOLE_FILE: dict[str, dict[str, Callable[[Mapping[str, Any]], str]]] = {
    "test_suite": {"test_suite": test_suite_sentence, "test_suite_slowest": test_suite_slowest},
    "multihost_cpu": {"multihost_cpu_rtt": multihost_rtt_table, "multihost_cpu_round_trips": round_trips_table},
    "e2e_gpu": {"e2e_gpu_equality": gpu_equality_table},
    "handover_gpu": {"handover_gpu": handover_phases_table},
}

# Blocks from a study's archive, bench/results/STUDY.tar.xz: block name -> (STUDY, the JSON members it renders
# from, a render over {member: data}).
FROM_ARCHIVE: dict[str, tuple[str, tuple[str, ...], Callable[[Mapping[str, Any]], str]]] = {
    "tp1_ab": ("tp1_ab", ("tp1_ab/pre-0.json", "tp1_ab/pre-1.json", "tp1_ab/main-0.json", "tp1_ab/main-1.json"),
               ab_runs_table),
    "gpu_one_ab_vs_lmcache_pd": ("gpu_one_ab", ("gpu_one_ab/vs_lmcache_pd_s16.json",),
                                 lambda m: handover_split_table(m["gpu_one_ab/vs_lmcache_pd_s16.json"])),
}


def blocks_for(name: str, data: Any) -> dict[str, str]:
    """Every marked block a results file fills: its table and a whole-file file's blocks."""
    blocks = {}
    if name in WHOLE_FILE and isinstance(data, Mapping):
        blocks = {block: render(data) for block, render in WHOLE_FILE[name].items()}
    table = table_for(name, data)
    return {name: table, **blocks} if table is not None else blocks


def archive_blocks(results: Path) -> dict[str, str]:
    """FROM_ARCHIVE's blocks whose archive is under ``results``."""
    out = {}
    for block, (study, members, render) in FROM_ARCHIVE.items():
        archive = results / f"{study}.tar.xz"
        if archive.is_file():
            with tarfile.open(archive, "r:*") as tar:
                out[block] = render({m: json.load(tar.extractfile(m)) for m in members})
    return out


def table_for(name: str, data: Any) -> str | None:
    rows = rows_of(data)
    if not rows:
        return None
    if name.startswith("transfer_"):
        return transfer_table(rows)
    make = TABLES.get(name)
    return make(rows) if make else None


def meta_line(data: Any) -> str:
    meta = meta_of(data)
    if not meta:
        return "no metadata (written before bench/meta.py)"
    commit = (meta.get("commit") or "?")[:10] + ("+dirty" if meta.get("dirty") else "")
    machine = meta.get("machine") or {}
    if not isinstance(machine, Mapping):  # a study's own meta block names its machine in words
        return f"{meta.get('date')}, commit {commit}, {machine}"
    return (f"{meta.get('date')}, commit {commit}, {machine.get('cpu')} x{machine.get('cores')}"
            f"{', ' + ', '.join(machine['gpus']) if machine.get('gpus') else ''}, load {meta.get('load_1m_before')}: "
            f"`{meta.get('command')}`")


def update_markdown(path: Path, tables: Mapping[str, str]) -> list[str]:
    """Replace every marked block whose name has a table; returns the names replaced."""
    text = path.read_text()
    done: list[str] = []

    def replace(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in tables:
            return m.group(0)
        done.append(name)
        return f"{m.group(1)}{tables[name]}\n{m.group(4)}"

    new = MARKER.sub(replace, text)
    if new != text:
        path.write_text(new)
    return done


# ---- plots --------------------------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    xs = sorted(v for v in values if v is not None)
    return [xs[0], *xs] if xs else [], [0.0, *((i + 1) / len(xs) for i in range(len(xs)))] if xs else []


def plot_cdfs(data: Mapping[str, Any], key: str, title: str, out: Path) -> bool:
    """One panel per closed-loop load, one line per system; False when no system has samples."""
    samples = data.get("samples") or {}
    loads = sorted({load for per in samples.values() for load, s in per.items() if s.get(key)
                    and load_key(load)[0] == 0}, key=load_key)
    if not loads:
        return False
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(loads), figsize=(4.2 * len(loads), 3.4), squeeze=False)
    for ax, load in zip(axes[0], loads):
        for system in sorted(samples, key=system_key):
            values = (samples[system].get(load) or {}).get(key) or []
            if values:
                xs, ys = cdf(values)
                ax.step(xs, ys, where="post", label=f"{system} (n={len(values)})")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(plt.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
        ax.set_xlabel(f"{key.replace('_ms', '')} (ms, log)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(load)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def plot_rates(data: Mapping[str, Any], out: Path) -> bool:
    rows = [r for r in rows_of(data) if r["load"].startswith("rate=")]
    if not rows:
        return False
    plt = _pyplot()
    fig, (tput, tail) = plt.subplots(1, 2, figsize=(9, 3.4))
    for system in sorted({r["system"] for r in rows}, key=system_key):
        mine = sorted((r for r in rows if r["system"] == system), key=lambda r: load_key(r["load"]))
        rates = [load_key(r["load"])[1] for r in mine]
        tput.plot(rates, [r["output_tokens_per_s"] for r in mine], marker="o", label=system)
        tail.plot(rates, [r["ttft_ms_p99"] for r in mine], marker="o", label=system)
    tput.set_ylabel("output tokens/s")
    tail.set_ylabel("TTFT p99 (ms, log)")
    tail.set_yscale("log")
    tail.yaxis.set_major_locator(plt.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    tail.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
    tail.yaxis.set_minor_formatter(plt.NullFormatter())
    all_rates = sorted({load_key(r["load"])[1] for r in rows})
    for ax in (tput, tail):
        ax.set_xlabel("request rate (req/s, open loop)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_rates, [f"{r:g}" for r in all_rates])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Throughput and TTFT tail against request rate", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def timeline_means(timeline: Mapping[str, Any]) -> dict[str, float]:
    """Mean ms per phase of a ``timeline_ms`` block (``recent`` and empty phases left out)."""
    out = {}
    for phase, summary in timeline.items():
        if phase != "recent" and isinstance(summary, Mapping) and summary.get("mean") is not None:
            out[phase] = float(summary["mean"])
    return out


def plot_timeline(data: Mapping[str, Any], out: Path) -> bool:
    bars = []  # (label, {phase: mean ms})
    for system in sorted(data.get("timeline") or {}, key=system_key):
        for load in sorted(data["timeline"][system], key=load_key):
            means = timeline_means(data["timeline"][system][load])
            if means:
                bars.append((f"{system}\n{load}", means))
    if not bars:
        return False
    stacked = [p for p in SEQUENTIAL_PHASES if any(p in m for _, m in bars)]
    side = [p for p in SIDE_PHASES if any(p in m for _, m in bars)]
    plt = _pyplot()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(bars) + 2.5), 4))
    xs = list(range(len(bars)))
    shift = 0.15 if side else 0.0  # the main bar leaves room for the thin ones on its right
    bottoms = [0.0] * len(bars)
    for n, phase in enumerate(stacked):
        heights = [m.get(phase, 0.0) for _, m in bars]
        ax.bar([x - shift for x in xs], heights, width=0.45, bottom=bottoms, label=phase, color=colors[n % len(colors)])
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    for n, phase in enumerate(side):
        ax.bar([x + 0.14 + 0.1 * n for x in xs], [m.get(phase, 0.0) for _, m in bars], width=0.09,
               label=f"{phase} (beside)", color=colors[(len(stacked) + n) % len(colors)], hatch="//")
    ax.set_xticks(xs, [label for label, _ in bars], fontsize=7)
    ax.set_ylabel("mean ms per request")
    ax.set_title("Per-request timeline: arrival -> first decoded byte (stacked)", fontsize=9)
    ax.legend(fontsize=7, bbox_to_anchor=(1.01, 1), loc="upper left")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def plot_anchor(data: Mapping[str, Any], docs: Path) -> list[Path]:
    docs.mkdir(parents=True, exist_ok=True)
    made = []
    jobs = [
        ("anchor_ttft_cdf.png", lambda p: plot_cdfs(data, "ttft_ms", "Client TTFT per request (CDF)", p)),
        ("anchor_handover_cdf.png", lambda p: plot_cdfs(data, "handover_ms", "Handover per request (CDF)", p)),
        ("anchor_rate.png", lambda p: plot_rates(data, p)),
        ("anchor_timeline.png", lambda p: plot_timeline(data, p)),
    ]
    for name, job in jobs:
        if job(docs / name):
            made.append(docs / name)
    return made


# ---- command line -------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--docs", type=Path, default=REPO / "docs")
    p.add_argument("--markdown", type=Path, nargs="*", default=[REPO / "BENCHMARKS.md", REPO / "README.md"],
                   help="files whose <!-- table:NAME --> blocks are replaced (none given: none)")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    results = load_results(args.results)
    tables: dict[str, str] = {}
    for name, data in results.items():
        blocks = blocks_for(name, data)
        tables.update(blocks)
        for table in blocks.values():
            print(f"## {name}.json\n{meta_line(data)}\n\n{table}\n")
    for block, table in archive_blocks(args.results).items():
        tables[block] = table
        print(f"## {FROM_ARCHIVE[block][0]}.tar.xz: {', '.join(FROM_ARCHIVE[block][1])}\n\n{table}\n")
    for path in args.markdown:
        if str(path) and path.is_file():
            done = update_markdown(path, tables)
            print(f"updated {path}: {', '.join(done) or 'no marked table'}")
    if not args.no_plots and "anchor_cpu" in results:
        for path in plot_anchor(results["anchor_cpu"], args.docs):
            print(f"wrote {path}")
    if not args.no_plots and "multiturn_cpu" in results:
        print(f"wrote {plot_multiturn(results['multiturn_cpu'], args.docs)}")
    return 0


def plot_multiturn(data: Any, docs: Path) -> Path:
    """docs/multiturn_cpu.png with bench/multiturn.py's own plot."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import multiturn  # bench/ is not a package; heavy imports stay lazy until here

    fields = {f.name for f in dataclasses.fields(multiturn.Row)}
    rows = [multiturn.Row(**{k: v for k, v in r.items() if k in fields}) for r in rows_of(data)]
    path = docs / "multiturn_cpu.png"
    multiturn.plot(rows, path)
    return path


if __name__ == "__main__":
    sys.exit(main())
