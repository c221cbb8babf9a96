"""bench/results/e2e_gpu_long.json from this folder's run4-run6 files (one H200, 2026-12-02/03): one row per
(system, prompt tokens, output tokens, rate, run), the prefill-side overhead against the single instance of the
same run.

    python3 bench/results/long_prompts/make_e2e_gpu_long.py
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "e2e_gpu_long.json"
RUNS = {  # file -> (system label, path in the row: None the row itself, "direct" its direct_prefiller part)
    "run4_single.json": ("single", None),
    "run4_p2p_batched_gather.json": ("lmcache_p2p-nixl 1P1D (batched gather)", None),
    "run4_p2p_gather_off.json": ("lmcache_p2p-nixl 1P1D (LMCache's gather: batched_gather false)", None),
}
# Run 5: each file beside the single instance of the same call (None: no single row of that call).
RUN5 = {
    "run5_credit_p2p.json": ("lmcache_p2p-nixl 1P1D (freed-slot announcement)", "run5_credit_single.json"),
    "run5_credit_single.json": ("single", None),
    "run5_lmcache_pd16.json": ("LMCache PD 1P1D (--max-model-len 20000)", "run5_single16_mml20000.json"),
    "run5_single16_mml20000.json": ("single (--max-model-len 20000)", None),
    "run5_single_neighbour.json": ("single beside a decoding vLLM on the same GPU", None),
}
# Run 6 (2026-12-03, main c607b7d): after the detokenizer's bounded context; the decoder-busy split side by side.
RUN6 = {
    "run6_detok_p2p.json": ("lmcache_p2p-nixl 1P1D (detokenizer's bounded context)", "run6_detok_single.json"),
    "run6_detok_single.json": ("single", None),
    "run6_busy_p2p.json": ("lmcache_p2p-nixl 1P1D, decoder busy on the same GPU", "run6_busy_single.json"),
    "run6_busy_single.json": ("single (decoding its own 256 tokens)", None),
}
# Run 7 (2026-12-03, main 4d57e00): after the streaming side's deferred replay of the first token (16def34).
RUN7 = {
    "run7_replay_p2p.json": ("lmcache_p2p-nixl 1P1D (first token replayed after the first byte)",
                             "run7_replay_single.json"),
    "run7_replay_single.json": ("single", None),
}
# Run 8 (2026-12-03, main 3aae5b8): the owner keeps the prefiller's first text; prompt ids without offsets.
RUN8 = {
    "run8_owner_text_p2p.json": ("lmcache_p2p-nixl 1P1D (prefiller's first text, ids without offsets)",
                                 "run8_owner_text_single.json"),
    "run8_owner_text_single.json": ("single", None),
}
RUN9 = {
    "run9_raw_body_p2p.json": ("lmcache_p2p-nixl 1P1D (ids once, the decode body's bytes passed on)",
                               "run9_raw_body_single.json"),
    "run9_raw_body_single.json": ("single", None),
}
RUN10 = {  # run 9's code + stamps/stamps.patch (per-request timing stamps in the proxy)
    "run10_stamped_p2p.json": ("lmcache_p2p-nixl 1P1D (run 9 + timing stamps)", "run10_stamped_single.json"),
    "run10_stamped_single.json": ("single", None),
}
RUN11 = {  # main 6a650a8 + the same stamps
    "run11_text_check_p2p.json": ("lmcache_p2p-nixl 1P1D (prefillers' /tokenize checked when up)",
                                  "run11_text_check_single.json"),
    "run11_text_check_single.json": ("single", None),
}
DIRECT = {"run4_p2p_batched_gather.json": "direct to the prefiller (batched gather)",
          "run4_p2p_gather_off.json": "direct to the prefiller (LMCache's gather)"}


def engine(part: dict) -> dict:
    trace = ((part.get("prefill_trace") or {}).get("prefiller") or (part.get("prefill_trace") or {}).get("single")
             or {})
    return {"engine_ms_p50": trace.get("engine_ms_p50"), "lmcache_store_ms_per_request": trace.get("store_ms_mean"),
            "gather_ms_per_request": trace.get("gather_ms_mean"), "gpu_gap_ms_per_request": trace.get("gpu_gap_ms_mean"),
            "stores_per_request": trace.get("stores_mean")}


def row(system: str, key: str, r: dict, part: dict, single: dict | None) -> dict:
    tokens, rest = key.split("@")
    rate, _, output = rest.partition("/")
    ttft = part["ttft_ms_p50"]
    ref = (single or {}).get(key, {}).get("ttft_ms_p50")
    out = {"system": system, "prompt_tokens": int(tokens), "output_tokens": int(output or r.get("output_len") or 2),
           "rate": rate, "ttft_ms_p50": ttft, "ttft_ms_p99": part["ttft_ms_p99"],
           "prefill_side_overhead_vs_single_p50": None if ref is None or system == "single" else
           round(ttft / ref - 1, 4),
           "failed": part["failed"], "completed": part["completed"], **engine(part)}
    if part is r and system != "single":
        timeline = (r.get("proxy_stats") or {}).get("timeline_ms") or {}
        out.update(handover_ms_p50=r.get("handover_ms_p50"), handover_ms_p99=r.get("handover_ms_p99"),
                   kv_bytes_per_request=r.get("kv_bytes_per_request"), kv_transfer_ms_p50=r.get("kv_transfer_ms_p50"),
                   kv_transfer_ms_p99=r.get("kv_transfer_ms_p99"), kv_hit_ratio=r.get("kv_hit_ratio"),
                   kv_full_hits=r.get("kv_full_hits"),
                   proxy_queue_ms_p50=(timeline.get("queue") or {}).get("p50"),
                   proxy_queue_ms_p99=(timeline.get("queue") or {}).get("p99"),
                   proxy_first_byte_ms_p50=(timeline.get("first_byte") or {}).get("p50"))
    return out


def main() -> None:
    single = json.loads((HERE / "run4_single.json").read_text())["rows"]
    rows = []
    for name, (system, _) in RUNS.items():
        data = json.loads((HERE / name).read_text())["rows"]
        for key, r in sorted(data.items()):
            rows.append(row(system, key, r, r, single))
            if name in DIRECT and r.get("direct_prefiller"):
                rows.append(row(DIRECT[name], key, r, r["direct_prefiller"], single))
    for r in rows:
        r["run"] = 4
    for run, files in ((5, RUN5), (6, RUN6), (7, RUN7), (8, RUN8), (9, RUN9), (10, RUN10), (11, RUN11)):
        for name, (system, ref) in files.items():
            data = json.loads((HERE / name).read_text())["rows"]
            ref_rows = json.loads((HERE / ref).read_text())["rows"] if ref else None
            for key, r in sorted(data.items()):
                rows.append({**row(system, key, r, r, ref_rows), "run": run})
    meta = json.loads((HERE / "run4_meta.json").read_text())
    gather = json.loads((HERE / "run4_store_gather.json").read_text())
    OUT.write_text(json.dumps({"meta": meta, "rows": rows, "store_gather": gather}, indent=1) + "\n")
    for r in rows:
        print(f"{r['system'][:58]:58} {r['prompt_tokens']:>6} {r['output_tokens']:>4} {r['rate']:>4} "
              f"{r['ttft_ms_p50']:>8} {r['ttft_ms_p99']:>8} {r['prefill_side_overhead_vs_single_p50']!s:>8} "
              f"{r.get('engine_ms_p50')!s:>8} {r.get('lmcache_store_ms_per_request')!s:>7}")


if __name__ == "__main__":
    main()
