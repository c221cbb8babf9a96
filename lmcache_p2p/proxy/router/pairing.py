"""May a prefiller's KV go to a decoder? The proof that both plugins run, and matching fingerprints.

Plugin proof: only an instance whose LMCache plugin runs may send or receive KV, and the plugin's
announcement (one per TP rank, renewed every heartbeat) is the proof. :meth:`PairingCheck.plugin_running`
holds for an instance with a live announcement (within the TTL) from each rank it announced (that
every TP rank announced is :attr:`Instance.complete`, part of being routable); never for a static
instance (it has no announcement of its own: an announced one takes its place while alive). An
instance without one may still serve a request alone (colocated); it is logged once.

Fingerprints: an instance announces its KV :class:`~lmcache_p2p.protocol.Fingerprint` (model, layers,
heads, dtype, chunk size, format, and its TP split: total KV heads, TP size and rank, MLA or not).
:meth:`PairingCheck.compatible` holds when both plugins run and, when both fingerprints are known,
every field but the split agrees and the two splits reconcile (``kv_layout.kv_mismatch``: same heads,
one TP size dividing the other); an announcement without one, from old or test peers, counts as
agreeing. A mismatched pair is logged once with the reason, naming both layouts; the router then
serves the request on one instance (``colocated_total{reason="no_compatible_decoder"}``).

Backends: a prefiller and a decoder pair only when they run the same one (``Instance.backend``); an
instance running vLLM's NixlConnector has no plugin and no fingerprint (it was registered as such).

Owns: these two checks and their logged-once memory. Must not: change instances, choose among
them (``router/routing.py``), or await.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from lmcache_p2p.kv_layout import kv_mismatch
from lmcache_p2p.protocol import Fingerprint
from lmcache_p2p.proxy.router.instances import Backend, Instance

logger = logging.getLogger(__name__)


class PairingCheck:
    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._mismatches: set[tuple[str, str, Fingerprint, Fingerprint]] = set()  # logged once each
        self._unplugged: set[str] = set()  # instance ids logged as running no plugin, once each

    def plugin_running(self, inst: Instance) -> bool:
        """Does its LMCache plugin run? Logged once per instance when it does not (again after it was
        seen running)."""
        if inst.backend is Backend.VLLM_NIXL:
            return True  # registered as running vLLM's NixlConnector: there is no plugin to announce it
        deadline = self._clock() - self._ttl_s
        running = not inst.static and bool(inst.ranks) and all(
            r.last_seen_s >= deadline for r in inst.ranks.values())
        if running:
            self._unplugged.discard(inst.instance_id)
        elif inst.instance_id not in self._unplugged:
            self._unplugged.add(inst.instance_id)
            logger.warning(
                "%s %s (%s) has no live announcement from its LMCache plugin on every TP rank (%s): it is never "
                "paired for disaggregated serving and serves requests alone; check that its server started the "
                "p2p backend and that p2p.proxy_url points at this proxy's --control-port", inst.role_name,
                inst.instance_id, inst.http_url, "a static instance from flags" if inst.static else "ranks silent")
        return running

    def compatible(self, prefiller: Instance, decoder: Instance) -> bool:
        """Both run the same backend, both plugins run and the fingerprints agree (unknown ones count as
        agreeing). A NixlConnector prefiller never pairs with a decoder of ours, nor the other way round: neither
        would understand the other's ``kv_transfer_params``."""
        if prefiller.backend is not decoder.backend:
            return False
        if not (self.plugin_running(prefiller) and self.plugin_running(decoder)):
            return False
        ours, theirs = prefiller.fingerprint, decoder.fingerprint
        if ours is None or theirs is None:
            return True
        mismatch = kv_mismatch(ours, theirs)
        if not mismatch:
            return True
        key = (prefiller.instance_id, decoder.instance_id, ours, theirs)
        if key not in self._mismatches:
            self._mismatches.add(key)
            logger.warning("prefiller %s and decoder %s are never paired: %s", prefiller.instance_id,
                           decoder.instance_id, mismatch)
        return False

    def forget(self, inst: Instance) -> None:
        """The instance left the registry: log anew about it should it come back."""
        self._mismatches = {k for k in self._mismatches if inst.instance_id not in k[:2]}
        self._unplugged.discard(inst.instance_id)
