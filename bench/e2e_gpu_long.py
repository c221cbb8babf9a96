"""bench/results/e2e_gpu_long.json from the long-prompt study's runs 4-13 (one H200, 2026-12-02 to 12-04).

    .venv/bin/python bench/e2e_gpu_long.py            # then: make figures (BENCHMARKS.md's e2e_gpu_long table)

The runs' raw files (``bench/e2e_gpu.py --long`` results, one per system and call) are packed in
``bench/results/long_prompts.tar.xz`` (``--source``: that archive or a folder holding the same files; the index
of what is inside is in bench/results/long_prompts.md). One row per (run, system, prompt tokens, output tokens,
rate): the client's TTFT, the prefiller's engine and LMCache store from its trace, the proxy's phases, and the
overhead against the single instance of the same call (``prefill_side_overhead_vs_single_p50``). Each row names
its run, the commit of main it measured (``commit``; run 4 was a branch) and ``label``, the table's words.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tarfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
ARCHIVE = RESULTS / "long_prompts.tar.xz"
MEMBER_DIR = "long_prompts"


@dataclasses.dataclass(frozen=True)
class Part:
    """One raw file of a run: its rows' system and table label, and the single instance beside it.

    ``ref``: the file (``name#system`` for a file whose rows are a list) holding the single instance of the
    same call; None for a single instance itself, or where the call had none."""

    file: str
    system: str
    label: str
    ref: str | None = None
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)  # by row key, where the label differs
    direct: str | None = None  # the label of the row's direct_prefiller part (run 4)


@dataclasses.dataclass(frozen=True)
class Run:
    number: int
    commit: str  # of main, or a branch's name where it was not main
    date: str
    parts: tuple[Part, ...]


P2P = "lmcache_p2p-nixl 1P1D"
RUNS = (
    Run(4, "branch long-gpu", "2026-12-02", (
        Part("run4_single.json", "single", "single"),
        Part("run4_p2p_batched_gather.json", f"{P2P} (batched gather)", "1P1D, batched gather", "run4_single.json",
             labels={"32000@seq": "1P1D, batched gather (admission wait)"}, direct="direct, batched gather"),
        Part("run4_p2p_gather_off.json", f"{P2P} (LMCache's gather: batched_gather false)", "1P1D, LMCache's gather",
             "run4_single.json", direct="direct, LMCache's gather"))),
    Run(5, "3a8d2b9", "2026-12-02", (
        Part("run5_credit_single.json", "single", "single"),
        Part("run5_credit_p2p.json", f"{P2P} (freed-slot announcement)", "1P1D, freed slots announced at once",
             "run5_credit_single.json", labels={"64000@seq": "1P1D (8.4 GB > 4 GB buffer: colocated)"}),
        Part("run5_single16_mml20000.json", "single (--max-model-len 20000)", "single, `--max-model-len 20000`"),
        Part("run5_lmcache_pd16.json", "LMCache PD 1P1D (--max-model-len 20000)",
             "LMCache PD 1P1D, `--max-model-len 20000`", "run5_single16_mml20000.json"),
        Part("run5_single_neighbour.json", "single beside a decoding vLLM on the same GPU",
             "single beside a decoding vLLM, 16k @ 0.5 req/s (vs run 1's single alone)",
             "run1_single_vs_p2p.json#single"))),
    Run(6, "c607b7d", "2026-12-03", (
        Part("run6_detok_single.json", "single", "single"),
        Part("run6_detok_p2p.json", f"{P2P} (detokenizer's bounded context)", "1P1D, detokenizer's bounded context",
             "run6_detok_single.json"),
        Part("run6_busy_single.json", "single (decoding its own 256 tokens)",
             "single decoding 256 tokens of its own, 16k @ 0.5 req/s"),
        Part("run6_busy_p2p.json", f"{P2P}, decoder busy on the same GPU",
             "1P1D, decoder busy (256 out) on the same GPU, 16k @ 0.5 req/s", "run6_busy_single.json"))),
    Run(7, "4d57e00", "2026-12-03", (
        Part("run7_replay_single.json", "single", "single"),
        Part("run7_replay_p2p.json", f"{P2P} (first token replayed after the first byte)",
             "1P1D, first token replayed after the first byte", "run7_replay_single.json"))),
    Run(8, "3aae5b8", "2026-12-03", (
        Part("run8_owner_text_single.json", "single", "single"),
        Part("run8_owner_text_p2p.json", f"{P2P} (prefiller's first text, ids without offsets)",
             "1P1D, prefiller's first text, ids without offsets", "run8_owner_text_single.json"))),
    Run(9, "621dc56", "2026-12-03", (
        Part("run9_raw_body_single.json", "single", "single"),
        Part("run9_raw_body_p2p.json", f"{P2P} (ids once, the decode body's bytes passed on)",
             "1P1D, ids sent once, decode body passed on as bytes", "run9_raw_body_single.json"))),
    Run(10, "621dc56 + stamps/stamps.patch", "2026-12-03", (
        Part("run10_stamped_single.json", "single", "single"),
        Part("run10_stamped_p2p.json", f"{P2P} (run 9 + timing stamps)", "1P1D, run 9 + timing stamps",
             "run10_stamped_single.json"))),
    Run(11, "6a650a8 + stamps/stamps.patch", "2026-12-03", (
        Part("run11_text_check_single.json", "single", "single"),
        Part("run11_text_check_p2p.json", f"{P2P} (prefillers' /tokenize checked when up)",
             "1P1D, prefillers' `/tokenize` checked when up", "run11_text_check_single.json"))),
    Run(12, "42e5b33", "2026-12-04", (
        Part("run12_pieces_single.json", "single", "single"),
        Part("run12_pieces_p2p.json", f"{P2P} (prompt tokenized in pieces, the prefiller not asked for ids)",
             "1P1D, prompt tokenized in pieces on every core", "run12_pieces_single.json"))),
    Run(13, "dae677b", "2026-12-04", (
        Part("run13_async_store_single.json", "single", "single"),
        Part("run13_async_store_p2p.json", f"{P2P} (p2p.async_store: the engine does not wait for a store)",
             "1P1D, the engine no longer waits for a store (`p2p.async_store`)", "run13_async_store_single.json"))),
)
META_FILE = "run4_meta.json"
STORE_GATHER_FILE = "run4_store_gather.json"


class Source:
    """The study's raw files, from its archive or a folder."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._files: dict[str, Any] = {}
        if path.is_dir():
            self._files = {p.name: json.loads(p.read_text()) for p in path.glob("*.json")}
        else:
            with tarfile.open(path, "r:*") as tar:
                for member in tar.getmembers():
                    if member.isfile() and member.name.endswith(".json") and "/stamps/" not in member.name:
                        f = tar.extractfile(member)
                        if f is not None:
                            self._files[Path(member.name).name] = json.load(f)

    def read(self, name: str) -> Any:
        if name not in self._files:
            raise SystemExit(f"{self.path}: no {name} (bench/e2e_gpu_long.py RUNS names it)")
        return self._files[name]

    def rows(self, ref: str) -> dict[str, Any]:
        """A file's rows by key (``TOKENS@RATE``); ``name#system`` picks one system's rows of a list."""
        name, _, system = ref.partition("#")
        rows = self.read(name)["rows"]
        if isinstance(rows, list):
            return {r["point"]: r for r in rows if not system or r.get("system") == system}
        return rows


def engine(part: Mapping[str, Any]) -> dict[str, Any]:
    trace = ((part.get("prefill_trace") or {}).get("prefiller") or (part.get("prefill_trace") or {}).get("single")
             or {})
    return {"engine_ms_p50": trace.get("engine_ms_p50"), "engine_ms_mean": trace.get("engine_ms_mean"),
            "lmcache_store_ms_per_request": trace.get("store_ms_mean"),
            "gather_ms_per_request": trace.get("gather_ms_mean"), "gpu_gap_ms_per_request": trace.get("gpu_gap_ms_mean"),
            "stores_per_request": trace.get("stores_mean")}


def row(system: str, label: str, key: str, r: Mapping[str, Any], part: Mapping[str, Any],
        single: Mapping[str, Any] | None) -> dict[str, Any]:
    tokens, rest = key.split("@")
    rate, _, output = rest.partition("/")
    ttft = part["ttft_ms_p50"]
    ref = (single or {}).get(key, {}).get("ttft_ms_p50")
    out = {"system": system, "label": label, "prompt_tokens": int(tokens),
           "output_tokens": int(output or r.get("output_len") or 2), "rate": rate,
           "ttft_ms_p50": ttft, "ttft_ms_p99": part["ttft_ms_p99"],
           "prefill_side_overhead_vs_single_p50": None if ref is None or system == "single" else round(ttft / ref - 1, 4),
           "failed": part["failed"], "completed": part["completed"], **engine(part)}
    if part is r and system != "single":
        timeline = (r.get("proxy_stats") or {}).get("timeline_ms") or {}
        out.update(handover_ms_p50=r.get("handover_ms_p50"), handover_ms_p99=r.get("handover_ms_p99"),
                   kv_bytes_per_request=r.get("kv_bytes_per_request"), kv_transfer_ms_p50=r.get("kv_transfer_ms_p50"),
                   kv_transfer_ms_p99=r.get("kv_transfer_ms_p99"), kv_hit_ratio=r.get("kv_hit_ratio"),
                   kv_full_hits=r.get("kv_full_hits"), outputs_equal_single=r.get("outputs_equal_single"),
                   proxy_queue_ms_p50=(timeline.get("queue") or {}).get("p50"),
                   proxy_queue_ms_p99=(timeline.get("queue") or {}).get("p99"),
                   proxy_first_byte_ms_p50=(timeline.get("first_byte") or {}).get("p50"))
    return out


def build(source: Source) -> dict[str, Any]:
    """Rows in the table's order: per run, each single instance's group (it and the systems measured beside
    it), by prompt length, the single first."""
    keyed = []
    for run in RUNS:
        groups: list[str] = []
        for index, part in enumerate(run.parts):
            group = part.ref or part.file
            if group not in groups:
                groups.append(group)
            refs = source.rows(part.ref) if part.ref else None
            for key, r in source.rows(part.file).items():
                label = part.labels.get(key, part.label)
                tag = {"run": run.number, "commit": run.commit, "date": run.date, "file": part.file}
                first = row(part.system, label, key, r, r, refs)
                order = (run.number, groups.index(group), first["prompt_tokens"], first["rate"], index)
                keyed.append(((*order, 0), {**first, **tag}))
                if part.direct and r.get("direct_prefiller"):
                    direct = row(f"direct to the prefiller ({part.direct.split(', ', 1)[1]})", part.direct, key, r,
                                 r["direct_prefiller"], refs)
                    keyed.append(((*order, 1), {**direct, **tag}))
    rows = [r for _, r in sorted(keyed, key=lambda kr: kr[0])]
    return {"meta": source.read(META_FILE), "rows": rows, "store_gather": source.read(STORE_GATHER_FILE)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", type=Path, default=ARCHIVE)
    p.add_argument("--out", type=Path, default=RESULTS / "e2e_gpu_long.json")
    args = p.parse_args(argv)
    data = build(Source(args.source))
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    for r in data["rows"]:
        print(f"run {r['run']:>2} {r['label'][:58]:58} {r['prompt_tokens']:>6} {r['rate']:>4} {r['ttft_ms_p50']:>8} "
              f"{r['ttft_ms_p99']:>8} {r['prefill_side_overhead_vs_single_p50']!s:>8} {r.get('engine_ms_p50')!s:>8}")
    print(f"wrote {args.out}: {len(data['rows'])} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
