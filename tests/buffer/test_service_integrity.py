"""ReceiveService over the buffer cache: integrity races at the service level (the pool's own
properties are in test_pool.py). The rig is tests/backend/test_receive_service.py's: a real
service thread and control socket, senders as DEALER sockets, injected transport notifications
and the test's clock."""

from __future__ import annotations

import dataclasses

from backend.test_receive_service import FINGERPRINT, SHAPE, Rig, eventually, load, make_rig  # noqa: F401 (fixture)
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmcache_p2p import protocol
from lmcache_p2p.backend.chunk_index import Chunk
from lmcache_p2p.buffer import SlotState


def test_a_failed_request_is_not_revived_by_its_next_alloc_batch(make_rig) -> None:
    # Chunked prefill stores a request in several Alloc batches. Once the receiver failed it (lease
    # expiry here; also a sender replaced, a refusal) and told the proxy KvFailed, a later batch of
    # the same request must be refused: a revived request holds slots nobody will load, reports
    # KvReady after KvFailed, and its writer (peer, req_id) is the one of the failed grants: before
    # the fix the revived request was granted the same slot for k2, and the failed grant's late
    # Written made it READY for k2 holding k1's bytes (wrong KV served).
    rig = make_rig(num_slots=1, reserve_lease_s=40)
    a = rig.sender("sender-a", "tx-a")
    first = a.alloc("req-a", ["k1"], last=False)
    assert isinstance(first, protocol.Grant)
    rig.clock.now += 40  # the grant's lease (and write window) passed: the request fails
    assert eventually(lambda: rig.pool.state(first.slots[0]) is SlotState.FREE)
    later = a.alloc("req-a", ["k2"], last=True)
    assert isinstance(later, protocol.Refused) and later.code is protocol.RefusalCode.FINISHED, later
    assert rig.service.free_slots == 1 and not rig.service.grants.requests
    rig.transport.land("tx-a", "sender-a", "req-a", first.slots)  # the failed grant's Written, late
    assert not eventually(lambda: rig.service.count_ready(["k1"]) or rig.service.count_ready(["k2"]), timeout_s=0.3)


def test_a_request_whose_chunk_another_request_loaded_and_evicted_still_completes(make_rig) -> None:
    # Same-prefix requests meet on one decoder (prefix-aware routing): another request's retrieve
    # may take this request's READY chunk k1 while its later batches are still on their way; k1
    # then is CACHED, evictable, and this request's next grant may evict it and reuse its slot for
    # k2. Readiness must count keys, not slots: the request reports KvReady once k2 landed (its
    # lookup then misses k1 and the decoder recomputes), instead of waiting for its lease.
    rig = make_rig(num_slots=2)
    a = rig.sender("sender-a", "tx-a")
    first = a.alloc("req-a", ["k1"], last=False)
    assert rig.granted(a, "req-b", ["x1"]) != first.slots  # the other slot, busy meanwhile
    rig.transport.land("tx-a", "sender-a", "req-a", first.slots)
    assert eventually(lambda: rig.service.count_ready(["k1"]) == 1)
    load(rig, ["k1"])  # another request's retrieve
    assert rig.pool.state(first.slots[0]) is SlotState.CACHED
    second = a.alloc("req-a", ["k2"], last=True)
    assert isinstance(second, protocol.Grant) and second.slots == first.slots  # k1 evicted for k2
    rig.transport.land("tx-a", "sender-a", "req-a", second.slots)
    assert eventually(lambda: rig.service.count_ready(["k2"]) == 1)
    assert eventually(lambda: rig.service.grants.requests["req-a"].reported), "KvReady never sent"
    chunk = rig.service.take("k2")
    assert chunk is not None and chunk.slot == second.slots[0] and rig.service.count_ready(["k1"]) == 0


def test_a_lookup_unpin_never_drops_the_pin_of_a_later_lookup(make_rig) -> None:
    # LMCache unpins, after its retrieve, every key its lookup counted. Lookup 1 counted k1 while it
    # was a request's READY chunk (no pin placed); its retrieve loaded it, so k1 is CACHED; lookup 2
    # pinned the cached k1. Lookup 1's unpin must not drop lookup 2's pin: evicted before lookup 2's
    # retrieve, k1 would be a miss after a hit (vLLM's default kv_load_failure_policy fails the request).
    rig = make_rig(num_slots=2)
    a = rig.sender("sender-a", "tx-a")
    (slot,) = rig.granted(a, "turn-1", ["k1"])
    rig.transport.land("tx-a", "sender-a", "turn-1", [slot])
    assert eventually(lambda: rig.service.count_ready(["k1"]) == 1)
    assert rig.service.count_ready(["k1"], pin=True) == 1  # lookup 1: the READY chunk
    load(rig, ["k1"])  # retrieve 1
    assert rig.pool.state(slot) is SlotState.CACHED
    assert rig.service.count_ready(["k1"], pin=True) == 1  # lookup 2: the cached chunk, pinned
    rig.service.unpin("k1")  # lookup 1's unpin
    assert rig.pool.pins(slot) == ["lookup"], "lookup 2's pin was dropped by lookup 1's unpin"
    refused = a.alloc("other", ["x1", "x2"])  # buffer pressure: would evict an unpinned k1
    assert isinstance(refused, protocol.Refused) and rig.pool.state(slot) is SlotState.CACHED
    chunk = rig.service.take("k1")  # retrieve 2
    assert chunk is not None and chunk.cached and chunk.slot == slot
    rig.service.unpin("k1")  # lookup 2's unpin
    rig.service.release(chunk)
    assert rig.pool.pins(slot) == [] and rig.service.free_slots == 2


def test_a_restarted_decoder_never_claims_the_chunks_its_previous_incarnation_cached(make_rig) -> None:
    # The prefiller's requests, and the proxy's prefix-aware routing, may still expect the old
    # cache; the new incarnation forgets the sender (UNKNOWN_PEER) and, greeted again, grants every
    # chunk: nothing is held that its buffer does not hold.
    old = make_rig(num_slots=2)
    port = int(old.service.control_endpoint.rsplit(":", 1)[1])
    a = old.sender("sender-a", "tx-a")
    (slot,) = old.granted(a, "turn-1", ["k1"])
    old.transport.land("tx-a", "sender-a", "turn-1", [slot])
    assert eventually(lambda: old.service.count_ready(["k1"]) == 1)
    load(old, ["k1"])
    assert old.granted(a, "turn-2", ["k1"]) == [-1]  # held by the cache
    old.service.close()
    new = make_rig(num_slots=2, control_ports=[port])  # restarted on the same port, empty buffer
    refused = a.alloc("turn-3", ["k1"])
    assert isinstance(refused, protocol.Refused) and refused.code is protocol.RefusalCode.UNKNOWN_PEER
    assert isinstance(a.hello(), protocol.Welcome)
    granted = a.alloc("turn-3", ["k1"])
    assert isinstance(granted, protocol.Grant) and granted.slots[0] >= 0
    assert new.service.count_ready(["k1"]) == 0 and new.service.cached_slots == 0

# ---- the service under random traffic, against a model of the buffer's bytes ---------------------

DOCS = {d: [f"{d}{i}" for i in range(3)] for d in ("a", "b", "c")}  # chunk keys are prefix-chained
SENDERS = {b"id-1": ("sender-1", "tx-1"), b"id-2": ("sender-2", "tx-2")}
STOP_TIMEOUT_S = 30.0


@dataclasses.dataclass
class _Req:
    sender: bytes
    keys: list[str]
    sent: int = 0  # keys announced in granted Allocs
    dead: bool = False


@dataclasses.dataclass
class _Write:
    peer: str
    sender_id: str
    req_id: str
    slot: int
    key: str
    until: float


class ServiceMachine(RuleBasedStateMachine):
    """ReceiveService driven on one thread (as its control thread would) with senders that honour
    the write contract, an engine that looks up, retrieves and lets go, cancels and lease expiry.

    Property: every chunk the engine is handed holds exactly its key's bytes, and keeps them
    until the engine lets it go; the pool's invariants hold throughout."""

    def __init__(self) -> None:
        super().__init__()
        self.rig = Rig(num_slots=3)
        self.rig.service._stop.set()  # its thread stops; this machine is its control thread now
        # Stopped for sure before the flag is cleared: a thread still in its loop then (a loaded machine can hold
        # it past a short join) would go on serving, expiring and forgetting beside this machine.
        self.rig.service._thread.join(STOP_TIMEOUT_S)
        assert not self.rig.service._thread.is_alive(), f"the service thread did not stop within {STOP_TIMEOUT_S}s"
        self.rig.service._stop.clear()  # (a set stop flag refuses every Alloc as "shutting down")
        self.svc, self.pool, self.clock = self.rig.service, self.rig.pool, self.rig.clock
        self.memory: list[str | None] = [None] * self.pool.num_slots
        for identity, (sender_id, writer) in SENDERS.items():
            info = protocol.TransportInfo(kind="loopback", name=writer)
            assert isinstance(self.svc.control.handle(identity, protocol.Hello(protocol.PROTOCOL_VERSION, sender_id, 0, info,
                                                                        FINGERPRINT)), protocol.Welcome)
        self.reqs: dict[str, _Req] = {}
        self.writes: list[_Write] = []
        self.held: list[tuple[Chunk, str]] = []  # chunks the engine holds, with the key it asked for
        self.claims: list[str] = []  # keys counted by pinning lookups, not unpinned yet
        self.seq = 0
        self.n = 0

    def teardown(self) -> None:
        self.rig.close()

    @rule(doc=st.sampled_from(sorted(DOCS)), upto=st.integers(1, 3), sender=st.sampled_from(sorted(SENDERS)))
    def new_request(self, doc, upto, sender):
        self.n += 1
        self.reqs[f"r{self.n}"] = _Req(sender, DOCS[doc][:upto])

    @precondition(lambda self: any(not r.dead and r.sent < len(r.keys) for r in self.reqs.values()))
    @rule(data=st.data(), batch=st.integers(1, 2))
    def alloc(self, data, batch):
        req_id = data.draw(st.sampled_from(sorted(r for r, q in self.reqs.items() if not q.dead and q.sent < len(q.keys))))
        req = self.reqs[req_id]
        keys = req.keys[req.sent:req.sent + batch]
        last = req.sent + len(keys) == len(req.keys)
        self.seq += 1
        reply = self.svc.control.handle(req.sender, protocol.Alloc(self.seq, req_id, keys, [SHAPE] * len(keys), last))
        if isinstance(reply, protocol.Grant):
            req.sent += len(keys)
            sender_id, peer = SENDERS[req.sender]
            until = self.clock.now + self.rig.cfg.write_window_s
            self.writes += [_Write(peer, sender_id, req_id, s, k, until) for s, k in zip(reply.slots, keys) if s >= 0]
        elif not (isinstance(reply, protocol.Refused) and reply.code is protocol.RefusalCode.FULL):
            req.dead = True

    @precondition(lambda self: self.writes)
    @rule(data=st.data())
    def land(self, data):
        """A write lands (inside its window, even after a cancel) and its Written follows."""
        w = self.writes.pop(data.draw(st.integers(0, len(self.writes) - 1)))
        if self.clock.now >= w.until:
            return  # the contract: nothing lands after the window (the sender aborted it)
        self.memory[w.slot] = w.key
        self.svc.on_written(w.peer, protocol.Written(w.sender_id, w.req_id, [w.slot]))

    @rule(doc=st.sampled_from(sorted(DOCS)), upto=st.integers(1, 3), pin=st.booleans())
    def lookup_and_retrieve(self, doc, upto, pin):
        keys = DOCS[doc][:upto]
        hits = self.svc.count_ready(keys, pin=pin)
        if pin:
            self.claims += keys[:hits]
        for key in keys[:hits]:
            chunk = self.svc.take(key)
            if chunk is None:
                break  # a miss after a hit (not pinned, or taken meanwhile): recompute, never wrong bytes
            assert self.memory[chunk.slot] == key, f"served slot {chunk.slot} for {key}: holds {self.memory[chunk.slot]}"
            assert chunk.shape == SHAPE
            self.held.append((chunk, key))

    @precondition(lambda self: self.claims)
    @rule(data=st.data())
    def unpin(self, data):
        self.svc.unpin(self.claims.pop(data.draw(st.integers(0, len(self.claims) - 1))))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def let_go(self, data):
        chunk, _ = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.svc.release(chunk)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def cancel(self, data):
        req_id = data.draw(st.sampled_from(sorted(self.reqs)))
        self.svc.grants.cancel(req_id, "test")
        self.reqs[req_id].dead = True

    @rule(dt=st.sampled_from([1, 10, 30, 50]))
    def tick(self, dt):
        self.clock.now += dt
        self.svc.grants.expire()

    @rule()
    def end_everything(self):
        """Every request ends (its writes land or not), the engine lets go, leases pass: nothing
        stays held, and the service forgets every request, pin and lookup claim."""
        for req_id in sorted(self.reqs):
            self.svc.grants.cancel(req_id, "test")
        self.reqs.clear()
        while self.held:
            self.svc.release(self.held.pop()[0])
        while self.claims:
            self.svc.unpin(self.claims.pop())
        self.writes.clear()
        self.clock.now += 1000
        self.svc.grants.expire()
        assert self.svc.free_slots == self.pool.num_slots
        assert not self.svc.grants.requests and not self.svc.index.ready and not self.svc.grants.pinning
        assert not self.svc.index.lookup_pins and not self.svc.index.lookup_claims

    @invariant()
    def engine_sees_its_bytes(self):
        self.pool.check_invariants()
        for chunk, key in self.held:
            state = self.pool.state(chunk.slot)
            assert state is (SlotState.CACHED if chunk.cached else SlotState.LOADING), f"held slot {chunk.slot}: {state}"
            assert self.memory[chunk.slot] == key, f"held slot {chunk.slot} of {key} now holds {self.memory[chunk.slot]}"


TestServiceMachine = ServiceMachine.TestCase
TestServiceMachine.settings = settings(max_examples=600, stateful_step_count=50, deadline=None)
