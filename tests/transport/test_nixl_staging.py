"""The NIXL staging ring's bookkeeping (transport/nixl/staging.py), on CPU.

The ring itself moves bytes with CUDA copies and NIXL transfers; both run for real on the GPU
machine (contract case "nixl-cuda_ipc-staged", bench "nixl host->vram"). Here the layer under test
is the ring's state machine, so CUDA's stream and events are replaced by host stand-ins (a copy
lands at once, an event reports done after a few queries) and the transport by a port that copies
each posted transfer into a host "remote" buffer and completes it after a few polls.
"""

from __future__ import annotations

import contextlib
import ctypes
import random

import pytest
import torch

from lmcache_p2p.errors import PeerUnreachable, TransportError
from lmcache_p2p.transport.nixl.staging import StagingRing

SLOT_BYTES = 1 << 20


class _Event:
    def record(self, _stream) -> None:
        self._left = random.randint(0, 3)

    def query(self) -> bool:
        self._left -= 1
        return self._left < 0


@pytest.fixture
def host_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device", lambda _d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda _s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Stream", lambda _d: object())
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    random.seed(7)


class _Port:
    """Posts copy slot bytes into ``remote``; a transfer completes after 0-3 polls."""

    def __init__(self, remote: torch.Tensor) -> None:
        self.remote = remote
        self.ring: StagingRing | None = None
        self.posted: list[dict] = []
        self.notified: list[bytes] = []
        self.unreachable = False

    def post_staged(self, peer, src_rows, dst_rows, notif):
        if self.unreachable:
            raise PeerUnreachable(f"{peer} is gone")
        base = self.ring.buffer.data_ptr()
        for (src, n, _), (dst, n_dst, _) in zip(src_rows, dst_rows):
            assert n == n_dst
            self.remote[dst : dst + n].copy_(self.ring.buffer[src - base : src - base + n])
        xfer = {"rows": len(src_rows), "notif": notif, "polls": random.randint(0, 3), "dsts": dst_rows}
        self.posted.append(xfer)
        return xfer

    def staged_done(self, xfer) -> bool:
        xfer["polls"] -= 1
        if xfer["polls"] >= 0:
            return False
        if xfer["notif"]:
            self.notified.append(xfer["notif"])
        return True

    def staged_given_up(self, xfer):
        return None

    def drop_staged(self, xfer) -> None:
        xfer["dropped"] = True


def _ring(remote_bytes: int, slots: int = 3) -> tuple[StagingRing, _Port]:
    port = _Port(torch.zeros(remote_bytes, dtype=torch.uint8))
    ring = StagingRing(torch.device("cpu"), SLOT_BYTES, slots, port)
    port.ring = ring
    return ring, port


def _drain(ring: StagingRing, writes, rounds: int = 500) -> None:
    for _ in range(rounds):
        if all(w.finished for w in writes):
            return
        ring.pump()


def test_every_byte_lands_and_each_notification_follows_all_of_its_write(host_cuda) -> None:
    ring, port = _ring(256 << 20)
    sizes = [1, 4093, 300_000, SLOT_BYTES, 3 * SLOT_BYTES + 7]
    writes, expected, offset = [], [], 0
    for i in range(20):
        srcs = [torch.randint(0, 256, (random.choice(sizes),), dtype=torch.uint8) for _ in range(random.randint(1, 4))]
        rows = []
        for src in srcs:
            rows.append((offset, src.numel(), 1))
            expected.append((offset, src))
            offset += src.numel() + 13
        writes.append(ring.submit("peer", srcs, rows, b"w%d" % i))
        for _ in range(random.randint(0, 2)):
            ring.pump()
        # A notification may only be posted once every other slot of its write has completed.
        for write in writes:
            if write.notif in [x["notif"] for x in port.posted]:
                assert write.open_slots <= 1 or write.done
    _drain(ring, writes)
    assert all(w.done and not w.error for w in writes)
    assert sorted(port.notified) == sorted(b"w%d" % i for i in range(20))
    for dst, src in expected:
        assert torch.equal(port.remote[dst : dst + src.numel()], src)


def test_small_chunks_of_one_write_share_a_slot_and_one_transfer(host_cuda) -> None:
    ring, port = _ring(8 << 20)
    srcs = [torch.full((100_000,), i, dtype=torch.uint8) for i in range(8)]
    write = ring.submit("peer", srcs, [(i * 200_000, 100_000, 1) for i in range(8)], b"n")
    _drain(ring, [write])
    assert write.done
    assert [x["rows"] for x in port.posted] == [8]  # one transfer, one descriptor per chunk


def test_aborted_write_frees_the_ring_for_the_next(host_cuda) -> None:
    ring, port = _ring(64 << 20, slots=2)
    big = ring.submit("peer", [torch.ones(6 * SLOT_BYTES, dtype=torch.uint8)], [(0, 6 * SLOT_BYTES, 1)], b"big")
    ring.pump()
    ring.abort(big, "aborted")
    after = ring.submit("peer", [torch.full((10,), 9, dtype=torch.uint8)], [(32 << 20, 10, 1)], b"after")
    _drain(ring, [after])
    assert big.error == "aborted" and not big.done
    assert after.done and b"big" not in port.notified
    assert torch.equal(port.remote[32 << 20 : (32 << 20) + 10], torch.full((10,), 9, dtype=torch.uint8))


def test_unreachable_peer_fails_the_write_as_unreachable(host_cuda) -> None:
    ring, port = _ring(8 << 20)
    port.unreachable = True
    write = ring.submit("peer", [torch.ones(10, dtype=torch.uint8)], [(0, 10, 1)], b"x")
    _drain(ring, [write])
    assert write.error and write.unreachable and not write.done


def test_empty_sources_are_refused(host_cuda) -> None:
    ring, _ = _ring(1 << 20)
    with pytest.raises(ValueError):
        ring.submit("peer", [torch.empty(0, dtype=torch.uint8)], [(0, 0, 1)], b"x")


# ---- the ring inside NixlTransport: a disconnect while a slot is on the wire ----------------------


class _Xfer:
    """A fake NIXL transfer: like a UCX put, it may read its source until it reports DONE."""

    def __init__(self, local, remote, peer, notif) -> None:
        self.local, self.remote, self.peer, self.notif = local, remote, peer, notif
        self.state = "PROC"
        self.read: list[bytes] = []  # what the put read from its sources, once it finished

    def finish(self) -> None:
        self.read = [ctypes.string_at(addr, n) for addr, n, _ in self.local]
        self.state = "DONE"

    def release(self) -> None:
        pass


class _Agent:
    """The NIXL agent calls NixlTransport makes, in host memory; transfers finish when told."""

    def __init__(self) -> None:
        self.xfers: list[_Xfer] = []
        self.registered: list[tuple[int, int]] = []  # (address, bytes) of each live registration

    def get_reg_descs(self, rows, mem):
        return rows

    def register_memory(self, descs, backends) -> None:
        self.registered += [(addr, n) for addr, n, *_ in descs]

    def deregister_memory(self, descs, backends) -> None:
        for addr, n, *_ in descs:
            self.registered.remove((addr, n))

    def add_remote_agent(self, metadata: bytes) -> bytes:
        return metadata

    def remove_remote_agent(self, name) -> None:
        pass

    def get_xfer_descs(self, rows, mem):
        return list(rows)

    def initialize_xfer(self, op, local, remote, peer, notif):
        xfer = _Xfer(local, remote, peer, notif)
        self.xfers.append(xfer)
        return xfer

    post_state = ""  # what transfer() answers instead of the transfer's state, when set

    def transfer(self, xfer) -> str:
        return self.post_state or xfer.state

    def check_xfer_state(self, xfer) -> str:
        return xfer.state


def _nixl_with_ring(monkeypatch: pytest.MonkeyPatch, slots: int):
    from lmcache_p2p.transport.nixl.transport import NixlTransport

    agent = _Agent()
    monkeypatch.setattr(NixlTransport, "_create_agent", lambda self, name, params: agent)
    transport = NixlTransport("tx").start()
    ring = StagingRing(torch.device("cpu"), SLOT_BYTES, slots, transport._submit)
    transport._state.ring = ring
    transport.register(ring.buffer)
    return transport, agent


def _gpu_peer(name: str):
    from lmcache_p2p.protocol import Region, TransportInfo

    region = Region(addr=1 << 40, length=8 * SLOT_BYTES, device_id=0, device="cuda")
    return TransportInfo(kind="nixl", name=name, metadata=name.encode(), regions=[region]), region.addr


class _LandedEvent:
    def record(self, _stream) -> None:
        pass

    def query(self) -> bool:
        return True


def test_a_slot_on_the_wire_to_a_disconnected_peer_is_not_refilled_before_nixl_finishes_it(host_cuda, monkeypatch):
    """A disconnect fails the peer's writes for their callers, but a put already posted out of a
    ring slot goes on reading that slot until NIXL reports it finished: the ring must not copy
    another write into the slot meanwhile (the put, and its notification, would carry the other
    write's bytes to a receiver that may still be alive)."""
    monkeypatch.setattr(torch.cuda, "Event", _LandedEvent)
    transport, agent = _nixl_with_ring(monkeypatch, slots=1)
    try:
        info_b, dst_b = _gpu_peer("b")
        info_c, dst_c = _gpu_peer("c")
        first = torch.full((1000,), 0xAA, dtype=torch.uint8)
        second = torch.full((1000,), 0xBB, dtype=torch.uint8)
        transport.connect(info_b, 1.0)
        h1 = transport.write("b", [first], [dst_b], b"n1")
        assert not transport.poll(h1)
        assert [x.peer for x in agent.xfers] == ["b"]  # copied into the slot and posted
        transport.disconnect("b")
        with pytest.raises(PeerUnreachable):
            transport.poll(h1)
        transport.connect(info_c, 1.0)
        h2 = transport.write("c", [second], [dst_c], b"n2")
        for _ in range(5):
            assert not transport.poll(h2)
        agent.xfers[0].finish()  # the put to b ends only now, reading the slot as it is now
        for _ in range(5):
            if transport.poll(h2):
                break
            for xfer in agent.xfers[1:]:
                xfer.finish()
        assert agent.xfers[0].read == [first.numpy().tobytes()], "the put to b read another write's bytes"
        assert transport.poll(h2) and agent.xfers[-1].read == [second.numpy().tobytes()]
        assert agent.xfers[-1].notif == b"n2"
        assert transport.settled(h1) and transport.settled(h2)
    finally:
        transport.close()


def test_a_write_refused_for_its_destination_leaves_no_source_registered(host_cuda, monkeypatch):
    """A source outside every registered region is registered for its write only; a write refused
    before it is posted (a destination outside the peer's regions) must not leave it registered."""
    from lmcache_p2p.protocol import Region, TransportInfo
    from lmcache_p2p.transport.nixl.transport import NixlTransport

    agent = _Agent()
    monkeypatch.setattr(NixlTransport, "_create_agent", lambda self, name, params: agent)
    transport = NixlTransport("tx").start()  # no staging ring: host sources go straight out
    try:
        host = Region(addr=1 << 40, length=SLOT_BYTES, device_id=0, device="cpu")
        transport.connect(TransportInfo(kind="nixl", name="h", metadata=b"h", regions=[host]), 1.0)
        before = list(agent.registered)
        with pytest.raises(ValueError, match="outside"):
            transport.write("h", [torch.ones(100, dtype=torch.uint8)], [host.addr + SLOT_BYTES - 10], b"")
        assert agent.registered == before
    finally:
        transport.close()


def test_a_staged_put_failed_while_another_put_of_it_still_reads_keeps_its_slot(host_cuda, monkeypatch):
    """NIXL answers ERR for a transfer as soon as one of its puts failed, while the others may still
    read their sources: the ring slot it reads must never be refilled (the live put would carry
    another write's bytes under the failed write's rows), and a ring with no slot left is bypassed."""
    monkeypatch.setattr(torch.cuda, "Event", _LandedEvent)
    transport, agent = _nixl_with_ring(monkeypatch, slots=1)
    try:
        info_b, dst_b = _gpu_peer("b")
        first = torch.full((1000,), 0xAA, dtype=torch.uint8)
        second = torch.full((1000,), 0xBB, dtype=torch.uint8)
        transport.connect(info_b, 1.0)
        h1 = transport.write("b", [first], [dst_b], b"n1")
        assert not transport.poll(h1)
        agent.xfers[0].state = "ERR"  # one put failed; the transfer's other put still reads the slot
        with pytest.raises(TransportError, match="ERR"):
            transport.poll(h1)
        h2 = transport.write("b", [second], [dst_b + 4096], b"n2")
        for _ in range(5):
            if transport.poll(h2):
                break
            for xfer in agent.xfers[1:]:
                xfer.finish()
        agent.xfers[0].finish()  # the live put ends only now, reading the slot as it is now
        assert agent.xfers[0].read == [first.numpy().tobytes()], "the failed put's slot was refilled under it"
        assert transport.poll(h2) and agent.xfers[-1].read == [second.numpy().tobytes()]
        assert agent.xfers[-1].notif == b"n2"
        assert transport.given_up == 1 and transport._state.ring.lost_slots == 1
    finally:
        transport.close()


@pytest.mark.parametrize("when", ["posted", "polled"])
def test_a_direct_write_nixl_failed_while_its_puts_may_still_read_never_settles(host_cuda, monkeypatch, when):
    """ERR at post or on a later state check does not mean every put of the transfer ended: the
    write fails for its caller but never settles, and a source registered for it stays registered."""
    from lmcache_p2p.protocol import Region, TransportInfo
    from lmcache_p2p.transport.nixl.transport import NixlTransport

    agent = _Agent()
    monkeypatch.setattr(NixlTransport, "_create_agent", lambda self, name, params: agent)
    transport = NixlTransport("tx").start()
    try:
        host = Region(addr=1 << 40, length=SLOT_BYTES, device_id=0, device="cpu")
        transport.connect(TransportInfo(kind="nixl", name="h", metadata=b"h", regions=[host]), 1.0)
        srcs = [torch.ones(100, dtype=torch.uint8), torch.ones(100, dtype=torch.uint8)]
        if when == "posted":
            agent.post_state = "ERR"
        handle = transport.write("h", srcs, [host.addr, host.addr + 100], b"n")
        agent.xfers[0].state = "ERR"
        with pytest.raises(TransportError, match="ERR"):
            transport.poll(handle)
        assert not transport.settled(handle), "a write was settled while NIXL may still read its sources"
        assert [(s.data_ptr(), s.nbytes) for s in srcs] == agent.registered[-2:], "its sources were deregistered"
        assert transport.given_up == 1
    finally:
        transport.close()
