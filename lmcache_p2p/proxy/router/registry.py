"""The live set of prefillers and decoders, and the load the proxy has put on each.

An instance announces itself once per TP rank (``Announce``, on start and every heartbeat); ranks
are aggregated by ``instance_id`` and the instance is routable once every rank has announced AND
its HTTP server is known healthy. It is forgotten after ``ttl_s`` without a heartbeat from any one
of its ranks. ``Goodbye`` drains it:
no new work, in-flight work finishes, then it is forgotten. Static instances (from flags) never
expire; an announced instance with the same role and HTTP URL takes their place while it is alive.
An instance registered by URL (:meth:`Registry.register`) announces nothing: it drains out the same
way when its registration carried a ``ttl_s`` and no registration renewed it within that time.

Health: the plugin announces before vLLM's HTTP server listens, so every new instance (static,
announced, restarted after a goodbye, or moved to another URL) starts :attr:`Health.PENDING`; a
probe (``router/health.py``, told through ``on_pending``) marks it :attr:`Health.UP` once ``GET /health``
answers 200. ``max_connect_failures`` failed connections in a row (``note_connect_failure``) take
an UP instance :attr:`Health.DOWN` and probing starts again. ``on_forgotten`` hears of every
instance the registry drops, so that whoever holds resources for it (probes, sockets) lets go.

Buffer credit (``router/credit.py``): a decoder announces its free receive slots every heartbeat; each
request routed there holds a :class:`Lease` (``router/lease.py``) whose commit counts against that credit until the
announcements reflect it. Every change that may free credit (a returned commit, a released lease, a
heartbeat, an instance coming up) is told to the ``on_credit`` listeners (the admission queue,
``router/admission.py``).

Pairing (``router/pairing.py``): :meth:`Registry.plugin_running` (a live announcement from every rank proves
the LMCache plugin runs; never a static entry) and :meth:`Registry.compatible` (both plugins run and
the KV fingerprints agree), each logged once.

The data of one instance lives in ``router/instances.py``; this module owns the set of them and every
change to it. It must not choose among instances (``router/routing.py``) or await.

Single-threaded (the event loop); nothing here awaits, listeners included.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from lmcache_p2p.config import Role
from lmcache_p2p.errors import ProtocolError, VersionError
from lmcache_p2p.protocol import PROTOCOL_VERSION, Announce, Goodbye
from lmcache_p2p.proxy.router.credit import Commit
from lmcache_p2p.proxy.router.lease import Lease
from lmcache_p2p.proxy.router.instances import (
    Backend,
    CreditCallback,
    Health,
    Instance,
    InstanceCallback,
    InstanceState,
    RankInfo,
    StaticInstance,
    registered_id,
    role_name,
)
from lmcache_p2p.proxy.router.pairing import PairingCheck

__all__ = ["Backend", "Commit", "Health", "Instance", "InstanceState", "Lease", "RankInfo", "Registry", "StaticInstance"]

logger = logging.getLogger(__name__)


class Registry:
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic, *,
                 max_connect_failures: int = 2) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._max_connect_failures = max_connect_failures
        self._dynamic: dict[str, Instance] = {}
        self._static: dict[tuple[Role, str], Instance] = {}
        self._drained: dict[str, float] = {}  # instance_id -> last heartbeat, for operator-drained ones
        self.on_pending: list[InstanceCallback] = []  # an instance needs a health probe
        self.on_forgotten: list[InstanceCallback] = []  # an instance was dropped from the registry
        self.on_announced: list[Callable[[Instance, int], None]] = []  # a rank of an instance announced itself
        self.on_credit: list[CreditCallback] = []  # decoder credit or load may have freed: admit waiters
        self._pairing = PairingCheck(ttl_s, clock)

    def now(self) -> float:
        return self._clock()

    # ---- changes -----------------------------------------------------------------------------

    def add_static(self, spec: StaticInstance) -> Instance:
        ranks = {
            r: RankInfo(r, control_port=c, transport_port=t)
            for r, (c, t) in enumerate(zip(spec.control_ports, spec.transport_ports))
        } or {0: RankInfo(0)}
        inst = Instance(
            instance_id=f"static-{spec.role.value}-{spec.http_url}",
            role=spec.role,
            http_url=spec.http_url,
            tp_size=spec.tp_size,
            control_host=spec.control_host,
            static=True,
            ranks=ranks,
        )
        self._static[(inst.role, inst.http_url)] = inst
        logger.info("static %s %s (tp %d)", role_name(inst.role), inst.http_url, inst.tp_size)
        self._notify(self.on_pending, inst)
        return inst

    def register(self, spec: StaticInstance, ttl_s: float | None = None) -> Instance:
        """An instance that cannot announce itself (``Backend.announces`` is False: vLLM's NixlConnector),
        registered by its URL (a flag or ``POST /instances/register``). It is probed like any other, polled
        for its KV capacity and liveness (``router/kv_metrics.py``); a drain forgets it once idle.

        ``ttl_s`` makes the registration a lease: unless registered again within ``ttl_s`` it expires
        (:meth:`evict_expired`: no new work, forgotten once its in-flight requests end), so a pod that died
        without draining leaves. Each registration refreshes it and sets its TTL; one without (a flag's) never
        expires. Registering again brings back one that is draining (drained or expired)."""
        instance_id = registered_id(spec.backend, spec.role, spec.http_url)
        self._drained.pop(instance_id, None)
        inst = self._dynamic.get(instance_id)
        if inst is None:
            inst = Instance(instance_id=instance_id, role=spec.role, http_url=spec.http_url, tp_size=1,
                            control_host=spec.control_host, ranks={0: RankInfo(0)}, backend=spec.backend)
            self._dynamic[instance_id] = inst
            logger.info("%s %s registered at %s (%s)", inst.role_name, instance_id, inst.http_url, spec.backend.value)
            self._set_pending(inst)
        elif inst.state is InstanceState.DRAINING:
            inst.state = InstanceState.ACTIVE
            logger.info("%s %s registered again: active", inst.role_name, instance_id)
        inst.registration_ttl_s = ttl_s
        inst.registered_until_s = math.inf if ttl_s is None else self.now() + ttl_s
        return inst

    def observe_capacity(self, inst: Instance, capacity_blocks: int, free_blocks: int, block_tokens: int) -> None:
        """A poll of a registered instance's ``/metrics`` (its KV cache, in blocks of ``block_tokens``): the
        announcement it cannot make itself."""
        rank = inst.ranks.setdefault(0, RankInfo(0))
        rank.capacity_slots, rank.free_slots, rank.chunk_tokens = capacity_blocks, free_blocks, block_tokens
        rank.last_seen_s = self.now()
        inst.absorb_commits()
        self._credit_changed()

    def announce(self, msg: Announce) -> Instance | None:
        """Add or refresh one rank; raises ProtocolError for an announce that cannot be used.

        None: the instance was drained by an operator and is ignored until it stops.
        """
        if msg.version != PROTOCOL_VERSION:
            raise VersionError(
                f"instance {msg.instance_id} speaks protocol {msg.version}, the proxy {PROTOCOL_VERSION}: "
                "run the same lmcache_p2p version everywhere"
            )
        if msg.instance_id in self._drained:
            self._drained[msg.instance_id] = self.now()
            return None
        role = _parse_role(msg)
        if not 0 <= msg.tp_rank < msg.tp_size:
            raise ProtocolError(f"instance {msg.instance_id}: tp_rank {msg.tp_rank} outside tp_size {msg.tp_size}")
        inst = self._dynamic.get(msg.instance_id)
        fresh = inst is None or inst.role is not role or inst.tp_size != msg.tp_size
        if fresh:
            if inst is not None:
                self._forget(inst, "announced again with another role or TP size")
            inst = self._new_instance(msg, role)
        http_url = msg.http_url.rstrip("/")
        moved = http_url != inst.http_url
        inst.http_url = http_url
        inst.control_host = msg.control_host or urlsplit(inst.http_url).hostname or ""
        inst.ranks[msg.tp_rank] = _rank_info(msg, self.now())
        restarted = self._return_from_goodbye(inst, msg.tp_rank)
        inst.absorb_commits()
        if fresh or moved or restarted:
            self._set_pending(inst)
        for listener in self.on_announced:
            listener(inst, msg.tp_rank)
        self._credit_changed()
        return inst

    def mark_up(self, inst: Instance) -> None:
        """Its GET /health answered 200: routable (once complete and active)."""
        inst.health = Health.UP
        inst.connect_failures = 0
        self._credit_changed()

    def note_connected(self, inst: Instance) -> None:
        inst.connect_failures = 0

    def note_connect_failure(self, inst: Instance) -> None:
        """A connection to its HTTP server failed (refused / connect timeout)."""
        inst.connect_failures += 1
        if inst.health is Health.UP and inst.connect_failures >= self._max_connect_failures:
            inst.health = Health.DOWN
            inst.forget_learned()
            logger.warning(
                "%s %s (%s): %d connection(s) in a row failed (--max-connect-failures): out of rotation until "
                "GET /health answers 200", role_name(inst.role), inst.instance_id, inst.http_url,
                inst.connect_failures,
            )
            self._notify(self.on_pending, inst)

    def goodbye(self, msg: Goodbye) -> Instance | None:
        inst = self._dynamic.get(msg.instance_id)
        if inst is None:
            return None
        inst.goodbye_ranks.add(msg.tp_rank)
        self._start_draining(inst, "said goodbye")
        return inst

    def drain(self, instance_id: str) -> Instance | None:
        """An operator takes an instance out of rotation before stopping it (``POST /instances/drain``).

        No new work goes to it; in-flight work finishes; then it is forgotten. Its heartbeats are
        ignored from then on, until they have been silent for the TTL (the process was stopped),
        so it does not come back by itself while it shuts down.
        """
        inst = self._dynamic.get(instance_id) or next(
            (i for i in self._static.values() if i.instance_id == instance_id), None)
        if inst is None:
            return None
        if not inst.static:
            self._drained[instance_id] = self.now()
        self._start_draining(inst, "drained by the operator")
        return inst

    def evict_expired(self) -> list[Instance]:
        """Forget instances with a rank silent for longer than the TTL; drain registrations past their own
        ``ttl_s`` (:meth:`register`). Called before routing and periodically (the proxy's sweep); returns those
        forgotten for missed heartbeats."""
        now = self.now()
        deadline = now - self._ttl_s
        for instance_id in [i for i, seen in self._drained.items() if seen < deadline]:
            del self._drained[instance_id]
        lapsed = [inst for inst in self._dynamic.values()
                  if inst.state is InstanceState.ACTIVE and inst.registered_until_s < now]
        for inst in lapsed:
            self._start_draining(inst, f"not registered again within its ttl_s {inst.registration_ttl_s:g} s",
                                 level=logging.WARNING)
        expired = [
            inst for inst in self._dynamic.values()
            if inst.backend.announces and any(r.last_seen_s < deadline for r in inst.ranks.values())
        ]
        for inst in expired:
            self._forget(inst, f"missed heartbeats for {self._ttl_s:.1f} s (--instance-ttl-s)",
                         level=logging.WARNING)
        return expired

    # ---- queries -----------------------------------------------------------------------------

    def routable(self, role: Role) -> list[Instance]:
        """Instances of ``role`` that may take new work, expired ones evicted first."""
        self.evict_expired()
        announced = {(inst.role, inst.http_url) for inst in self._dynamic.values()}
        dynamic = [i for i in self._dynamic.values() if i.role is role and i.routable]
        static = [i for key, i in self._static.items() if key[0] is role and key not in announced and i.routable]
        return dynamic + static

    def instances(self) -> list[Instance]:
        return list(self._dynamic.values()) + list(self._static.values())

    def lease(self, instance: Instance, tokens: int, chunks: int = 0) -> Lease:
        return Lease(self, instance, tokens, chunks)

    def plugin_running(self, inst: Instance) -> bool:
        """Does its LMCache plugin run (a live announcement from every rank)? See ``router/pairing.py``."""
        return self._pairing.plugin_running(inst)

    def compatible(self, prefiller: Instance, decoder: Instance) -> bool:
        """May ``prefiller``'s KV go to ``decoder``? Both plugins must run (:meth:`plugin_running`);
        unknown fingerprints count as compatible. A mismatch is logged once per pair."""
        return self._pairing.compatible(prefiller, decoder)

    # ---- internals ---------------------------------------------------------------------------

    def _new_instance(self, msg: Announce, role: Role) -> Instance:
        http_url = msg.http_url.rstrip("/")
        inst = Instance(instance_id=msg.instance_id, role=role, http_url=http_url, tp_size=msg.tp_size)
        self._dynamic[msg.instance_id] = inst
        logger.info("%s %s registered at %s (tp %d)", role_name(role), msg.instance_id, http_url, msg.tp_size)
        return inst

    def _return_from_goodbye(self, inst: Instance, tp_rank: int) -> bool:
        """A rank that said goodbye and announces again has restarted; all back: active again.

        True when ``tp_rank`` had said goodbye (its process restarted: probe its HTTP server again).
        """
        if tp_rank not in inst.goodbye_ranks:
            return False
        inst.goodbye_ranks.discard(tp_rank)
        if inst.state is InstanceState.DRAINING and not inst.goodbye_ranks:
            inst.state = InstanceState.ACTIVE
            logger.info("%s %s is back at %s", role_name(inst.role), inst.instance_id, inst.http_url)
        return True

    def _set_pending(self, inst: Instance) -> None:
        inst.health = Health.PENDING
        inst.connect_failures = 0
        inst.forget_learned()
        self._notify(self.on_pending, inst)

    def released(self, inst: Instance) -> None:
        """A lease on ``inst`` ended (``lease.Lease``): a draining instance may be done."""
        self._forget_if_drained(inst)

    def credit_changed(self) -> None:
        """Credit or load may have freed: the ``on_credit`` listeners (admission) look again."""
        self._credit_changed()

    def _credit_changed(self) -> None:
        for listener in self.on_credit:
            listener()

    def _start_draining(self, inst: Instance, why: str, level: int = logging.INFO) -> None:
        """No new work for ``inst`` (said once, with ``why``); a dynamic one is forgotten once its in-flight
        requests end (now, when it has none)."""
        if inst.state is InstanceState.ACTIVE:
            inst.state = InstanceState.DRAINING
            logger.log(level, "%s %s (%s) %s: no new work; %d in-flight request(s) finish first",
                       role_name(inst.role), inst.instance_id, inst.http_url, why, inst.inflight_requests)
        self._forget_if_drained(inst)

    def _forget_if_drained(self, inst: Instance) -> None:
        drained = inst.state is InstanceState.DRAINING and inst.inflight_requests == 0
        if drained and self._dynamic.get(inst.instance_id) is inst:
            self._forget(inst, "drained")

    def _forget(self, inst: Instance, why: str, level: int = logging.INFO) -> None:
        if self._dynamic.get(inst.instance_id) is inst:
            del self._dynamic[inst.instance_id]
        logger.log(level, "%s %s (%s) forgotten: %s; %d request(s) in flight", role_name(inst.role),
                   inst.instance_id, inst.http_url, why, inst.inflight_requests)
        self._pairing.forget(inst)
        self._notify(self.on_forgotten, inst)

    @staticmethod
    def _notify(listeners: list[InstanceCallback], inst: Instance) -> None:
        for listener in listeners:
            listener(inst)


def _parse_role(msg: Announce) -> Role:
    try:
        return Role(msg.role)
    except ValueError:
        raise ProtocolError(
            f"instance {msg.instance_id} announced role {msg.role!r}; expected sender or receiver"
        ) from None


def _rank_info(msg: Announce, now_s: float) -> RankInfo:
    return RankInfo(
        tp_rank=msg.tp_rank,
        control_port=msg.control_port,
        transport_port=msg.transport_port,
        capacity_slots=msg.capacity_slots,
        free_slots=msg.free_slots,
        slot_bytes=msg.slot_bytes,
        chunk_tokens=msg.chunk_tokens,
        last_seen_s=now_s,
        fingerprint=msg.fingerprint,
    )

