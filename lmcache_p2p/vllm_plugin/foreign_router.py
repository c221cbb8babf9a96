"""Serving behind a foreign router (vllm-router): LMCache's scheduler side learns from the request
what our proxy would have told it (docs/ROUTERS.md).

Our proxy names the decoder in ``kv_transfer_params.disagg_spec`` and waits for KvReady before it sends
the decode (unless ``--early-decode``: then its decode carries the marker below). A foreign router does
neither, so (the prefiller's side with ``p2p.router_control_port_offset`` set; a decoder, ``role: receiver``,
reads the marker whatever its offset):

- prefiller (``update_state_after_alloc``, before the request's first forward): a request with no
  ``disagg_spec`` whose id names a decoder (``router_addressing.py``) gets the one our proxy would
  have sent, so LMCache hands our sender a ``transfer_spec`` and the KV is pushed while the prompt is
  prefilled, exactly as behind our proxy. Its response (``request_finished``) carries a marker
  naming the KV's key, which the router copies into the decode request;
- decoder (``get_num_new_matched_tokens``): a request with that marker is looked up over exactly the
  prompt the prefiller stored (the router sends the decoder that prompt alone; our proxy, with
  ``--early-decode``, sends prompt + first token and the same marker before the KV is ready, so the
  token after the stored prompt is left out of the lookup, as ``skip_last_n_tokens`` does for its
  decodes sent after KvReady), and, while the hit is short of that prompt, the scheduler is told to
  ask again on a later step (``None``: vLLM skips the request this step, the engine keeps serving the
  others), up to ``p2p.router_kv_timeout_s``; then it takes the hit it has and computes the rest. Only
  chunks that fully arrived ever count, so a late or failed transfer costs time, never a wrong token.
  A request asked again sooner than ``RETRY_PAUSE_S`` after its last ask (an engine with nothing else
  to run) first sleeps out the rest of that pause; a busy engine's steps get no sleep;
- every worker (``LMCacheEngine.lookup``): a lookup of a request id that still holds pins from an
  earlier lookup drops those first (LMCache overwrites its record of them, which would keep the
  chunks pinned in the receive buffer for good).

:func:`patch_adapter` and :func:`patch_cache_engine` run when LMCache imports those modules.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import types
from collections.abc import Callable
from typing import Any

from lmcache_p2p.config import P2PConfig, Role
from lmcache_p2p.errors import ConfigError
from lmcache_p2p.vllm_plugin.router_addressing import Marker, marker_of, spec_for

logger = logging.getLogger(__name__)

ADAPTER_CLASS = "LMCacheConnectorV1Impl"
ENGINE_CLASS = "LMCacheEngine"
# A skipped request is looked up again on the scheduler's next step. Asked again sooner than this after its
# last ask, the engine has nothing else to run: sleeping out the rest keeps it from spinning on the GIL that
# the receive thread needs, while a busy engine's steps (each longer than this) get no sleep.
RETRY_PAUSE_S = 0.001
_PATCHED_ATTR = "_lmcache_p2p_foreign_router_patched"
_STATE_ATTR = "_lmcache_p2p_router_state"


@dataclasses.dataclass
class Parked:
    """A decode waiting for the KV the prefiller announced (monotonic times)."""

    first_s: float  # its first lookup: ``p2p.router_kv_timeout_s`` counts from here
    asked_s: float  # its last lookup that told the scheduler to ask again


class RouterState:
    """One connector's view of foreign-router serving: its settings and the requests in progress."""

    def __init__(self, cfg: P2PConfig | None, own_tp: int) -> None:
        offset = cfg.router_control_port_offset if cfg is not None else None
        self.sender_offset = offset if cfg is not None and cfg.role is Role.SENDER else None
        self.decoder_tp = (cfg.router_decoder_tp_size or own_tp) if cfg is not None else own_tp
        self.receiver = cfg is not None and cfg.role is Role.RECEIVER
        self.timeout_s = cfg.router_kv_timeout_s if cfg is not None else 0.0
        self.sent: dict[str, Marker] = {}  # prefiller: engine request id -> its marker
        self.waiting: dict[str, Parked] = {}  # decoder: engine request id -> its wait so far


def state_of(connector: Any) -> RouterState:
    """The connector's state, made on first use from its LMCache config (no ``p2p`` section: nothing to do)."""
    state = getattr(connector, _STATE_ATTR, None)
    if state is None:
        try:
            cfg = P2PConfig.from_lmcache(getattr(connector, "config", None))
        except ConfigError:
            cfg = None  # not our plugin's engine (the start-up guard rejects a bad p2p section of ours)
        state = RouterState(cfg, int(getattr(connector, "worker_count", 1) or 1))
        setattr(connector, _STATE_ATTR, state)
    return state


def wrap_update_state_after_alloc(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def update_state_after_alloc(self: Any, request: Any, num_external_tokens: int) -> Any:
        state = state_of(self)
        if state.sender_offset is not None:
            address(request, state)
        return original(self, request, num_external_tokens)

    return update_state_after_alloc


def address(request: Any, state: RouterState) -> None:
    """Give a router-addressed request the disagg_spec our proxy would have sent (see the module docstring)."""
    if request.request_id in state.sent:
        return  # addressed already (the scheduler calls this again after a preemption)
    params = getattr(request, "kv_transfer_params", None)
    if isinstance(params, dict) and "disagg_spec" in params:
        return  # our proxy routed it
    spec = spec_for(request.request_id, state.sender_offset, state.decoder_tp)
    if spec is None:
        return
    request.kv_transfer_params = {**(params if isinstance(params, dict) else {}), "disagg_spec": spec}
    state.sent[request.request_id] = Marker(spec["req_id"], len(request.prompt_token_ids))


def wrap_request_finished(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def request_finished(self: Any, request: Any, block_ids: list[int]) -> Any:
        state = state_of(self)
        state.waiting.pop(request.request_id, None)
        marker = state.sent.pop(request.request_id, None)
        delay, params = original(self, request, block_ids)
        if marker is not None:
            params = {**(params or {}), **marker.as_params()}
        return delay, params

    return request_finished


def wrap_matched_tokens(original: Callable[..., Any], clock: Callable[[], float] = time.monotonic,
                        pause: Callable[[float], None] = time.sleep) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_num_new_matched_tokens(self: Any, request: Any, num_computed_tokens: int) -> Any:
        state = state_of(self)
        marker = marker_of(getattr(request, "kv_transfer_params", None), request.request_id) \
            if state.receiver else None
        if marker is None:
            return original(self, request, num_computed_tokens)
        return lookup_whole_prompt(self, original, request, num_computed_tokens, marker, state, clock, pause)

    setattr(get_num_new_matched_tokens, _PATCHED_ATTR, True)
    return get_num_new_matched_tokens


def lookup_whole_prompt(connector: Any, original: Callable[..., Any], request: Any, num_computed_tokens: int,
                        marker: Marker, state: RouterState, clock: Callable[[], float],
                        pause: Callable[[float], None]) -> Any:
    """LMCache's lookup over the prompt the prefiller stored; None (ask again later) while the KV it announced
    is still arriving, until ``p2p.router_kv_timeout_s``."""
    req_id = request.request_id
    parked = state.waiting.get(req_id)
    if parked is not None and (since_s := clock() - parked.asked_s) < RETRY_PAUSE_S:
        pause(RETRY_PAUSE_S - since_s)  # asked again at once: the engine has nothing else to run
    want = min(marker.prompt_tokens, len(request.prompt_token_ids))
    # the stored prompt's tokens alone: a token after it (our proxy's decode carries the first output token)
    # would key the partial last chunk differently and it could never hit
    skip, connector.skip_last_n_tokens = connector.skip_last_n_tokens, max(0, len(request.all_token_ids) - want)
    try:
        result = original(connector, request, num_computed_tokens)
    finally:
        connector.skip_last_n_tokens = skip
    if result is None:
        return None  # LMCache's own asynchronous lookup is still running
    client = connector.lookup_client
    hit = client.lookup_cache(lookup_id=req_id) if client is not None else -1
    now = clock()
    if parked is None:
        parked = state.waiting[req_id] = Parked(now, now)
    if hit < 0 or hit >= want:
        state.waiting.pop(req_id, None)
        return result
    if now - parked.first_s >= state.timeout_s:
        state.waiting.pop(req_id, None)
        logger.warning("request %s: %d of the %d prompt tokens the prefiller sent (%s) arrived within "
                       "p2p.router_kv_timeout_s (%gs): the decoder computes the rest", req_id, hit, want,
                       marker.key, state.timeout_s)
        return result
    client.clear_lookup_status(req_id)  # the next step looks it up again (its pins are dropped then)
    connector.load_specs.pop(req_id, None)
    parked.asked_s = now
    return None


def patch_adapter(module: types.ModuleType) -> bool:
    """Wrap the adapter's three scheduler-side calls (idempotent); False if the class is absent."""
    cls = getattr(module, ADAPTER_CLASS, None)
    if cls is None:
        logger.warning("%s.%s not found: lmcache_p2p cannot serve behind a foreign router", module.__name__,
                       ADAPTER_CLASS)
        return False
    if getattr(cls, _PATCHED_ATTR, False):
        return True
    cls.update_state_after_alloc = wrap_update_state_after_alloc(cls.update_state_after_alloc)
    cls.request_finished = wrap_request_finished(cls.request_finished)
    cls.get_num_new_matched_tokens = wrap_matched_tokens(cls.get_num_new_matched_tokens)
    setattr(cls, _PATCHED_ATTR, True)
    return True


def wrap_lookup(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def lookup(self: Any, *args: Any, **kwargs: Any) -> Any:
        lookup_id = kwargs.get("lookup_id")
        if kwargs.get("pin") and lookup_id is not None and lookup_id in getattr(self, "lookup_pins", {}):
            self.lookup_unpin(lookup_id)
        return original(self, *args, **kwargs)

    return lookup


def patch_cache_engine(module: types.ModuleType) -> bool:
    """Wrap ``LMCacheEngine.lookup`` (idempotent); False if the class is absent."""
    cls = getattr(module, ENGINE_CLASS, None)
    if cls is None or not hasattr(cls, "lookup"):
        logger.warning("%s.%s.lookup not found: a decoder's repeated lookups may leave chunks pinned",
                       module.__name__, ENGINE_CLASS)
        return False
    if getattr(cls.lookup, _PATCHED_ATTR, False):
        return True
    cls.lookup = wrap_lookup(cls.lookup)
    setattr(cls.lookup, _PATCHED_ATTR, True)
    return True
