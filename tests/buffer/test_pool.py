"""buffer.pool: the slot state machine keeps its invariants under any sequence of operations."""

from __future__ import annotations

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


def test_stale_ready_marks_are_reported():
    pool = SlotPool(2)
    (s,) = pool.reserve("a", 1, lease_s=5)
    pool.release_owner("a")
    pool.reserve("b", 1, lease_s=5)
    assert pool.mark_ready("a", [s, 99], lease_s=5) == [s, 99]  # slot now belongs to b; 99 out of range
    assert pool.state(s) is SlotState.RESERVED


class PoolMachine(RuleBasedStateMachine):
    """Random reserve / ready / acquire / release / cancel / expire: invariants always hold."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.pool = SlotPool(8, clock=self.clock)
        self.owners = ["a", "b", "c"]

    @rule(owner=st.sampled_from(["a", "b", "c"]), count=st.integers(0, 5), lease=st.floats(0.5, 5))
    def reserve(self, owner, count, lease):
        before = self.pool.free_slots
        try:
            slots = self.pool.reserve(owner, count, lease)
            assert len(slots) == count and self.pool.free_slots == before - count
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


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
