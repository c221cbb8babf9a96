"""``bench/e2e_gpu.py``'s ``vllm-nixl-lmcache-mp`` system: LMCache's multi-process PD recipe behind our proxy.

``lmcache-p2p launch --connector nixl-lmcache-mp`` as a user starts it (its own process; stopped with SIGTERM):
each instance runs vLLM's MultiConnector of NixlConnector (the prefill -> decode handoff, KV in VRAM) and
LMCacheMPConnector, beside its own ``lmcache server`` (L1 of ``--lmcache-l1-size`` in host memory); our proxy in
front names both by URL and drives vLLM's two-stage flow (its ``vllm-nixl`` backend). Prefiller on GPU 0, decoder
on GPU 1 (``--one-gpu``: both on GPU 0, ``launch --gpus 0,0 --share-gpus``, each half of
``--gpu-memory-utilization``). Rows carry our proxy's /stats (handover, KV wait); the decoder's KV hit ratio stays
empty (LMCache MP logs no per-request lookup line of LMCacheConnectorV1's kind).

Its LMCache servers import what neither the bundle nor the GPU image has (blake3, cryptography, OpenTelemetry):
``scripts/gpu_prepare.sh`` puts the wheels in build/gpu-kit/wheels, ``scripts/gpu_pass.sh`` installs them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmcache_p2p.cli.connectors import Connector
from lmcache_p2p.cli.processes import Child

SYSTEM = "vllm-nixl-lmcache-mp"
CONNECTOR = Connector.NIXL_LMCACHE_MP
REPO = Path(__file__).resolve().parents[1]


def launch_argv(cfg: Any, log_dir: Path, proxy_port: int, startup_timeout_s: float,
                python: str = sys.executable) -> list[str]:
    """The launcher's command: 1P1D with every flag a system of the pass shares (model, lengths, GPU share, no
    prefix caching, the vLLM flags after ``--``) and none of our plugin's (refused with a vLLM connector)."""
    return [python, "-m", "lmcache_p2p.cli.main", "launch", "--connector", CONNECTOR.value, "--device", cfg.device,
            "--prefill", "1", "--decode", "1", "--model", str(cfg.model), "--log-dir", str(log_dir),
            "--max-model-len", str(cfg.max_model_len), "--gpu-memory-utilization", f"{cfg.gpu_memory_utilization:.2f}",
            "--proxy-port", str(proxy_port), "--proxy-control-port", str(proxy_port + 1),
            "--lmcache-l1-size", cfg.lmcache_l1_size, "--on-exit", "stop", "--startup-timeout-s",
            str(int(startup_timeout_s)),
            *(["--proxy-workers", str(cfg.proxy_workers)] if cfg.proxy_workers and cfg.proxy_workers > 1 else []),
            *(["--gpus", "0,0", "--share-gpus"] if cfg.one_gpu else []),
            "--no-prefix-caching", "--", "--no-enable-prefix-caching", *cfg.vllm_args]


def start(cfg: Any, startup_timeout_s: float, stop_grace_s: float, proxy_port: int,
          instances: tuple[tuple[str, int], ...], make_deployment: Callable[..., Any],
          wait_registered: Callable[[Child, str, float], None]) -> Any:
    """Start the launcher; ``make_deployment(system, url, stop, decoder_log, has_stats, instances)`` builds
    e2e_gpu's Deployment once ``wait_registered`` saw both instances routable at the proxy."""
    log_dir = cfg.log_dir / SYSTEM
    log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    launcher = Child(f"launch-{CONNECTOR.value}", launch_argv(cfg, log_dir, proxy_port, startup_timeout_s), env,
                     log_dir / "launch.log", f"http://127.0.0.1:{proxy_port}/health")
    launcher.start()
    url = f"http://127.0.0.1:{proxy_port}"
    deployment = make_deployment(SYSTEM, url, lambda: launcher.stop(stop_grace_s), None, True, instances)
    try:
        wait_registered(launcher, url, startup_timeout_s)
    except BaseException:
        deployment.stop()
        raise
    return deployment
