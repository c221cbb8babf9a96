"""The live set of prefillers and decoders, and the load the proxy has put on each.

An instance announces itself once per TP rank (``Announce``, on start and every heartbeat); ranks
are aggregated by ``instance_id`` and the instance is routable once every rank has announced AND
its HTTP server is known healthy. It is forgotten after ``ttl_s`` without a heartbeat from any one
of its ranks. ``Goodbye`` drains it:
no new work, in-flight work finishes, then it is forgotten. Static instances (from flags) never
expire; an announced instance with the same role and HTTP URL takes their place while it is alive.

Health: the plugin announces before vLLM's HTTP server listens, so every new instance (static,
announced, restarted after a goodbye, or moved to another URL) starts :attr:`Health.PENDING`; a
probe (``health.py``, told through ``on_pending``) marks it :attr:`Health.UP` once ``GET /health``
answers 200. ``max_connect_failures`` failed connections in a row (``note_connect_failure``) take
an UP instance :attr:`Health.DOWN` and probing starts again. ``on_forgotten`` hears of every
instance the registry drops, so that whoever holds resources for it (probes, sockets) lets go.

Buffer credit: a decoder announces its free receive slots (``free_slots``, every heartbeat). The
proxy keeps a :class:`Commit` per request it routed there, and a decoder's credit is
``announced free slots - promised + returned``:

* promised: a commit still counts against the credit until every rank's announcement holds it, i.e.
  a heartbeat from every rank arrived after its KV settled (ready: every slot it takes is reserved).
* returned: once the decoder no longer holds the request's KV (the decode loaded it: its first
  output arrived; the proxy cancelled it; it failed) the commit is returned (:meth:`Lease.return_credit`)
  and, while the announcements are older than that, its slots count as free again at once.
* a returned commit is forgotten once a heartbeat from every rank arrived after it was returned.

Errors lean towards too little credit (a commit that was partly reserved counts twice until the
next heartbeat), with one exception: a heartbeat taken by the decoder between its loading the KV and
the proxy seeing the first output counts those slots free twice until the next heartbeat; the
receiver then refuses with ``full`` and the sender retries (``alloc_timeout_s``), nothing fails.
Every change that may free credit (a returned commit, a released lease, a heartbeat, an instance
coming up) is told to the ``on_credit`` listeners (the admission queue, ``admission.py``).

Plugin proof: only an instance whose LMCache plugin runs may send or receive KV, and the plugin's
announcement (one per TP rank, renewed every heartbeat) is the proof. :meth:`Registry.plugin_running`
holds for an instance with a live announcement (within ``ttl_s``) from every rank; never for a
static instance (it has no announcement of its own: an announced one takes its place while alive).
An instance without one may still serve a request alone (colocated); it is logged once.

Fingerprints: an instance announces its KV :class:`~lmcache_p2p.protocol.Fingerprint` (model, layers,
heads, dtype, chunk size, TP split, layout). :meth:`Registry.compatible` says whether a prefiller's KV
may go to a decoder: both plugins run and, when both fingerprints are known, they agree (an
announcement without one, from old or test peers, counts as agreeing). A mismatched pair is
logged once with the fields that differ.

Single-threaded (the event loop); nothing here awaits, listeners included.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from lmcache_p2p.config import Role
from lmcache_p2p.errors import ProtocolError, VersionError
from lmcache_p2p.protocol import PROTOCOL_VERSION, Announce, Fingerprint, Goodbye

logger = logging.getLogger(__name__)


class InstanceState(str, enum.Enum):
    ACTIVE = "active"
    DRAINING = "draining"


class Health(str, enum.Enum):
    PENDING = "pending"  # not seen healthy since it (re)appeared: its GET /health is being probed
    UP = "up"  # GET /health answered 200 and connections since succeeded
    DOWN = "down"  # --max-connect-failures connections in a row failed: probed until healthy again


InstanceCallback = Callable[["Instance"], None]
CreditCallback = Callable[[], None]


@dataclasses.dataclass(frozen=True)
class StaticInstance:
    """An instance named by a flag (``--prefill`` / ``--decode``, see ``settings.py``)."""

    role: Role
    http_url: str
    control_host: str = ""
    control_ports: tuple[int, ...] = ()
    transport_ports: tuple[int, ...] = ()

    @property
    def tp_size(self) -> int:
        return max(1, len(self.control_ports))


@dataclasses.dataclass
class RankInfo:
    tp_rank: int
    control_port: int = 0
    transport_port: int = 0
    capacity_slots: int = 0
    free_slots: int = 0
    slot_bytes: int = 0
    chunk_tokens: int = 0
    last_seen_s: float = math.inf
    fingerprint: Fingerprint | None = None


@dataclasses.dataclass(eq=False)
class Commit:
    """Receive slots the proxy promised one request on one decoder."""

    chunks: int
    settled_at_s: float | None = None  # the KV is ready (every slot reserved) or failed
    returned_at_s: float | None = None  # the decoder no longer holds it: loaded, cancelled or failed


@dataclasses.dataclass(eq=False)
class Instance:
    instance_id: str
    role: Role
    http_url: str
    tp_size: int
    control_host: str = ""
    static: bool = False
    ranks: dict[int, RankInfo] = dataclasses.field(default_factory=dict)
    state: InstanceState = InstanceState.ACTIVE
    goodbye_ranks: set[int] = dataclasses.field(default_factory=set)
    health: Health = Health.PENDING
    connect_failures: int = 0  # in a row
    inflight_requests: int = 0
    inflight_tokens: int = 0
    commits: list[Commit] = dataclasses.field(default_factory=list)

    @property
    def complete(self) -> bool:
        """Every TP rank announced (and, for a decoder, said where its receiver listens)."""
        if len(self.ranks) < self.tp_size or any(r not in self.ranks for r in range(self.tp_size)):
            return False
        if self.role is Role.RECEIVER:
            return bool(self.control_host) and all(
                self.ranks[r].control_port > 0 and self.ranks[r].transport_port > 0 for r in range(self.tp_size)
            )
        return True

    @property
    def routable(self) -> bool:
        return self.state is InstanceState.ACTIVE and self.complete and self.health is Health.UP

    @property
    def role_name(self) -> str:
        return _role_name(self.role)

    @property
    def control_ports(self) -> list[int]:
        return [self.ranks[r].control_port for r in range(self.tp_size)]

    @property
    def transport_ports(self) -> list[int]:
        return [self.ranks[r].transport_port for r in range(self.tp_size)]

    @property
    def chunk_tokens(self) -> int:
        """Tokens per KV chunk (0 when unknown)."""
        return max((r.chunk_tokens for r in self.ranks.values()), default=0)

    @property
    def capacity_slots(self) -> int | None:
        """The smallest rank buffer, in chunks; None when not announced (static decoders)."""
        known = [r.capacity_slots for r in self.ranks.values() if r.capacity_slots > 0]
        return min(known) if known and len(known) == len(self.ranks) else None

    @property
    def fingerprint(self) -> Fingerprint | None:
        """What its KV means (rank 0's; ranks differ only in ``tp_rank``); None when not announced."""
        first = self.ranks.get(0) or next(iter(self.ranks.values()), None)
        return first.fingerprint if first is not None else None

    def free_slots(self) -> int | None:
        """Buffer credit: announced free slots - promised + returned since (see the module doc); None
        when unknown."""
        if self.capacity_slots is None:
            return None
        oldest_s = min(r.last_seen_s for r in self.ranks.values())
        newest_s = max(r.last_seen_s for r in self.ranks.values())
        free = min(r.free_slots for r in self.ranks.values())
        for c in self.commits:
            announced_held = c.settled_at_s is not None and c.settled_at_s < oldest_s
            if c.returned_at_s is None and not announced_held:
                free -= c.chunks
            elif c.returned_at_s is not None and announced_held and c.returned_at_s > newest_s:
                free += c.chunks
        return free

    def _absorb_commits(self) -> None:
        """Forget returned commits that every rank's announcement already reflects."""
        heard_s = min((r.last_seen_s for r in self.ranks.values()), default=-math.inf)
        self.commits = [c for c in self.commits if c.returned_at_s is None or c.returned_at_s >= heard_s]


class Lease:
    """One request's claim on one instance: in-flight load and, on a decoder, buffer credit."""

    def __init__(self, registry: Registry, instance: Instance, tokens: int, chunks: int) -> None:
        self.instance = instance
        self._registry = registry
        self._tokens = tokens
        self._commit = Commit(chunks) if chunks > 0 else None
        self._released = False
        instance.inflight_requests += 1
        instance.inflight_tokens += tokens
        if self._commit is not None:
            instance.commits.append(self._commit)

    @property
    def chunks(self) -> int:
        """Receive slots this lease promised (0: no KV comes with it)."""
        return self._commit.chunks if self._commit is not None else 0

    def resize_commit(self, chunks: int) -> None:
        """Replace the estimate with the exact chunk count once the prompt is tokenized."""
        if self._commit is not None and self._commit.settled_at_s is None and self._commit.returned_at_s is None:
            shrank = chunks < self._commit.chunks
            self._commit.chunks = chunks
            if shrank:  # the estimate was high: credit frees
                self._registry._credit_changed()

    def settle(self) -> None:
        """The request's KV is ready or failed: the decoder's next heartbeat accounts for it."""
        if self._commit is not None and self._commit.settled_at_s is None:
            self._commit.settled_at_s = self._registry.now()

    def return_credit(self) -> None:
        """The decoder no longer holds this request's KV (loaded, cancelled or failed): its slots are
        free again. Idempotent; does not await."""
        commit = self._commit
        if commit is None or commit.returned_at_s is not None:
            return
        commit.returned_at_s = self._registry.now()
        self.instance._absorb_commits()
        self._registry._credit_changed()

    def release(self) -> None:
        """Idempotent; safe inside a cancelled task (does not await). Returns the credit too."""
        if self._released:
            return
        self._released = True
        if self._commit is not None and self._commit.returned_at_s is None:
            self._commit.returned_at_s = self._registry.now()
        self.instance._absorb_commits()
        self.instance.inflight_requests -= 1
        self.instance.inflight_tokens -= self._tokens
        self._registry._on_release(self.instance)
        self._registry._credit_changed()

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


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
        self.on_credit: list[CreditCallback] = []  # decoder credit or load may have freed: admit waiters
        self._mismatches: set[tuple[str, str, Fingerprint, Fingerprint]] = set()  # logged once each
        self._unplugged: set[str] = set()  # instance ids logged as running no plugin, once each

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
        logger.info("static %s %s (tp %d)", _role_name(inst.role), inst.http_url, inst.tp_size)
        self._notify(self.on_pending, inst)
        return inst

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
        inst._absorb_commits()
        if fresh or moved or restarted:
            self._set_pending(inst)
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
            logger.warning(
                "%s %s (%s): %d connection(s) in a row failed (--max-connect-failures): out of rotation until "
                "GET /health answers 200", _role_name(inst.role), inst.instance_id, inst.http_url,
                inst.connect_failures,
            )
            self._notify(self.on_pending, inst)

    def goodbye(self, msg: Goodbye) -> Instance | None:
        inst = self._dynamic.get(msg.instance_id)
        if inst is None:
            return None
        inst.goodbye_ranks.add(msg.tp_rank)
        if inst.state is InstanceState.ACTIVE:
            inst.state = InstanceState.DRAINING
            logger.info(
                "%s %s (%s) said goodbye: draining %d in-flight request(s)",
                _role_name(inst.role), inst.instance_id, inst.http_url, inst.inflight_requests,
            )
        self._forget_if_drained(inst)
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
        if inst.state is InstanceState.ACTIVE:
            inst.state = InstanceState.DRAINING
            logger.info("%s %s (%s) drained by the operator: %d in-flight request(s) finish first",
                        _role_name(inst.role), inst.instance_id, inst.http_url, inst.inflight_requests)
        if not inst.static:
            self._drained[instance_id] = self.now()
            self._forget_if_drained(inst)
        return inst

    def evict_expired(self) -> list[Instance]:
        """Forget instances with a rank silent for longer than the TTL."""
        deadline = self.now() - self._ttl_s
        for instance_id in [i for i, seen in self._drained.items() if seen < deadline]:
            del self._drained[instance_id]
        expired = [
            inst for inst in self._dynamic.values() if any(r.last_seen_s < deadline for r in inst.ranks.values())
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
        """Does its LMCache plugin run? A live announcement (within the TTL) from each rank it announced
        proves it (that every TP rank announced is ``routable``'s part, see :attr:`Instance.complete`).

        Logged once per instance when it does not (again after it was seen running).
        """
        deadline = self.now() - self._ttl_s
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
        """May ``prefiller``'s KV go to ``decoder``? Both plugins must run (:meth:`plugin_running`);
        unknown fingerprints count as compatible.

        A mismatch is logged once per pair (and fingerprints) with the fields that differ.
        """
        if not (self.plugin_running(prefiller) and self.plugin_running(decoder)):
            return False
        ours, theirs = prefiller.fingerprint, decoder.fingerprint
        if ours is None or theirs is None:
            return True
        differences = ours.differences(theirs, ignore=("tp_rank",))
        if not differences:
            return True
        key = (prefiller.instance_id, decoder.instance_id, ours, theirs)
        if key not in self._mismatches:
            self._mismatches.add(key)
            logger.warning("prefiller %s and decoder %s announce different KV fingerprints (%s): they are never "
                           "paired; run the same model, dtype, chunk size and TP size on both",
                           prefiller.instance_id, decoder.instance_id, "; ".join(differences))
        return False

    # ---- internals ---------------------------------------------------------------------------

    def _new_instance(self, msg: Announce, role: Role) -> Instance:
        http_url = msg.http_url.rstrip("/")
        inst = Instance(instance_id=msg.instance_id, role=role, http_url=http_url, tp_size=msg.tp_size)
        self._dynamic[msg.instance_id] = inst
        logger.info("%s %s registered at %s (tp %d)", _role_name(role), msg.instance_id, http_url, msg.tp_size)
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
            logger.info("%s %s is back at %s", _role_name(inst.role), inst.instance_id, inst.http_url)
        return True

    def _set_pending(self, inst: Instance) -> None:
        inst.health = Health.PENDING
        inst.connect_failures = 0
        self._notify(self.on_pending, inst)

    def _on_release(self, inst: Instance) -> None:
        self._forget_if_drained(inst)

    def _credit_changed(self) -> None:
        for listener in self.on_credit:
            listener()

    def _forget_if_drained(self, inst: Instance) -> None:
        drained = inst.state is InstanceState.DRAINING and inst.inflight_requests == 0
        if drained and self._dynamic.get(inst.instance_id) is inst:
            self._forget(inst, "drained")

    def _forget(self, inst: Instance, why: str, level: int = logging.INFO) -> None:
        if self._dynamic.get(inst.instance_id) is inst:
            del self._dynamic[inst.instance_id]
        logger.log(level, "%s %s (%s) forgotten: %s; %d request(s) in flight", _role_name(inst.role),
                   inst.instance_id, inst.http_url, why, inst.inflight_requests)
        self._mismatches = {k for k in self._mismatches if inst.instance_id not in k[:2]}
        self._unplugged.discard(inst.instance_id)
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


def _role_name(role: Role) -> str:
    return "prefiller" if role is Role.SENDER else "decoder"
