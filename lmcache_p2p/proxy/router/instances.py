"""What the proxy knows of one prefiller or decoder: its ranks, its state and health, its load.

Owns the data of an instance (:class:`Instance`, one :class:`RankInfo` per TP rank as it last
announced, :class:`StaticInstance` from flags) and what follows from that data alone (complete,
routable, chunk size, capacity, credit through ``router/credit.py``), and its load: the requests it
holds and their commits against its credit (``hold`` / ``return_credit`` / ``release``, called by a
``router/lease.py`` Lease alone).
Must not: add, forget or change instances (that is ``router/registry.py``'s), log, or await.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable

from lmcache_p2p.config import Role
from lmcache_p2p.protocol import Fingerprint
from lmcache_p2p.proxy.router import credit
from lmcache_p2p.proxy.router.credit import Commit

class Backend(str, enum.Enum):
    """How an instance moves KV (``flow/backends.py`` holds what each means for a request).

    A prefiller and a decoder are paired only when they run the same one."""

    LMCACHE_P2P = "lmcache_p2p"  # LMCache with our plugin: announces itself, KV pushed into the decoder's buffer
    VLLM_NIXL = "vllm-nixl"  # vLLM's own NixlConnector: registered by URL, the decoder pulls the prefiller's KV

    @property
    def announces(self) -> bool:
        """Its ranks announce themselves (buffer credit, liveness) on the control port; else the proxy polls
        its ``/metrics`` for both (``router/kv_metrics.py``)."""
        return self is Backend.LMCACHE_P2P


class InstanceState(str, enum.Enum):
    ACTIVE = "active"
    DRAINING = "draining"


class Health(str, enum.Enum):
    PENDING = "pending"  # not seen healthy since it (re)appeared: its GET /health is being probed
    UP = "up"  # GET /health answered 200 and connections since succeeded
    DOWN = "down"  # --max-connect-failures connections in a row failed: probed until healthy again


InstanceCallback = Callable[["Instance"], None]
CreditCallback = Callable[[], None]

__all__ = ["Backend", "Commit", "CreditCallback", "Health", "Instance", "InstanceCallback", "InstanceState", "RankInfo",
           "StaticInstance", "role_name"]


@dataclasses.dataclass(frozen=True)
class StaticInstance:
    """An instance named by a flag (``--prefill`` / ``--decode``, see ``settings.py``)."""

    role: Role
    http_url: str
    control_host: str = ""
    control_ports: tuple[int, ...] = ()
    transport_ports: tuple[int, ...] = ()
    backend: Backend = Backend.LMCACHE_P2P

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
    # its vLLM makes text with the proxy's tokenizer (its /tokenize agreed when it came up, or an answer of it
    # had text), so an empty first text of it is the token's own (vLLM started with --skip-tokenizer-init
    # answers "" for every token); unlearned when it may have restarted
    makes_text: bool = False
    # a vLLM NixlPushConnector prefiller (an answer of it said ``transfer_mode: push``): a chat prefill on it
    # goes as a completion of the prompt's ids (``flow/backends.py``); unlearned when it may have restarted
    pushes_kv: bool = False
    inflight_requests: int = 0
    inflight_tokens: int = 0
    commits: list[Commit] = dataclasses.field(default_factory=list)
    backend: Backend = Backend.LMCACHE_P2P
    # registered by URL with a TTL (``Registry.register``): it expires unless registered again by
    # ``registered_until_s``; None (a flag's registration, an announced instance) never expires so
    registration_ttl_s: float | None = None
    registered_until_s: float = math.inf

    def forget_learned(self) -> None:
        """Forget what its answers taught (it may come back restarted, with other flags)."""
        self.makes_text = False
        self.pushes_kv = False

    @property
    def complete(self) -> bool:
        """Every TP rank announced (and, for a decoder, said where its receiver listens)."""
        if len(self.ranks) < self.tp_size or any(r not in self.ranks for r in range(self.tp_size)):
            return False
        if self.role is Role.RECEIVER and self.backend is Backend.LMCACHE_P2P:
            return bool(self.control_host) and all(
                self.ranks[r].control_port > 0 and self.ranks[r].transport_port > 0 for r in range(self.tp_size)
            )
        return True

    @property
    def routable(self) -> bool:
        return self.state is InstanceState.ACTIVE and self.complete and self.health is Health.UP

    @property
    def role_name(self) -> str:
        return role_name(self.role)

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
        """Buffer credit: announced free slots - promised + returned since (see ``router/credit.py``); None
        when unknown."""
        if self.capacity_slots is None:
            return None
        return credit.free_slots(list(self.ranks.values()), self.commits)

    # ---- its load: one request's hold, from ``hold`` to ``release`` (a ``router/lease.py`` Lease) ----

    def hold(self, tokens: int, chunks: int) -> Commit | None:
        """Count one more request here; on a decoder its KV's ``chunks`` receive slots count against the credit
        (the commit returned; None when no KV comes). Undone by :meth:`release`."""
        self.inflight_requests += 1
        self.inflight_tokens += tokens
        if chunks <= 0:
            return None
        commit = Commit(chunks)
        self.commits.append(commit)
        return commit

    def return_credit(self, commit: Commit, now_s: float) -> bool:
        """The decoder no longer holds the KV of ``commit``: it stops counting against the credit. True when
        this changed the credit (False: returned already)."""
        if commit.returned_at_s is not None:
            return False
        commit.returned_at_s = now_s
        self.absorb_commits()
        return True

    def release(self, tokens: int, commit: Commit | None, now_s: float) -> None:
        """The request of ``hold(tokens, ...)`` is over here; its commit is returned if it was not."""
        if commit is not None and commit.returned_at_s is None:
            commit.returned_at_s = now_s
        self.absorb_commits()
        self.inflight_requests -= 1
        self.inflight_tokens -= tokens

    def absorb_commits(self) -> None:
        """Forget returned commits that every rank's announcement already reflects."""
        self.commits = credit.unabsorbed(list(self.ranks.values()), self.commits)


def role_name(role: Role) -> str:
    return "prefiller" if role is Role.SENDER else "decoder"


def registered_id(backend: Backend, role: Role, http_url: str) -> str:
    """The id of an instance registered by URL (``Registry.register``): it announces no name of its own."""
    return f"{backend.value}-{role_name(role)}-{http_url}"
