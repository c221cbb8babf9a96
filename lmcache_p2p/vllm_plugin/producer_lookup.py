"""Skip LMCache's per-request lookup on a prefiller whose only store is our SenderBackend.

LMCache 0.5.6's scheduler side (``LMCacheConnectorV1Impl.get_num_new_matched_tokens``) means to
skip the lookup on a ``kv_producer`` whose lookup client does not support producer reuse, but it
tests ``hasattr(lookup_client, "supports_producer_reuse")``, which every client has. So each
prefill request pays a synchronous ZMQ round trip from the engine core to the worker's lookup
server, which hashes the prompt and asks every backend (pinning nothing, since nothing is there),
plus an INFO log line, all before the request is scheduled: dead work on the TTFT path.

On a prefiller whose LMCache holds nothing it could serve (no LocalCPUBackend cache, no disk,
remote, GDS, NIXL-storage, PD or P2P backend, and every storage plugin our ``SenderBackend``,
which answers every lookup with a miss), the lookup cannot hit: we return 0 at once, exactly as
LMCache's own producer path does (no load spec is recorded, so ``update_state_after_alloc`` loads
nothing). Any other configuration keeps LMCache's lookup.

:func:`patch_adapter` is applied by the vLLM plugin (:mod:`lmcache_p2p.vllm_plugin`) right after
LMCache's vLLM adapter module is imported; nothing here imports lmcache.
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

ADAPTER_MODULE = "lmcache.integration.vllm.vllm_v1_adapter"
ADAPTER_CLASS = "LMCacheConnectorV1Impl"
SENDER_MODULE = "lmcache_p2p.backend"
SENDER_CLASS = "SenderBackend"
_PATCHED_ATTR = "_lmcache_p2p_producer_lookup_patched"
_DECISION_ATTR = "_lmcache_p2p_skip_lookup"
# LMCacheEngineConfig fields that, when set, create a backend that could serve a lookup.
_CACHE_FIELDS = ("local_cpu", "local_disk", "remote_url", "gds_path", "maru_path", "enable_pd", "enable_p2p",
                 "remote_storage_plugins")


def lookup_cannot_hit(kv_role: str | None, config: Any) -> bool:
    """True when ``config`` (an LMCacheEngineConfig) on a ``kv_producer`` stores only to our sender."""
    if kv_role != "kv_producer" or config is None:
        return False
    if any(getattr(config, name, None) for name in _CACHE_FIELDS):
        return False
    extra: Mapping[str, Any] = getattr(config, "extra_config", None) or {}
    if extra.get("enable_nixl_storage"):
        return False
    plugins = list(getattr(config, "storage_plugins", None) or [])
    return bool(plugins) and all(
        extra.get(f"storage_plugin.{name}.module_path") == SENDER_MODULE
        and extra.get(f"storage_plugin.{name}.class_name") == SENDER_CLASS
        for name in plugins
    )


def wrap_matched_tokens(original: Callable[..., Any]) -> Callable[..., Any]:
    """``get_num_new_matched_tokens`` that answers 0 without a lookup where none can hit."""

    @functools.wraps(original)
    def get_num_new_matched_tokens(self: Any, request: Any, num_computed_tokens: int) -> Any:
        skip = getattr(self, _DECISION_ATTR, None)
        if skip is None:
            skip = lookup_cannot_hit(getattr(self, "kv_role", None), getattr(self, "config", None))
            setattr(self, _DECISION_ATTR, skip)
            if skip:
                logger.info("LMCache lookups skipped on this prefiller: its only store is lmcache_p2p's "
                            "SenderBackend, which holds nothing to hit")
        if skip:
            return 0
        return original(self, request, num_computed_tokens)

    setattr(get_num_new_matched_tokens, _PATCHED_ATTR, True)
    return get_num_new_matched_tokens


def patch_adapter(module: types.ModuleType) -> bool:
    """Wrap the adapter class's ``get_num_new_matched_tokens`` (idempotent); False if it is absent."""
    cls = getattr(module, ADAPTER_CLASS, None)
    original = getattr(cls, "get_num_new_matched_tokens", None)
    if cls is None or original is None:
        logger.warning("%s.%s.get_num_new_matched_tokens not found: prefiller lookups are not skipped",
                       ADAPTER_MODULE, ADAPTER_CLASS)
        return False
    if getattr(original, _PATCHED_ATTR, False):
        return True
    cls.get_num_new_matched_tokens = wrap_matched_tokens(original)
    return True
