"""buffer.pool: the slot state machine keeps its invariants under any sequence of operations."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmcache_p2p.buffer import SlotPool, SlotState
from lmcache_p2p.errors import BufferFull


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_full_pool_refuses_at_once_and_reserves_nothing():
    pool = SlotPool(4)
    pool.reserve("a", 3, lease_s=10)
    with pytest.raises(BufferFull) as info:
        pool.reserve("b", 2, lease_s=10)
    assert (info.value.needed_slots, info.value.free_slots, info.value.capacity_slots) == (2, 1, 4)
    assert pool.free_slots == 1 and not pool.slots_of("b")
    pool.check_invariants()


def test_lifecycle_and_expiry():
    clock = Clock()
    pool = SlotPool(3, clock=clock)
    a = pool.reserve("a", 2, lease_s=5)
    assert pool.mark_ready("a", a, lease_s=10) == []
    assert pool.acquire(a[0], "a") and not pool.acquire(a[0], "a")
    assert pool.state(a[0]) is SlotState.LOADING
    clock.now = 100
    assert pool.expire() == {"a": [a[1]]}  # the READY one; LOADING never expires
    assert pool.state(a[0]) is SlotState.LOADING
    pool.release([a[0]])
    assert pool.free_slots == 3
    pool.check_invariants()


class CountingList(list):
    """A list that counts element reads (how many slots an operation looked at)."""

    reads = 0

    def __getitem__(self, index):
        CountingList.reads += 1
        return super().__getitem__(index)


def test_expire_looks_only_at_slots_in_use():
    """The receiver expires leases every 50 ms on the decoder's engine process: with a few slots
    in use, expire must not walk the whole pool (8192 slots took ~5 ms, holding the GIL and the
    pool lock against the engine's lookups and loads); it must still expire what is due."""
    clock = Clock()
    pool = SlotPool(100_000, clock=clock, write_window_s=1.0, cache=True)
    a = pool.reserve("a", 2, lease_s=5)
    b = pool.reserve("b", 1, lease_s=50, keys=["k"])
    pool.mark_ready("b", b, lease_s=50)
    pool.acquire(b[0], "b")
    pool.release(b)  # loaded: CACHED
    pool.pin("k", "h", lease_s=5)
    pool._state = CountingList(pool._state)
    CountingList.reads = 0
    clock.now = 10
    assert pool.expire() == {"a": a}
    assert CountingList.reads < 100
    assert pool.pins(b[0]) == []
    assert all(pool.state(s) is SlotState.FREE for s in a)  # their write window (1 s) had passed
    pool.check_invariants()


def test_stale_ready_marks_are_reported():
    pool = SlotPool(1)  # no write window: a given-up slot is FREE at once
    (s,) = pool.reserve("a", 1, lease_s=5)
    pool.release_owner("a")
    assert pool.reserve("b", 1, lease_s=5) == [s]
    assert pool.mark_ready("a", [s, 99], lease_s=5) == [s, 99]  # slot now belongs to b; 99 out of range
    assert pool.state(s) is SlotState.RESERVED and pool.owner(s) == "b"


def test_free_list_is_fifo_least_recently_freed_first():
    pool = SlotPool(4)
    a = pool.reserve("a", 2, lease_s=5)
    assert a == [0, 1]
    pool.mark_ready("a", a, lease_s=5)
    pool.release([0])
    # 2 and 3 were freed before 0: they go first, the slot just freed goes last.
    assert pool.reserve("b", 3, lease_s=5) == [2, 3, 0]
    pool.check_invariants()


@pytest.mark.parametrize("give_up", ["release", "release_owner", "expire"])
def test_given_up_reserved_slot_is_quarantined_until_its_write_window_passes(give_up):
    clock = Clock()
    pool = SlotPool(2, clock=clock, write_window_s=35)
    (s,) = pool.reserve("a", 1, lease_s=20, writer="peer-a")
    if give_up == "release":
        pool.release([s])
    elif give_up == "release_owner":
        assert pool.release_owner("a") == [s]
    else:
        clock.now = 20  # the lease passed, the write window (35 s) not yet
        assert pool.expire() == {"a": [s]}
    assert pool.state(s) is SlotState.QUARANTINED and pool.owner(s) is None and not pool.slots_of("a")
    assert pool.free_slots == 1 and pool.quarantined_slots == 1
    pool.check_invariants()
    # Every free slot is granted, and the quarantined one never is.
    (other,) = pool.reserve("b", 1, lease_s=40)
    assert other != s
    with pytest.raises(BufferFull, match="1 quarantined"):
        pool.reserve("c", 1, lease_s=40)
    clock.now = 34.9
    pool.expire()
    assert pool.state(s) is SlotState.QUARANTINED
    clock.now = 35
    pool.expire()
    assert pool.state(s) is SlotState.FREE and pool.reserve("c", 1, lease_s=40) == [s]
    pool.check_invariants()


def test_written_confirmation_frees_a_quarantined_slot_only_from_its_writer():
    pool = SlotPool(2, write_window_s=1000)
    (s,) = pool.reserve("a", 1, lease_s=40, writer="peer-a")
    pool.release_owner("a")
    assert pool.mark_ready("a", [s], lease_s=5) == [s]  # a stale Written never makes it READY
    assert pool.confirm("peer-b", [s]) == [] and pool.state(s) is SlotState.QUARANTINED
    assert pool.confirm("peer-a", [s, 7, -1]) == [s]
    assert pool.state(s) is SlotState.FREE and pool.writer(s) is None
    pool.check_invariants()


def test_ready_slot_is_freed_at_once():
    pool = SlotPool(1, write_window_s=1000)
    (s,) = pool.reserve("a", 1, lease_s=40)
    pool.mark_ready("a", [s], lease_s=40)
    pool.release_owner("a")
    assert pool.state(s) is SlotState.FREE and pool.quarantined_slots == 0


def test_admit_write_checks_the_writer_and_extends_the_quarantine():
    clock = Clock()
    pool = SlotPool(3, clock=clock, write_window_s=10)
    a = pool.reserve("a", 2, lease_s=40, writer="peer-a")
    (b,) = pool.reserve("b", 1, lease_s=40, writer="peer-b")
    assert pool.admit_write("peer-a", [a[0], b], until=50) == [b]  # all or nothing
    assert pool.admit_write("peer-a", [a[0], 99], until=50) == [99]
    assert pool.admit_write("peer-a", [a[0], a[0]], until=50) == [a[0], a[0]]  # one slot twice in a write
    assert pool.admit_write("peer-a", [a[0]], until=50) == []
    pool.release_owner("a")
    assert pool.admit_write("peer-a", [a[1]], until=50) == []  # quarantined: its own late write may land
    assert pool.admit_write("peer-a", a, until=50) == a  # a grant is written once: a second write is refused
    clock.now = 20  # past the grant's window, not past the admitted receive's deadline
    pool.expire()
    assert [pool.state(s) for s in a] == [SlotState.QUARANTINED] * 2
    clock.now = 50
    pool.expire()
    assert [pool.state(s) for s in a] == [SlotState.FREE] * 2
    assert pool.admit_write("peer-a", a, until=60) == a  # FREE: nobody may write
    pool.check_invariants()


class PoolMachine(RuleBasedStateMachine):
    """Random reserve / ready / acquire / release / cancel / expire: invariants always hold."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.pool = SlotPool(8, clock=self.clock, write_window_s=2)
        self.owners = ["a", "b", "c"]
        self.quarantined_at: dict[int, object] = {}  # slot -> writer, while quarantined
        self.admitted: set[int] = set()  # slots whose grant a transport started receiving

    @rule(owner=st.sampled_from(["a", "b", "c"]), count=st.integers(0, 5), lease=st.floats(0.5, 5))
    def reserve(self, owner, count, lease):
        before = self.pool.free_slots
        try:
            slots = self.pool.reserve(owner, count, lease, writer=f"peer-{owner}")
            self.admitted -= set(slots)  # a new grant may be written once again
            assert len(slots) == count and self.pool.free_slots == before - count
            assert not set(slots) & set(self.quarantined_at), "a quarantined slot was granted"
        except BufferFull:
            assert count > before and self.pool.free_slots == before

    @rule(owner=st.sampled_from(["a", "b", "c"]), data=st.data())
    def mark_ready(self, owner, data):
        slots = sorted(self.pool.slots_of(owner))
        if slots:
            chosen = data.draw(st.lists(st.sampled_from(slots), max_size=4))
            self.pool.mark_ready(owner, chosen, lease_s=3)

    @rule(owner=st.sampled_from(["a", "b", "c"]), data=st.data())
    def acquire_and_maybe_release(self, owner, data):
        ready = [s for s in self.pool.slots_of(owner) if self.pool.state(s) is SlotState.READY]
        if ready:
            s = data.draw(st.sampled_from(ready))
            assert self.pool.acquire(s, owner)
            if data.draw(st.booleans()):
                self.pool.release([s])

    @rule(owner=st.sampled_from(["a", "b", "c"]))
    def cancel(self, owner):
        self.pool.release_owner(owner)
        assert all(self.pool.state(s) is SlotState.LOADING for s in self.pool.slots_of(owner))

    @rule(writer=st.sampled_from(["peer-a", "peer-b", "peer-c"]), data=st.data())
    def stale_written(self, writer, data):
        """A late Written: never makes a quarantined slot READY; frees it only from its writer."""
        if not self.quarantined_at:
            return
        s = data.draw(st.sampled_from(sorted(self.quarantined_at)))
        owner = writer.removeprefix("peer-")
        assert self.pool.mark_ready(owner, [s], lease_s=3, writer=writer) == [s]
        freed = self.pool.confirm(writer, [s])
        assert freed == ([s] if self.quarantined_at[s] == writer else [])

    @rule(writer=st.sampled_from(["peer-a", "peer-b", "peer-c"]), data=st.data(), until=st.floats(0, 6))
    def admit_write(self, writer, data, until):
        s = data.draw(st.integers(0, self.pool.num_slots - 1))
        before = self.pool.state(s)
        refused = self.pool.admit_write(writer, [s], self.clock.now + until)
        allowed = (before in (SlotState.RESERVED, SlotState.QUARANTINED) and self.pool.writer(s) == writer
                   and s not in self.admitted)
        assert refused == ([] if allowed else [s]) and self.pool.state(s) is before
        if allowed:
            self.admitted.add(s)

    @rule(dt=st.floats(0, 4))
    def tick_and_expire(self, dt):
        self.clock.now += dt
        self.pool.expire()

    @precondition(lambda self: True)
    @rule()
    def end_everything(self):
        """After every request ends and leases pass, only engine-held slots are not FREE."""
        self.clock.now += 1000
        self.pool.expire()
        busy = [s for s in range(self.pool.num_slots) if self.pool.state(s) is not SlotState.FREE]
        assert all(self.pool.state(s) is SlotState.LOADING for s in busy)
        self.pool.release(busy)
        assert self.pool.free_slots == self.pool.num_slots

    @invariant()
    def consistent(self):
        self.pool.check_invariants()
        # Track which slots are quarantined now (for the rules above) and by whose write.
        self.quarantined_at = {s: self.pool.writer(s) for s in range(self.pool.num_slots)
                               if self.pool.state(s) is SlotState.QUARANTINED}


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# ---- the cache: landed slots of known keys stay CACHED, evictable unless pinned or read ----------


def _load(pool: SlotPool, owner: str, keys: list[str]) -> list[int]:
    """Reserve, land and load ``keys`` for ``owner``; the slots stay LOADING (engine holds them)."""
    slots = pool.reserve(owner, len(keys), lease_s=10, keys=keys)
    assert pool.mark_ready(owner, slots, lease_s=10) == []
    assert all(pool.acquire(s, owner) for s in slots)
    return slots


def test_loaded_slot_is_cached_and_counts_as_free_credit():
    pool = SlotPool(3, cache=True)
    (s,) = _load(pool, "a", ["k0"])
    pool.release([s])
    assert pool.state(s) is SlotState.CACHED and pool.owner(s) is None and pool.writer(s) is None
    assert pool.cached_slot("k0") == s and pool.cached_slots == 1
    assert pool.free_slots == 3  # evictable cached slots are credit
    pool.check_invariants()


def test_cache_off_frees_as_before():
    pool = SlotPool(2)
    (s,) = _load(pool, "a", ["k0"])
    pool.release([s])
    assert pool.state(s) is SlotState.FREE and pool.cached_slot("k0") is None


def test_only_loaded_slots_are_cached_a_cancelled_requests_are_not():
    pool = SlotPool(3, cache=True, write_window_s=100)
    a = pool.reserve("a", 2, lease_s=10, writer="peer-a", keys=["k0", "k1"])
    pool.mark_ready("a", [a[0]], lease_s=10)
    pool.release_owner("a")  # cancel: k0 landed but was never loaded, k1 may still be written
    assert pool.state(a[0]) is SlotState.FREE and pool.cached_slot("k0") is None
    assert pool.state(a[1]) is SlotState.QUARANTINED and pool.cached_slot("k1") is None
    pool.check_invariants()


def test_second_copy_of_a_cached_key_is_freed():
    pool = SlotPool(3, cache=True)
    (s0,) = _load(pool, "a", ["k0"])
    (s1,) = _load(pool, "b", ["k0"])
    pool.release([s0, s1])
    assert pool.state(s0) is SlotState.CACHED and pool.state(s1) is SlotState.FREE
    assert pool.cached_slot("k0") == s0
    pool.check_invariants()


def test_eviction_takes_free_slots_first_then_least_recently_used_unpinned_unread():
    clock = Clock()
    pool = SlotPool(4, clock=clock, cache=True)
    slots = _load(pool, "a", ["k0", "k1", "k2"])
    pool.release(slots)  # k0, k1, k2 cached in this order; slot 3 FREE
    assert pool.pin("k0", "req-x", lease_s=5) == slots[0]  # pinned (and used: most recent)
    assert pool.read("k1") == slots[1]  # read by the engine
    got = pool.reserve("b", 2, lease_s=10)
    assert got == [3, slots[2]]  # the FREE slot, then the only evictable cached one
    assert pool.cached_slot("k2") is None and pool.key(slots[2]) is None
    with pytest.raises(BufferFull, match="2 cached slots pinned"):
        pool.reserve("c", 1, lease_s=10)
    pool.unread(slots[1])
    assert pool.free_slots == 1 and pool.reserve("c", 1, lease_s=10) == [slots[1]]
    clock.now = 5  # the pin's lease passed
    pool.expire()
    assert pool.pins(slots[0]) == [] and pool.reserve("d", 1, lease_s=10) == [slots[0]]
    pool.check_invariants()


def test_unpin_drops_one_pin_of_a_holder_or_the_oldest_other():
    pool = SlotPool(1, cache=True)
    (s,) = _load(pool, "a", ["k0"])
    pool.release([s])
    for holder in ("r1", "r2", "lookup"):
        pool.pin("k0", holder, lease_s=10)
    assert pool.unpin(s, not_holder="lookup") and pool.pins(s) == ["r2", "lookup"]
    assert pool.unpin(s, "lookup") and not pool.unpin(s, "lookup")
    assert pool.unpin_holder("r2", [s]) == 1 and pool.free_slots == 1
    pool.check_invariants()


KEYS = ["k0", "k1", "k2", "k3", "k4"]


class CachePoolMachine(RuleBasedStateMachine):
    """The cache under random traffic: a pinned or read slot is never handed to a writer, a key has
    at most one CACHED slot, and every invariant of the pool holds."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.pool = SlotPool(6, clock=self.clock, write_window_s=2, cache=True)
        self.reads: list[int] = []  # slots handed to the engine by read(), not yet dropped

    def _protected(self) -> set[int]:
        return {s for s in range(self.pool.num_slots)
                if self.pool.state(s) is SlotState.CACHED and (self.pool.pins(s) or self.pool.readers(s))}

    @rule(owner=st.sampled_from(["a", "b", "c"]), keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def reserve(self, owner, keys):
        protected = self._protected()
        before = self.pool.free_slots
        try:
            slots = self.pool.reserve(owner, len(keys), 3, writer=f"peer-{owner}", keys=keys)
        except BufferFull:
            assert len(keys) > before
            return
        assert not set(slots) & protected, "a pinned or read cached slot was granted"
        assert all(self.pool.state(s) is SlotState.RESERVED for s in slots)

    @rule(owner=st.sampled_from(["a", "b", "c"]), data=st.data())
    def land_and_maybe_load(self, owner, data):
        slots = sorted(self.pool.slots_of(owner))
        if not slots:
            return
        chosen = data.draw(st.lists(st.sampled_from(slots), max_size=3, unique=True))
        self.pool.mark_ready(owner, chosen, lease_s=3)
        for s in chosen:
            if data.draw(st.booleans()) and self.pool.acquire(s, owner):
                key = self.pool.key(s)
                had = self.pool.cached_slot(key)
                self.pool.release([s])
                expect = SlotState.FREE if had is not None else SlotState.CACHED
                assert self.pool.state(s) is expect

    @rule(owner=st.sampled_from(["a", "b", "c"]))
    def cancel(self, owner):
        self.pool.release_owner(owner)

    @rule(key=st.sampled_from(KEYS), holder=st.sampled_from(["r1", "r2", "lookup"]), lease=st.floats(0.5, 5))
    def pin(self, key, holder, lease):
        s = self.pool.pin(key, holder, lease)
        assert (s is None) == (self.pool.cached_slot(key) is None)

    @rule(slot=st.integers(0, 5), holder=st.sampled_from(["r1", "r2", "lookup", None]))
    def unpin(self, slot, holder):
        self.pool.unpin(slot, holder)

    @rule(holder=st.sampled_from(["r1", "r2"]))
    def unpin_holder(self, holder):
        self.pool.unpin_holder(holder, range(self.pool.num_slots))

    @rule(key=st.sampled_from(KEYS))
    def read(self, key):
        s = self.pool.read(key)
        if s is not None:
            self.reads.append(s)

    @precondition(lambda self: self.reads)
    @rule(data=st.data())
    def unread(self, data):
        s = self.reads.pop(data.draw(st.integers(0, len(self.reads) - 1)))
        self.pool.unread(s)

    @rule(dt=st.floats(0, 4))
    def tick_and_expire(self, dt):
        self.clock.now += dt
        self.pool.expire()

    @rule()
    def end_everything(self):
        """Requests end, leases pass, the engine drops its references: all is FREE or evictable."""
        self.clock.now += 1000
        self.pool.expire()
        for s in self.reads:
            self.pool.unread(s)
        self.reads = []
        self.pool.release([s for s in range(self.pool.num_slots) if self.pool.state(s) is SlotState.LOADING])
        assert self.pool.free_slots == self.pool.num_slots

    @invariant()
    def consistent(self):
        self.pool.check_invariants()
        for s in self.reads:  # a slot the engine reads is never anything but CACHED meanwhile
            assert self.pool.state(s) is SlotState.CACHED and self.pool.readers(s) > 0


TestCachePoolMachine = CachePoolMachine.TestCase
TestCachePoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# ---- bytes: what a slot holds when the engine reads it ------------------------------------------


@dataclasses.dataclass
class _Grant:
    """One grant as its writer sees it: it may write ``key`` into ``slot`` until ``until``, once."""

    writer: str
    slot: int
    key: str
    until: float
    landed: bool = False


class IntegrityMachine(RuleBasedStateMachine):
    """The pool against a model of the buffer's bytes and of writers that honour their contract
    (a grant's bytes land at most once, at any time before its write window closes, even after the
    request was cancelled, failed or expired; its Written comes after them).

    Properties: whatever the engine reads (a READY slot it acquires, a CACHED slot it reads) holds
    exactly its key's bytes, and keeps them while the engine holds it; a slot whose grant may
    still be written is never granted again; a key is never served from a slot holding another's.
    """

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.pool = SlotPool(5, clock=self.clock, write_window_s=2, cache=True)
        self.memory: list[str | None] = [None] * self.pool.num_slots  # whose bytes each slot holds
        self.grants: list[_Grant] = []  # grants whose writer may still write or confirm
        self.loading: dict[int, str] = {}  # LOADING slot -> the key the engine loads from it
        self.reads: list[tuple[int, str]] = []  # (slot, key) references handed out by read()

    def _open(self, g: _Grant) -> bool:
        return self.clock.now < g.until

    @rule(owner=st.sampled_from(["a", "b", "c"]), keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def reserve(self, owner, keys):
        try:
            slots = self.pool.reserve(owner, len(keys), 3, writer=f"peer-{owner}", keys=keys)
        except BufferFull:
            return
        live = {g.slot for g in self.grants if not g.landed and self._open(g)}
        assert not set(slots) & live, f"slots {sorted(set(slots) & live)} granted while a write may land in them"
        held = set(self.loading) | {s for s, _ in self.reads}
        assert not set(slots) & held, f"slots {sorted(set(slots) & held)} granted while the engine reads them"
        self.grants = [g for g in self.grants if g.slot not in slots]  # older grants of these slots are over
        now = self.clock.now
        self.grants += [_Grant(f"peer-{owner}", s, k, now + self.pool.write_window_s) for s, k in zip(slots, keys)]

    @rule(owner=st.sampled_from(["a", "b", "c"]), key=st.sampled_from(KEYS))
    def load_one(self, owner, key):
        """A whole request of one chunk: granted, landed, Written, loaded and let go (fills the cache)."""
        before = len(self.grants)
        self.reserve(owner, [key])
        if len(self.grants) == before:
            return  # buffer full
        g = self.grants[-1]
        self.land_grant(g)
        self.written_grant(g)
        if self.pool.acquire(g.slot, owner):
            assert self.memory[g.slot] == key
            self.pool.release([g.slot])

    @precondition(lambda self: self.grants)
    @rule(data=st.data())
    def land(self, data):
        """A writer's bytes land (possibly after its request was given up), inside its window."""
        self.land_grant(data.draw(st.sampled_from(self.grants)))

    def land_grant(self, g: _Grant) -> None:
        if g.landed or not self._open(g):
            return
        self.memory[g.slot] = g.key
        g.landed = True

    @precondition(lambda self: self.grants)
    @rule(data=st.data(), extra=st.floats(0, 3))
    def admit(self, data, extra):
        """A two-sided transport admits a write before receiving it: its window may grow."""
        g = data.draw(st.sampled_from(self.grants))
        if not g.landed and self.pool.admit_write(g.writer, [g.slot], self.clock.now + extra) == []:
            g.until = max(g.until, self.clock.now + extra)

    @precondition(lambda self: any(g.landed for g in self.grants))
    @rule(data=st.data())
    def written(self, data):
        """The Written of a landed write: READY if still granted, else confirms a quarantined slot."""
        self.written_grant(data.draw(st.sampled_from([g for g in self.grants if g.landed])))

    def written_grant(self, g: _Grant) -> None:
        if not g.landed:
            return
        self.grants.remove(g)
        owner = g.writer.removeprefix("peer-")
        stale = self.pool.mark_ready(owner, [g.slot], lease_s=3, writer=g.writer)
        self.pool.confirm(g.writer, stale)

    @rule(owner=st.sampled_from(["a", "b", "c"]), data=st.data())
    def acquire(self, owner, data):
        ready = sorted(s for s in self.pool.slots_of(owner) if self.pool.state(s) is SlotState.READY)
        if ready:
            s = data.draw(st.sampled_from(ready))
            assert self.pool.acquire(s, owner)
            key = self.pool.key(s)
            assert self.memory[s] == key, f"READY slot {s} of {key} holds {self.memory[s]}'s bytes"
            self.loading[s] = key

    @precondition(lambda self: self.loading)
    @rule(data=st.data())
    def release_loaded(self, data):
        s = data.draw(st.sampled_from(sorted(self.loading)))
        del self.loading[s]
        self.pool.release([s])

    @rule(owner=st.sampled_from(["a", "b", "c"]))
    def cancel(self, owner):
        self.pool.release_owner(owner)

    @rule(key=st.sampled_from(KEYS), holder=st.sampled_from(["r1", "lookup"]), lease=st.floats(0.5, 5))
    def pin(self, key, holder, lease):
        self.pool.pin(key, holder, lease)

    @rule(holder=st.sampled_from(["r1", "lookup"]))
    def unpin_holder(self, holder):
        self.pool.unpin_holder(holder, range(self.pool.num_slots))

    @rule(key=st.sampled_from(KEYS))
    def read(self, key):
        s = self.pool.read(key)
        if s is not None:
            assert self.memory[s] == key, f"cached slot {s} served for {key} holds {self.memory[s]}'s bytes"
            self.reads.append((s, key))

    @precondition(lambda self: self.reads)
    @rule(data=st.data())
    def unread(self, data):
        s, _ = self.reads.pop(data.draw(st.integers(0, len(self.reads) - 1)))
        self.pool.unread(s)

    @rule(dt=st.floats(0, 3))
    def tick_and_expire(self, dt):
        self.clock.now += dt
        self.pool.expire()

    @invariant()
    def bytes_match_keys(self):
        self.pool.check_invariants()
        for s, key in self.loading.items():
            assert self.pool.state(s) is SlotState.LOADING and self.memory[s] == key, f"LOADING slot {s} changed"
        for s, key in self.reads:
            assert self.pool.state(s) is SlotState.CACHED and self.memory[s] == key, f"read slot {s} changed"
        for s in range(self.pool.num_slots):
            if self.pool.state(s) in (SlotState.READY, SlotState.LOADING, SlotState.CACHED):
                assert self.memory[s] == self.pool.key(s), f"{self.pool.state(s).name} slot {s} holds other bytes"


TestIntegrityMachine = IntegrityMachine.TestCase
TestIntegrityMachine.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
