"""The slot state machine of the receive buffer (indexes only; the bytes live in ``memory.py``).

    FREE --reserve--> RESERVED --mark_ready--> READY --acquire--> LOADING --release--> FREE | CACHED
                          |                      |
                          |                      +--release / cancel / expire--> FREE
                          +--release / cancel / expire--> QUARANTINED --confirm / write window passed--> FREE
    CACHED --reserve (evicted: least recently used, unpinned, unread)--> RESERVED

With ``cache=True`` a slot the engine loaded (LOADING) whose chunk key is known
(``reserve(..., keys=...)``) is kept as CACHED when the engine lets it go, instead of FREE: it
holds that key's KV for any later request, until a reservation that finds no FREE slot evicts it.
A READY slot given up (its request cancelled, failed or expired before any load) is freed: the
cache holds only what the decoder actually used.
A CACHED slot has no owner and no writer (nothing writes it: its write completed). Requests that
rely on it ``pin`` it (a Grant that told a sender not to send the chunk; LMCache's lookup), the
engine ``read``s it (zero-copy view); a pinned or read slot is never evicted. Pins carry a
deadline: ``expire`` drops the ones past it, so a request that never comes back for its chunk
cannot hold a slot forever. A key maps to at most one CACHED slot: a second copy is freed.

A RESERVED slot was granted to a sender whose bytes have not landed: a write into it may still be
on the wire. Given up (cancel, sender gone, lease expiry), it is QUARANTINED, not FREE: it returns
to FREE only when its writer confirms that no more bytes can land (``confirm``: the Written of
that write arrived) or when its write window passed (``write_window_s`` after the grant, pushed
later by ``admit_write`` when a transport starts receiving into it). A READY slot holds landed
bytes and nothing writes it any more, so it is freed at once. Freed slots queue FIFO: the least
recently freed slot is granted first, so a freed slot is the last one to be handed out again.

Invariants (checked by ``check_invariants`` and the property tests):
  * every slot is in exactly one state; ``free_slots`` counts the FREE ones, each once, in the queue;
  * a RESERVED, READY or LOADING slot has exactly one owner, and the owner's slot set holds exactly
    its slots; FREE and QUARANTINED slots have no owner;
  * a RESERVED or QUARANTINED slot has a writer (the only peer whose write or confirmation counts);
    FREE, READY and LOADING slots have none;
  * RESERVED and READY slots carry a lease deadline; ``expire`` gives up the ones past it, so after
    any request ends, in any way, each of its slots is FREE within its lease plus the write window;
  * LOADING slots (the engine holds a reference) never expire: they are freed by ``release``;
  * ``reserve`` is all or nothing and never waits: a full pool raises :class:`BufferFull` at once;
  * a CACHED slot has a key, no owner and no writer, is the one slot of its key in the cache index
    and in the LRU order; only CACHED slots carry pins or readers; eviction takes only CACHED
    slots with neither; FREE and QUARANTINED slots have no key;
  * ``free_slots`` (the credit announced to the proxy) counts FREE slots plus evictable CACHED ones.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence

from lmcache_p2p.buffer.cache import Holder, Key, SlotCache
from lmcache_p2p.errors import BufferFull


class SlotState(enum.IntEnum):
    FREE = 0
    RESERVED = 1
    READY = 2
    LOADING = 3
    QUARANTINED = 4  # given up while a write into it may still land; not grantable yet
    CACHED = 5  # landed bytes of a known key, no owner: reusable by any request until evicted


Owner = Hashable
Writer = Hashable


class SlotPool:
    """Thread-safe bookkeeping of ``num_slots`` equal slots.

    ``write_window_s``: how long after its grant a write into a slot may still land (the sender's
    transfer deadline plus a margin); a given-up RESERVED slot stays QUARANTINED that long.
    ``cache``: keep landed slots of known keys as CACHED when let go (see the module docstring).
    """

    def __init__(self, num_slots: int, clock: Callable[[], float] = time.monotonic, *,
                 write_window_s: float = 0.0, cache: bool = False) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        if write_window_s < 0:
            raise ValueError(f"write_window_s must be >= 0, got {write_window_s}")
        self.num_slots = num_slots
        self.write_window_s = write_window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = [SlotState.FREE] * num_slots
        self._owner: list[Owner | None] = [None] * num_slots
        self._writer: list[Writer | None] = [None] * num_slots
        self._deadline = [0.0] * num_slots  # lease end (RESERVED, READY)
        self._write_until = [0.0] * num_slots  # until when a write may land (RESERVED, QUARANTINED)
        self._admitted = [False] * num_slots  # a transport started receiving the (one) write of this grant
        self._free: deque[int] = deque(range(num_slots))  # FIFO: popleft() gives the least recently freed
        self._by_owner: dict[Owner, set[int]] = {}
        self._reserved = 0  # slots granted whose bytes have not landed yet
        self._quarantined = 0
        self.cache = cache
        self._key: list[Key | None] = [None] * num_slots  # the chunk a slot holds or awaits (cache only)
        self._cache = SlotCache(num_slots)

    # ---- queries ----
    def now(self) -> float:
        """The pool's clock (leases and write windows are measured on it)."""
        return self._clock()

    @property
    def free_slots(self) -> int:
        """Slots a reservation can get now: FREE ones plus CACHED ones it may evict."""
        with self._lock:
            return self._available_locked()

    @property
    def cached_slots(self) -> int:
        """CACHED slots (evictable or not)."""
        return len(self._cache)

    def cached_slot(self, key: Key) -> int | None:
        """The CACHED slot holding ``key``, or None."""
        with self._lock:
            return self._cache.by_key.get(key)

    def pins(self, slot: int) -> list[Holder]:
        with self._lock:
            return [holder for holder, _ in self._cache.pins[slot]]

    def readers(self, slot: int) -> int:
        return self._cache.readers[slot]

    def key(self, slot: int) -> Key | None:
        return self._key[slot]

    @property
    def reserved_slots(self) -> int:
        """Slots granted to senders whose bytes have not landed yet (RESERVED)."""
        return self._reserved

    @property
    def quarantined_slots(self) -> int:
        """Slots given up while a write may still land (QUARANTINED); neither free nor owned."""
        return self._quarantined

    def state(self, slot: int) -> SlotState:
        return self._state[slot]

    def owner(self, slot: int) -> Owner | None:
        return self._owner[slot]

    def writer(self, slot: int) -> Writer | None:
        return self._writer[slot]

    def slots_of(self, owner: Owner) -> frozenset[int]:
        with self._lock:
            return frozenset(self._by_owner.get(owner, ()))

    # ---- transitions ----
    def reserve(self, owner: Owner, count: int, lease_s: float, writer: Writer | None = None,
                keys: Sequence[Key] | None = None) -> list[int]:
        """Reserve ``count`` slots for ``owner``, all or nothing; raise BufferFull without waiting.

        ``writer`` (default: ``owner``) is the peer whose write and confirmation count for them.
        ``keys`` (one per slot): the chunks they will hold, so that they can be CACHED once loaded.
        FREE slots go first (least recently freed first), then the least recently used CACHED
        slots that nobody pins or reads are evicted.
        """
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if keys is not None and len(keys) != count:
            raise ValueError(f"{len(keys)} keys for {count} slots")
        writer = owner if writer is None else writer
        with self._lock:
            available = self._available_locked()
            if count > available:
                raise _buffer_full(self, count, available)
            if count == 0:
                return []
            now = self._clock()
            slots = [self._free.popleft() for _ in range(min(count, len(self._free)))]
            slots += self._cache.evict(count - len(slots), self._key)
            self._reserved += count
            owned = self._by_owner.setdefault(owner, set())
            for i, s in enumerate(slots):
                self._key[s] = keys[i] if keys is not None else None
                self._state[s] = SlotState.RESERVED
                self._owner[s] = owner
                self._writer[s] = writer
                self._deadline[s] = now + lease_s
                self._write_until[s] = now + self.write_window_s
                self._admitted[s] = False
                owned.add(s)
            return slots

    def mark_ready(self, owner: Owner, slots: Iterable[int], lease_s: float,
                   writer: Writer | None = None) -> list[int]:
        """RESERVED -> READY for the slots still reserved by ``owner`` (and ``writer``, if given).

        Return the slots that were not (stale, quarantined, another's, out of range): unchanged.
        """
        stale = []
        with self._lock:
            deadline = self._clock() + lease_s
            for s in slots:
                if (self._in_range(s) and self._owner[s] == owner and self._state[s] == SlotState.RESERVED
                        and (writer is None or self._writer[s] == writer)):
                    self._state[s] = SlotState.READY
                    self._reserved -= 1
                    self._writer[s] = None
                    self._deadline[s] = deadline
                else:
                    stale.append(s)
        return stale

    def confirm(self, writer: Writer, slots: Iterable[int]) -> list[int]:
        """``writer``'s write into these slots completed: its QUARANTINED ones are FREE; return them."""
        freed = []
        with self._lock:
            for s in slots:
                if self._in_range(s) and self._state[s] == SlotState.QUARANTINED and self._writer[s] == writer:
                    self._quarantined -= 1
                    self._to_free_locked(s)
                    freed.append(s)
        return freed

    def admit_write(self, writer: Writer, slots: Iterable[int], until: float) -> list[int]:
        """A transport is about to receive ``writer``'s bytes into ``slots``, landing by ``until``.

        All or nothing: if every slot is RESERVED or QUARANTINED for ``writer`` and not admitted
        before (a grant is written once), extend their write windows to at least ``until`` (a
        quarantined slot stays so until then) and return []; otherwise change nothing and return
        the slots that may not be written.
        """
        slots = list(slots)
        with self._lock:
            refused = [s for s in slots if not (
                self._in_range(s) and self._writer[s] == writer and not self._admitted[s]
                and self._state[s] in (SlotState.RESERVED, SlotState.QUARANTINED))]
            if not refused and len(set(slots)) == len(slots):
                for s in slots:
                    self._admitted[s] = True
                    self._write_until[s] = max(self._write_until[s], until)
            elif not refused:
                refused = slots
        return refused

    def acquire(self, slot: int, owner: Owner) -> bool:
        """READY -> LOADING (the engine takes a reference); False if the slot is not READY for owner."""
        with self._lock:
            if not self._in_range(slot) or self._owner[slot] != owner or self._state[slot] != SlotState.READY:
                return False
            self._state[slot] = SlotState.LOADING
            return True

    def release(self, slots: Iterable[int]) -> None:
        """Give slots up: READY / LOADING -> FREE, RESERVED -> QUARANTINED (a write may still land)."""
        with self._lock:
            for s in slots:
                self._give_up_locked(s)

    def release_owner(self, owner: Owner, *, keep_loading: bool = True) -> list[int]:
        """Give up every slot of ``owner`` (cancel, peer gone); LOADING ones stay with the engine."""
        with self._lock:
            gone = [s for s in self._by_owner.get(owner, ())
                    if not (keep_loading and self._state[s] == SlotState.LOADING)]
            for s in gone:
                self._give_up_locked(s)
            return gone

    # ---- the cache (CACHED slots) ----
    def pin(self, key: Key, holder: Holder, lease_s: float) -> int | None:
        """Pin the CACHED slot of ``key`` for ``holder`` until ``lease_s`` from now; None if not cached."""
        with self._lock:
            s = self._cache.by_key.get(key)
            if s is not None:
                self._cache.pin(s, holder, self._clock() + lease_s)
            return s

    def unpin(self, slot: int, holder: Holder | None = None, *, not_holder: Holder | None = None) -> bool:
        """Drop one pin of ``slot``: ``holder``'s, or (None) the oldest one not held by ``not_holder``."""
        with self._lock:
            return self._in_range(slot) and self._cache.unpin(slot, holder, not_holder)

    def unpin_holder(self, holder: Holder, slots: Iterable[int]) -> int:
        """Drop every pin of ``holder`` on ``slots`` (a request that ends); return how many."""
        with self._lock:
            return self._cache.unpin_holder(holder, [s for s in set(slots) if self._in_range(s)])

    def read(self, key: Key) -> int | None:
        """The engine takes a reference on the CACHED slot of ``key`` (never evicted meanwhile)."""
        with self._lock:
            s = self._cache.by_key.get(key)
            if s is not None:
                self._cache.read(s)
            return s

    def unread(self, slot: int) -> None:
        """The engine dropped a reference taken by ``read``."""
        with self._lock:
            if self._in_range(slot) and self._state[slot] == SlotState.CACHED:
                self._cache.unread(slot)

    def expire(self) -> dict[Owner, list[int]]:
        """Give up RESERVED and READY slots whose lease passed (returned by owner); free
        QUARANTINED slots whose write window passed; drop pins past their deadline."""
        now = self._clock()
        expired: dict[Owner, list[int]] = {}
        # Only slots that can expire are visited: the receiver calls this often, in the engine's
        # process, and a scan of every slot under this lock (and the GIL) stalls the engine.
        with self._lock:
            self._cache.expire_pins(now)
            owned = [s for slots in self._by_owner.values() for s in slots]
            for s in sorted(owned):
                if self._state[s] in (SlotState.RESERVED, SlotState.READY) and self._deadline[s] <= now:
                    expired.setdefault(self._owner[s], []).append(s)
                    self._give_up_locked(s)
            if self._quarantined:
                for s in range(self.num_slots):
                    if self._state[s] == SlotState.QUARANTINED and self._write_until[s] <= now:
                        self._quarantined -= 1
                        self._to_free_locked(s)
        return expired

    # ---- internals ----
    def _in_range(self, s: int) -> bool:
        return isinstance(s, int) and 0 <= s < self.num_slots

    def _available_locked(self) -> int:
        return len(self._free) + self._cache.evictable

    def _give_up_locked(self, s: int) -> None:
        state = self._state[s]
        if state in (SlotState.FREE, SlotState.QUARANTINED, SlotState.CACHED):
            return
        self._drop_owner_locked(s)
        if state == SlotState.RESERVED:
            self._reserved -= 1
            if self._write_until[s] > self._clock():
                self._state[s] = SlotState.QUARANTINED
                self._quarantined += 1
                self._key[s] = None
                return
        elif (state == SlotState.LOADING and self.cache and self._key[s] is not None
              and self._key[s] not in self._cache.by_key):
            # Loaded: its bytes landed, nothing writes it, the engine used it (its owner is dropped above).
            self._state[s], self._writer[s] = SlotState.CACHED, None
            self._cache.add(s, self._key[s])
            return
        self._to_free_locked(s)

    def _drop_owner_locked(self, s: int) -> None:
        owner = self._owner[s]
        owned = self._by_owner.get(owner)
        if owned is not None:
            owned.discard(s)
            if not owned:
                del self._by_owner[owner]
        self._owner[s] = None

    def _to_free_locked(self, s: int) -> None:
        self._state[s] = SlotState.FREE
        self._owner[s] = None
        self._writer[s] = None
        self._key[s] = None
        self._free.append(s)

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by tests)."""
        with self._lock:
            _check_invariants(self)


def _buffer_full(pool: SlotPool, count: int, available: int) -> BufferFull:
    """Why ``count`` slots cannot be reserved now (``pool``'s lock held)."""
    pinned = len(pool._cache) - (available - len(pool._free))
    return BufferFull(
        f"receive buffer has {available} free of {pool.num_slots} slots, {count} needed"
        + (f" ({pool._quarantined} quarantined until their writes are confirmed)" if pool._quarantined else "")
        + (f" ({pinned} cached slots pinned by requests or loads)" if pinned else ""),
        needed_slots=count, free_slots=available, capacity_slots=pool.num_slots,
    )


def _check_invariants(pool: SlotPool) -> None:
    """The invariants of the module docstring, on ``pool``'s bookkeeping (its lock held)."""
    free = [s for s in range(pool.num_slots) if pool._state[s] == SlotState.FREE]
    assert sorted(free) == sorted(pool._free), "free list out of sync with states"
    assert len(set(pool._free)) == len(pool._free), "slot twice in the free list"
    owned: dict[Owner, set[int]] = {}
    for s in range(pool.num_slots):
        state = pool._state[s]
        if state in (SlotState.FREE, SlotState.QUARANTINED):
            assert pool._key[s] is None, f"{state.name} slot {s} has a key"
        if state in (SlotState.FREE, SlotState.QUARANTINED, SlotState.CACHED):
            assert pool._owner[s] is None, f"{state.name} slot {s} has an owner"
        else:
            assert pool._owner[s] is not None, f"slot {s} in use without owner"
            owned.setdefault(pool._owner[s], set()).add(s)
        has_writer = state in (SlotState.RESERVED, SlotState.QUARANTINED)
        assert (pool._writer[s] is not None) == has_writer, f"{state.name} slot {s}: writer {pool._writer[s]!r}"
    assert owned == pool._by_owner, "owner index out of sync"
    assert pool._state.count(SlotState.RESERVED) == pool._reserved, "reserved count out of sync"
    assert pool._state.count(SlotState.QUARANTINED) == pool._quarantined, "quarantined count out of sync"
    pool._cache.check([st == SlotState.CACHED for st in pool._state], pool._key)
    assert pool.cache or not pool._cache.by_key, "cached slots while the cache is off"
