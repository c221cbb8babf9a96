"""Make LMCache's connector factory return our CPU connector when vLLM runs on CPU.

LMCache's vLLM service factory does ``from lmcache.v1.gpu_connector import CreateGPUConnector`` at
engine creation, so replacing that module attribute is enough. lmcache must NOT be imported while
vLLM loads plugins, so :func:`install` only arms an import hook (:mod:`lmcache_p2p.import_hooks`);
the attribute is wrapped right after ``lmcache.v1.gpu_connector`` is first imported (or at once, if
it already was). The wrapper returns
:class:`~lmcache_p2p.cpu_connector.connector.CPUPagedKVConnector` only for vLLM engines on a
CPU-only LMCache device; every other call goes to LMCache's original factory.
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable
from typing import Any

from lmcache_p2p.import_hooks import patch_on_import

logger = logging.getLogger(__name__)

TARGET_MODULE = "lmcache.v1.gpu_connector"
_PATCHED_ATTR = "_lmcache_p2p_cpu_connector_patched"


def install() -> None:
    """Make LMCache's ``CreateGPUConnector`` return the CPU connector for vLLM (idempotent)."""
    patch_on_import(TARGET_MODULE, _patch)


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
