"""The receiver's chunk index: which keys the engine can load now, and the pins LMCache's lookups hold.

A key is served from a request's own READY chunk first (oldest first), else from the buffer
cache (a CACHED slot, read by reference: never evicted while the engine holds it). LMCache's
lookup pins what it counted (``count_ready(pin=True)``) and unpins each key after its retrieve;
a cached hit gets a *lookup pin* on its slot, which replaces the pin a Grant placed on it for
the request this lookup serves.

Not thread-safe: the receive service calls every method under its lock.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from lmcache_p2p import protocol
from lmcache_p2p.backend.receiver_counters import Counters
from lmcache_p2p.buffer import SlotPool

LOOKUP = "lookup"  # the pin holder of LMCache's lookups (pin ... unpin around a retrieve)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A READY chunk: where it is and what LMCache needs to rebuild its MemoryObj."""

    req_id: str  # "" for a chunk read from the cache
    slot: int
    shape: protocol.ChunkShape
    cached: bool = False  # read from the cache (a read reference), not a request's own slot


def _dec(counts: dict[str, int], key: str) -> None:
    """One less of ``key`` (forgotten at 0)."""
    if counts[key] <= 1:
        del counts[key]
    else:
        counts[key] -= 1


class ChunkIndex:
    """READY chunks by key, what each slot's last grant holds, and the lookup pins and claims."""

    def __init__(self, pool: SlotPool, ready_lease_s: float, counters: Counters) -> None:
        self._pool = pool
        self._ready_lease_s = ready_lease_s
        self._counters = counters
        self.ready: dict[str, deque[Chunk]] = {}  # READY chunks by key, oldest first
        self.slot_meta: dict[int, tuple[str, protocol.ChunkShape]] = {}  # slot -> what its last grant holds
        self.lookup_pins: dict[str, int] = {}  # key -> lookup pins we placed on its cached slot
        # key -> hits counted by pinning lookups whose unpin has not come (LMCache unpins every key its
        # lookup counted, READY or cached): a lookup pin stays while more claims than pins remain.
        self.lookup_claims: dict[str, int] = {}

    def count_ready(self, keys: list[str], pin: bool = False) -> int:
        """How many of ``keys``, as a prefix, have a READY chunk (a request's own, or cached).

        ``pin`` (LMCache's lookup): each cached hit gets a lookup pin until :meth:`unpin`, and one
        pin a Grant placed on it (the request this lookup serves) is dropped.
        """
        hits = 0
        for key in keys:
            if self.ready.get(key):
                hits += 1
                if pin:
                    self.lookup_claims[key] = self.lookup_claims.get(key, 0) + 1
                continue
            slot = self._pool.cached_slot(key)
            if slot is None:
                break
            hits += 1
            if pin:
                self.lookup_claims[key] = self.lookup_claims.get(key, 0) + 1
                self._pool.pin(key, LOOKUP, self._ready_lease_s)
                self._pool.unpin(slot, not_holder=LOOKUP)
                self.lookup_pins[key] = self.lookup_pins.get(key, 0) + 1
        return hits

    def unpin(self, key: str) -> None:
        """LMCache released one lookup's claim on ``key`` (after its retrieve). Lookup pins are
        dropped only down to the claims still open: the unpin of a lookup that counted ``key`` as a
        READY chunk (no pin) never drops the pin of a later lookup that found it cached."""
        claims = self.lookup_claims.get(key, 0)
        if not claims:
            return
        _dec(self.lookup_claims, key)
        pins = self.lookup_pins.get(key, 0)
        if pins <= claims - 1:
            return
        _dec(self.lookup_pins, key)
        slot = self._pool.cached_slot(key)
        if slot is not None:
            self._pool.unpin(slot, LOOKUP)

    def take(self, key: str) -> Chunk | None:
        """One READY chunk of ``key`` for the engine: a request's own (READY -> LOADING) first,
        else the cached one (a read reference); None if there is none."""
        queue = self.ready.get(key)
        while queue:
            chunk = queue.popleft()
            if not queue:
                del self.ready[key]
            if self._pool.acquire(chunk.slot, chunk.req_id):
                return chunk
        slot = self._pool.read(key)
        if slot is None:
            return None
        self._counters.chunks_loaded_from_cache += 1
        return Chunk("", slot, self.slot_meta[slot][1], cached=True)

    def granted(self, slot: int, key: str, shape: protocol.ChunkShape) -> None:
        """``slot`` was granted for ``key``: what it will hold once written (also once cached)."""
        self.slot_meta[slot] = (key, shape)

    def shape_of(self, slot: int) -> protocol.ChunkShape | None:
        return self.slot_meta.get(slot, ("", None))[1]

    def landed(self, req_id: str, slot: int, key: str, shape: protocol.ChunkShape) -> None:
        self.ready.setdefault(key, deque()).append(Chunk(req_id, slot, shape))

    def drop(self, req_id: str, slot: int, key: str) -> None:
        """Forget ``req_id``'s READY chunk of ``key`` in ``slot`` (given up before the engine took it)."""
        queue = self.ready.get(key)
        if queue:
            remaining = deque(c for c in queue if not (c.req_id == req_id and c.slot == slot))
            if remaining:
                self.ready[key] = remaining
            else:
                del self.ready[key]
