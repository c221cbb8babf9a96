"""LMCache's KV load on a step vLLM replays as a FULL CUDA graph (vLLM's V2 model runner).

LMCache's adapter (``LMCacheConnectorV1Impl.start_load_kv``) loads a step's KV only when the forward context it
is given carries attention metadata: without it the call returns and loads nothing. vLLM's V2 model runner calls
it, before it replays a FULL CUDA graph, outside the step's forward context, so vLLM makes an empty one with no
attention metadata. A FULL graph runs every batch of one new token per request (cudagraph_mode
FULL_AND_PIECEWISE, vLLM's default without ``--enforce-eager``): a decoder's first step for a prompt whose KV a
prefiller sent is such a step. The tokens LMCache promised at lookup are then counted as computed while their KV
blocks hold whatever was there before, and every token the decoder makes is wrong.

The load itself needs no attention metadata (it writes through each request's slot mapping into the KV caches
registered at start-up), so :func:`install` has ``start_load_kv`` load a step's promised KV with a forward context
that carries a marker where the attention metadata would be. A step that promises no load, and LMCache's async
loading (its loads are not made in this call), stay LMCache's own.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

ADAPTER_MODULE = "lmcache.integration.vllm.vllm_v1_adapter"  # LMCache's own vLLM adapter (vLLM's default)
_INSTALLED_ATTR = "_lmcache_p2p_full_graph_load"
_NOTED_ATTR = "_lmcache_p2p_full_graph_load_noted"  # on the adapter: the first such load was logged


class NoAttentionMetadata:
    """Stands where a FULL graph step's attention metadata would be: LMCache's load only checks that it exists.
    Any use of it beyond that fails loudly (no attribute) instead of loading with made-up metadata."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NoAttentionMetadata()"


NO_ATTENTION_METADATA = NoAttentionMetadata()


class LoadContext:
    """vLLM's forward context for LMCache's load, with :data:`NO_ATTENTION_METADATA` as its attention metadata;
    every other attribute is the context's own."""

    attn_metadata = NO_ATTENTION_METADATA

    def __init__(self, context: Any) -> None:
        self._context = context

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def promised_loads(adapter: Any) -> int:
    """Requests of this step whose KV LMCache's lookup promised to vLLM (``load_spec.can_load``)."""
    metadata = adapter._parent._get_connector_metadata()
    return sum(1 for request in getattr(metadata, "requests", ())
               if getattr(request, "load_spec", None) is not None and request.load_spec.can_load)


def needs_context(adapter: Any, forward_context: Any) -> int:
    """How many loads LMCache alone would skip in this call (0: it loads as it would by itself)."""
    if forward_context is None or getattr(forward_context, "attn_metadata", None) is not None:
        return 0
    if getattr(adapter, "async_loading", False) or getattr(adapter, "lmcache_engine", None) is None:
        return 0
    return promised_loads(adapter)


def install(adapter_cls: Any = None) -> Callable[[], None]:
    """Make LMCache's ``start_load_kv`` (default ``LMCacheConnectorV1Impl``'s) load a step's promised KV when vLLM
    gives it no attention metadata; returns the undo. A no-op (and a no-op undo) when this is already installed,
    or, by default, when no vLLM connector loaded LMCache's adapter in this process (it is loaded before the
    engine, and so before any backend, in a vLLM worker; importing it elsewhere would only cost start-up time)."""
    if adapter_cls is None:
        adapter_cls = getattr(sys.modules.get(ADAPTER_MODULE), "LMCacheConnectorV1Impl", None)
        if adapter_cls is None:
            logger.info("lmcache_p2p: no vLLM connector loaded LMCache's adapter in this process; nothing to load "
                        "on FULL CUDA graph steps")
            return lambda: None
    original = adapter_cls.__dict__.get("start_load_kv")
    if original is None or adapter_cls.__dict__.get(_INSTALLED_ATTR):
        return lambda: None

    @functools.wraps(original)
    def start_load_kv(self: Any, forward_context: Any, **kwargs: Any) -> Any:
        skipped = needs_context(self, forward_context)
        if skipped:
            if not getattr(self, _NOTED_ATTR, False):
                setattr(self, _NOTED_ATTR, True)
                logger.info("lmcache_p2p: a step with no attention metadata (vLLM's V2 model runner before a FULL "
                            "CUDA graph) loads the KV of %d request(s) that LMCache alone would skip", skipped)
            forward_context = LoadContext(forward_context)
        return original(self, forward_context, **kwargs)

    adapter_cls.start_load_kv = start_load_kv
    setattr(adapter_cls, _INSTALLED_ATTR, True)
    logger.info("lmcache_p2p: %s.start_load_kv loads a step's promised KV also without attention metadata "
                "(vLLM's V2 model runner gives none before it replays a FULL CUDA graph)", adapter_cls.__name__)

    def undo() -> None:
        adapter_cls.start_load_kv = original
        delattr(adapter_cls, _INSTALLED_ATTR)

    return undo
