"""The slot state machine of the receive buffer (indexes only; the bytes live in ``memory.py``).

    FREE --reserve--> RESERVED --mark_ready--> READY --acquire--> LOADING --release--> FREE
                          |                      |
                          +--cancel / expire-----+--> FREE

Invariants (checked by ``check_invariants`` and the property tests):
  * every slot is in exactly one state; ``free_slots`` counts the FREE ones;
  * a non-FREE slot has exactly one owner, and the owner's slot set holds exactly its slots;
  * RESERVED and READY slots carry a lease deadline; ``expire`` frees the ones past it, so after
    any request ends, in any way, each of its slots is FREE within its lease;
  * LOADING slots (the engine holds a reference) never expire: they are freed by ``release``;
  * ``reserve`` is all or nothing and never waits: a full pool raises :class:`BufferFull` at once.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Hashable, Iterable

from lmcache_p2p.errors import BufferFull


class SlotState(enum.IntEnum):
    FREE = 0
    RESERVED = 1
    READY = 2
    LOADING = 3


Owner = Hashable


class SlotPool:
    """Thread-safe bookkeeping of ``num_slots`` equal slots."""

    def __init__(self, num_slots: int, clock: Callable[[], float] = time.monotonic) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self._clock = clock
        self._lock = threading.Lock()
        self._state = [SlotState.FREE] * num_slots
        self._owner: list[Owner | None] = [None] * num_slots
        self._deadline = [0.0] * num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # a stack: pop() gives slot 0 first
        self._by_owner: dict[Owner, set[int]] = {}
        self._reserved = 0  # slots granted whose bytes have not landed yet

    # ---- queries ----
    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def reserved_slots(self) -> int:
        """Slots granted to senders whose bytes have not landed yet (RESERVED)."""
        return self._reserved

    def state(self, slot: int) -> SlotState:
        return self._state[slot]

    def owner(self, slot: int) -> Owner | None:
        return self._owner[slot]

    def slots_of(self, owner: Owner) -> frozenset[int]:
        with self._lock:
            return frozenset(self._by_owner.get(owner, ()))

    # ---- transitions ----
    def reserve(self, owner: Owner, count: int, lease_s: float) -> list[int]:
        """Reserve ``count`` slots for ``owner``, all or nothing; raise BufferFull without waiting."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        with self._lock:
            if count > len(self._free):
                raise BufferFull(
                    f"receive buffer has {len(self._free)} free of {self.num_slots} slots, {count} needed",
                    needed_slots=count, free_slots=len(self._free), capacity_slots=self.num_slots,
                )
            if count == 0:
                return []
            deadline = self._clock() + lease_s
            slots = [self._free.pop() for _ in range(count)]
            self._reserved += count
            owned = self._by_owner.setdefault(owner, set())
            for s in slots:
                self._state[s] = SlotState.RESERVED
                self._owner[s] = owner
                self._deadline[s] = deadline
                owned.add(s)
            return slots

    def mark_ready(self, owner: Owner, slots: Iterable[int], lease_s: float) -> list[int]:
        """RESERVED -> READY for the slots still reserved by ``owner``; return those that were not."""
        stale = []
        with self._lock:
            deadline = self._clock() + lease_s
            for s in slots:
                if 0 <= s < self.num_slots and self._owner[s] == owner and self._state[s] == SlotState.RESERVED:
                    self._state[s] = SlotState.READY
                    self._reserved -= 1
                    self._deadline[s] = deadline
                else:
                    stale.append(s)
        return stale

    def acquire(self, slot: int, owner: Owner) -> bool:
        """READY -> LOADING (the engine takes a reference); False if the slot is not READY for owner."""
        with self._lock:
            if self._owner[slot] != owner or self._state[slot] != SlotState.READY:
                return False
            self._state[slot] = SlotState.LOADING
            return True

    def release(self, slots: Iterable[int]) -> None:
        """Any state -> FREE (the engine dropped its reference, or the owner gave the slot up)."""
        with self._lock:
            for s in slots:
                self._free_locked(s)

    def release_owner(self, owner: Owner, *, keep_loading: bool = True) -> list[int]:
        """Free every slot of ``owner`` (cancel, peer gone); LOADING ones stay with the engine."""
        with self._lock:
            freed = [s for s in self._by_owner.get(owner, ())
                     if not (keep_loading and self._state[s] == SlotState.LOADING)]
            for s in freed:
                self._free_locked(s)
            return freed

    def expire(self) -> dict[Owner, list[int]]:
        """Free RESERVED and READY slots whose lease passed; return them by owner."""
        now = self._clock()
        expired: dict[Owner, list[int]] = {}
        with self._lock:
            for s in range(self.num_slots):
                if self._state[s] in (SlotState.RESERVED, SlotState.READY) and self._deadline[s] <= now:
                    expired.setdefault(self._owner[s], []).append(s)
                    self._free_locked(s)
        return expired

    def _free_locked(self, s: int) -> None:
        if self._state[s] == SlotState.FREE:
            return
        if self._state[s] == SlotState.RESERVED:
            self._reserved -= 1
        owner = self._owner[s]
        owned = self._by_owner.get(owner)
        if owned is not None:
            owned.discard(s)
            if not owned:
                del self._by_owner[owner]
        self._state[s] = SlotState.FREE
        self._owner[s] = None
        self._free.append(s)

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by tests)."""
        with self._lock:
            free = [s for s in range(self.num_slots) if self._state[s] == SlotState.FREE]
            assert sorted(free) == sorted(self._free), "free list out of sync with states"
            assert len(set(self._free)) == len(self._free), "slot twice in the free list"
            owned: dict[Owner, set[int]] = {}
            for s in range(self.num_slots):
                if self._state[s] != SlotState.FREE:
                    assert self._owner[s] is not None, f"slot {s} in use without owner"
                    owned.setdefault(self._owner[s], set()).add(s)
                else:
                    assert self._owner[s] is None, f"free slot {s} has an owner"
            assert owned == self._by_owner, "owner index out of sync"
            reserved = sum(1 for st in self._state if st == SlotState.RESERVED)
            assert reserved == self._reserved, "reserved count out of sync"
