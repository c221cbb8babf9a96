"""The cached half of the slot pool: CACHED slots by key, their LRU order, pins and readers.

A CACHED slot holds the landed bytes of a known key and has no owner. Requests that rely on it
pin it (with a deadline), the engine reads it (a reference); a slot with either is *busy* and
never evicted. Eviction takes the least recently used slots that are not busy.

Not thread-safe: :class:`~lmcache_p2p.buffer.pool.SlotPool` calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

Key = Hashable
Holder = Hashable


class SlotCache:
    """CACHED slots of a pool of ``num_slots``: the key index, LRU order, pins, readers, busy count."""

    def __init__(self, num_slots: int) -> None:
        self.by_key: dict[Key, int] = {}  # key -> its CACHED slot
        self.lru: OrderedDict[int, None] = OrderedDict()  # CACHED slots, least recently used first
        self.pins: list[list[tuple[Holder, float]]] = [[] for _ in range(num_slots)]  # (holder, until)
        self.readers = [0] * num_slots  # engine references handed out by ``read``
        self.busy = 0  # CACHED slots pinned or read (not evictable)

    def __len__(self) -> int:
        return len(self.by_key)

    @property
    def evictable(self) -> int:
        return len(self.by_key) - self.busy

    def is_busy(self, s: int) -> bool:
        return bool(self.pins[s]) or self.readers[s] > 0

    def add(self, s: int, key: Key) -> None:
        self.by_key[key] = s
        self.lru[s] = None

    def evict(self, count: int, key_of: list[Key | None]) -> list[int]:
        """Take ``count`` least recently used evictable slots out of the cache (``key_of[s]`` cleared)."""
        victims = []
        for s in self.lru:
            if len(victims) == count:
                break
            if not self.is_busy(s):
                victims.append(s)
        for s in victims:
            del self.lru[s]
            del self.by_key[key_of[s]]
            key_of[s] = None
        return victims

    def pin(self, s: int, holder: Holder, until: float) -> None:
        busy = self.is_busy(s)
        self.pins[s].append((holder, until))
        self.lru.move_to_end(s)
        self.busy += not busy

    def unpin(self, s: int, holder: Holder | None, not_holder: Holder | None) -> bool:
        """Drop one pin of ``s``: ``holder``'s, or (None) the oldest one not held by ``not_holder``."""
        pins = self.pins[s]
        for i, (h, _) in enumerate(pins):
            if (h == holder) if holder is not None else (h != not_holder):
                del pins[i]
                self.busy -= not self.is_busy(s)
                return True
        return False

    def unpin_holder(self, holder: Holder, slots: Iterable[int]) -> int:
        """Drop every pin of ``holder`` on ``slots``; return how many."""
        dropped = 0
        for s in slots:
            if self.pins[s]:
                before = len(self.pins[s])
                self.pins[s] = [p for p in self.pins[s] if p[0] != holder]
                dropped += before - len(self.pins[s])
                self.busy -= not self.is_busy(s)
        return dropped

    def read(self, s: int) -> None:
        self.busy += not self.is_busy(s)
        self.readers[s] += 1
        self.lru.move_to_end(s)

    def unread(self, s: int) -> None:
        if self.readers[s] > 0:
            self.readers[s] -= 1
            self.busy -= not self.is_busy(s)

    def expire_pins(self, now: float) -> None:
        """Drop the pins past their deadline (only busy slots can hold any)."""
        if not self.busy:
            return
        for s in self.by_key.values():
            if self.pins[s]:
                self.pins[s] = [p for p in self.pins[s] if p[1] > now]
                self.busy -= not self.is_busy(s)

    def check(self, cached: list[bool], key_of: list[Key | None]) -> None:
        """AssertionError unless exactly the ``cached`` slots are indexed, ordered, and alone pinned or read."""
        for s, is_cached in enumerate(cached):
            assert is_cached == (s in self.lru), f"slot {s}: LRU membership wrong"
            assert is_cached or (not self.pins[s] and not self.readers[s]), f"slot {s} pinned or read, not cached"
            if is_cached:
                assert key_of[s] is not None and self.by_key.get(key_of[s]) == s, f"cached slot {s} unindexed"
        assert len(self.by_key) == len(self.lru), "cache index and LRU order out of sync"
        busy = sum(1 for s in self.lru if self.is_busy(s))
        assert busy == self.busy, f"busy cached count {self.busy} but {busy} pinned or read"
