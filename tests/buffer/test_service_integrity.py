"""ReceiveService over the buffer cache: integrity races at the service level (the pool's own
properties are in test_pool.py). The rig is tests/backend/test_receive_service.py's: a real
service thread and control socket, senders as DEALER sockets, injected transport notifications
and the test's clock."""

from __future__ import annotations

from backend.test_receive_service import SHAPE, eventually, load, make_rig  # noqa: F401 (make_rig: fixture)

from lmcache_p2p import protocol
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
    assert rig.service.free_slots == 1 and not rig.service._requests
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
    assert eventually(lambda: rig.service._requests["req-a"].reported), "KvReady never sent"
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
