"""NCCL-transport behaviour beyond the shared contract: pair groups, their lifecycles, staging.

Most tests run both sides in one process (pair groups coexist in a process; Gloo on CPU runs
the same code as NCCL); the restarted-sender test kills a real process. Tests marked ``gpu`` need
two CUDA devices (the device machine) and exercise ProcessGroupNCCL and the staging rings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Callable, Iterator
from unittest.mock import patch as _patch

import pytest
import torch

from lmcache_p2p.errors import ClosedError, PeerUnreachable, TransportError
from lmcache_p2p.protocol import TransportInfo
from lmcache_p2p.transport.nccl import group as group_ops
from lmcache_p2p.transport.nccl import wire
from lmcache_p2p.transport.nccl.transport import NcclTransport

WAIT_S = 20.0
KIB = 1 << 10
MIB = 1 << 20


@pytest.fixture(scope="module")
def case_name() -> str:
    """Narrows conftest's pair fixtures to this transport."""
    return "nccl-gloo"


@pytest.fixture
def make() -> Iterator[Callable[..., NcclTransport]]:
    made: list[NcclTransport] = []

    def _make(name: str, **kwargs) -> NcclTransport:
        kwargs.setdefault("timeout_s", 10.0)
        transport = NcclTransport(name, **kwargs)
        made.append(transport)
        return transport.start()

    yield _make
    for transport in reversed(made):
        transport.close()


def _recv_buffer(transport: NcclTransport, nbytes: int, device: str = "cpu", pin: bool = False) -> torch.Tensor:
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=device, pin_memory=pin)
    transport.register(buf)
    return buf


def _connect(rx: NcclTransport, tx: NcclTransport) -> str:
    rx.accept(tx.info())
    return tx.connect(rx.info(), WAIT_S)


def _recv_threads(receiver: str) -> list[str]:
    prefix = f"nccl-recv:{receiver}<-"
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(prefix))


def _eventually(check: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _collect(rx: NcclTransport, count: int, timeout_s: float = WAIT_S) -> list[tuple[str, bytes]]:
    deadline = time.monotonic() + timeout_s
    got: list[tuple[str, bytes]] = []
    while len(got) < count and time.monotonic() < deadline:
        got += [(n.peer, n.payload) for n in rx.wait_notifications(deadline - time.monotonic())]
    return got


def _random(nbytes: int, seed: int, device: str = "cpu", pin: bool = False) -> torch.Tensor:
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    if pin:
        return data.pin_memory()
    return data.to(device)


# ---- pair groups --------------------------------------------------------------------------------


def test_two_senders_write_to_one_receiver_at_once(make) -> None:
    rx = make("rx")
    buf = _recv_buffer(rx, 8 * MIB)
    senders = [make("tx1"), make("tx2")]
    for tx in senders:
        rx.accept(tx.info())  # both pairings in flight at once
    peers = [tx.connect(rx.info(), WAIT_S) for tx in senders]
    assert _recv_threads("rx") == ["nccl-recv:rx<-tx1", "nccl-recv:rx<-tx2"]
    base = rx.info().regions[0].addr
    writes = 16
    chunk = 256 * KIB
    sent: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def run(index: int) -> None:
        tx, handles = senders[index], []
        try:
            for i in range(writes):
                offset = index * 4 * MIB + i * chunk
                sent[offset] = _random(chunk, seed=offset + 1)
                handles.append(tx.write(peers[index], [sent[offset]], [base + offset], f"tx{index + 1}-{i}".encode()))
            for handle in handles:
                tx.wait(handle, WAIT_S)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    notifs = _collect(rx, 2 * writes)
    for thread in threads:
        thread.join(WAIT_S)
    assert not errors
    for name in ("tx1", "tx2"):  # every write notified once, in the order its sender wrote them
        assert [p for peer, p in notifs if peer == name] == [f"{name}-{i}".encode() for i in range(writes)]
    for offset, data in sent.items():
        assert torch.equal(buf[offset : offset + chunk], data)


# ---- eager pairing: connect() returns with the pair complete on both sides ------------------------


def _serving(rx: NcclTransport, sender: str) -> bool:
    pair = rx._receiver.serving(sender)
    return pair is not None and pair.serving


def test_connect_returns_only_once_the_receiver_serves_the_pair(make) -> None:
    """A receiver slow to register the pair (a busy engine) delays connect(), not the first write."""
    rx, tx = make("rx"), make("tx")
    buf = _recv_buffer(rx, MIB)
    on_paired = rx._receiver.hooks.on_paired

    def slow_on_paired(pair) -> bool:
        time.sleep(0.5)
        return on_paired(pair)

    rx._receiver.hooks = dataclasses.replace(rx._receiver.hooks, on_paired=slow_on_paired)
    peer = _connect(rx, tx)
    assert _serving(rx, "tx"), "connect() returned before the receiver's side of the pair was up"
    data = _random(64 * KIB, 7)
    handle = tx.write(peer, [data], [rx.info().regions[0].addr], b"first")
    tx.wait(handle, WAIT_S)  # the pair is up (asserted above): the first write does not pair
    assert _collect(rx, 1) == [("tx", b"first")]
    assert torch.equal(buf[: 64 * KIB], data)


def test_pairing_moves_a_warm_up_piece_and_both_sides_report_its_steps(make) -> None:
    rx, tx = make("rx"), make("tx")
    _recv_buffer(rx, MIB)
    _connect(rx, tx)
    assert _eventually(lambda: len(rx.pairings()) == 1)
    (sent,), (received,) = tx.pairings(), rx.pairings()
    assert (sent.role, sent.peer, received.role, received.peer) == ("sender", "rx", "receiver", "tx")
    assert sent.pair_id == received.pair_id
    assert sent.warmup_bytes == received.warmup_bytes == wire.WARMUP_BYTES
    assert min(sent.group_ms, sent.handshake_ms, sent.warmup_ms, sent.ready_ms) >= 0


def test_a_failed_pairing_raises_and_a_retry_pairs(make) -> None:
    """Reported, never fatal: a connect the receiver did not accept fails; the next one pairs."""
    rx, tx = make("rx"), make("tx")
    buf = _recv_buffer(rx, MIB)
    with pytest.raises(PeerUnreachable):
        tx.connect(rx.info(), 1.0)
    assert tx.pairings() == []
    peer = _connect(rx, tx)
    data = _random(4096, 9)
    tx.wait(tx.write(peer, [data], [rx.info().regions[0].addr], b"after-retry"), WAIT_S)
    assert _collect(rx, 1) == [("tx", b"after-retry")]
    assert torch.equal(buf[:4096], data)
    assert [r.role for r in tx.pairings()] == ["sender"]


def test_disconnect_then_reconnect_makes_a_new_pair(make) -> None:
    rx, tx = make("rx"), make("tx")
    buf = _recv_buffer(rx, MIB)
    base = rx.info().regions[0].addr
    peer = _connect(rx, tx)
    tx.wait(tx.write(peer, [_random(1000, 1)], [base], b"first"), WAIT_S)
    tx.disconnect(peer)
    assert _eventually(lambda: _recv_threads("rx") == []), "the receiver kept serving a pair its sender left"
    with pytest.raises(PeerUnreachable):
        tx.write(peer, [_random(10, 2)], [base], b"x")
    assert _connect(rx, tx) == peer
    assert _recv_threads("rx") == ["nccl-recv:rx<-tx"]
    data = _random(5000, 3)
    tx.wait(tx.write(peer, [data], [base + 7], b"second"), WAIT_S)
    assert _collect(rx, 2) == [("tx", b"first"), ("tx", b"second")]
    assert torch.equal(buf[7 : 7 + 5000], data)


def test_disconnect_returns_at_once_while_a_posted_write_is_still_on_the_wire(make) -> None:
    """The sender's service thread calls disconnect: it must not wait for the pair's writes."""
    rx, tx = make("rx"), make("tx", close_timeout_s=10.0)
    _recv_buffer(rx, MIB)
    gate = threading.Event()
    real_view = rx._receiver.hooks.slot_view

    def held_view(chunk):  # the receiver takes the write in only once the gate opens
        gate.wait(WAIT_S)
        return real_view(chunk)

    rx._receiver.hooks = dataclasses.replace(rx._receiver.hooks, slot_view=held_view)
    peer = _connect(rx, tx)
    handle = tx.write(peer, [_random(64 * KIB, 1)], [rx.info().regions[0].addr], b"held")
    opener = threading.Timer(3.0, gate.set)
    opener.start()
    try:
        tx.disconnect(peer)
        returned_before_the_write_ended = not gate.is_set()
        assert not tx.settled(handle), "a write still on the wire was reported settled"
    finally:
        gate.set()
        opener.cancel()
    assert returned_before_the_write_ended, "disconnect waited for the pair's write instead of returning"
    assert _eventually(lambda: tx.settled(handle)), "the write never settled after its pair was stopped"
    # Whether the held write still lands or is aborted with its pair depends on which side's teardown
    # wins (both are correct); what matters is that a notification never precedes its bytes.
    assert _collect(rx, 1) in ([("tx", b"held")], [])


class _DoorbellStore:
    """A sender pair's store client: doorbell 0 waits until ``go`` is set, doorbell 1 fails."""

    def __init__(self, store, go: threading.Event) -> None:
        self._store, self._go, self._rung = store, go, 0

    def set(self, key, value) -> None:
        self._rung += 1
        if self._rung == 2:
            raise RuntimeError("store lost (test)")
        self._go.wait(WAIT_S)
        self._store.set(key, value)

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_a_write_left_on_a_broken_pair_settles_only_once_it_can_no_longer_read_its_source(make) -> None:
    """The pair breaks (a doorbell fails) while an earlier write's send still waits for its
    receiver. A posted Gloo send reads its source whenever the receiver posts its receive, even
    after abort() and with its group deleted, until its Work is destroyed (seen with torch 2.13):
    a write may be reported settled (its memory reused) only once its Works are gone, so the
    receiver never gets reused bytes under that write's notification. The pair thread is held
    right after settling (its group still alive), as a loaded machine may deschedule it there.
    A regression guard: with the Works kept past settling, the reused bytes arrive."""
    rx, tx = make("rx"), make("tx")
    buf = _recv_buffer(rx, MIB)
    base = rx.info().regions[0].addr
    gate = threading.Event()
    real_view = rx._receiver.hooks.slot_view

    def held_view(chunk):  # the receiver posts its receive only once the gate opens
        gate.wait(WAIT_S)
        return real_view(chunk)

    rx._receiver.hooks = dataclasses.replace(rx._receiver.hooks, slot_view=held_view)
    peer = _connect(rx, tx)
    pair = tx._sender.pair(peer)
    both_queued, resume = threading.Event(), threading.Event()
    pair._store = _DoorbellStore(pair._store, both_queued)
    settle = pair._settle_broken

    def settle_then_pause() -> None:
        settle()
        resume.wait(WAIT_S)

    pair._settle_broken = settle_then_pause
    data = _random(64 * KIB, 1)
    original = data.clone()
    held = tx.write(peer, [data], [base], b"held")
    failing = tx.write(peer, [_random(KIB, 2)], [base + 128 * KIB], b"second")
    both_queued.set()
    try:
        with pytest.raises(TransportError):
            tx.wait(failing, WAIT_S)
        assert _eventually(lambda: tx.settled(held)), "the broken pair's write never settled"
        data.fill_(0xEE)  # its caller reuses the memory of a settled write
        gate.set()
        got = _collect(rx, 1, timeout_s=3.0)
    finally:
        gate.set()
        resume.set()
    assert got in ([], [("tx", b"held")])
    if got:
        assert torch.equal(buf[: 64 * KIB], original), "a notification came with bytes written after its write settled"


class _GatedStore:
    """A sender pair's store client whose doorbells ring only once ``go`` is set."""

    def __init__(self, store, go: threading.Event) -> None:
        self._store, self._go = store, go

    def set(self, key, value) -> None:
        self._go.wait(WAIT_S)
        self._store.set(key, value)

    def __getattr__(self, name):
        return getattr(self._store, name)


def _two_writes_announced_before_the_first_is_received(rx: NcclTransport, tx: NcclTransport, peer: str) -> None:
    """Hold the receiver's admission of doorbell 0 until the sender rang doorbell 1: both writes'
    receives are then posted before the first completes. Before pairing: a pair keeps its hooks."""
    real_admit = rx._receiver.hooks.admit
    admitted = []

    def admit_once_both_rang(sender, header):
        if not admitted:
            assert _eventually(lambda: tx._sender.pair(peer)._seq == 2), "the sender never announced its second write"
        admitted.append(header)
        real_admit(sender, header)

    rx._receiver.hooks = dataclasses.replace(rx._receiver.hooks, admit=admit_once_both_rang)


def test_a_receiver_stopped_with_receives_posted_still_receives_the_announced_writes(make) -> None:
    """``stop`` (the sender left or was replaced) lands while a write is being received and the next
    one's receives are already posted: the announced writes are still received and notified,
    instead of their requests waiting for their KV timeout."""
    rx, tx = make("rx"), make("tx")
    buf = _recv_buffer(rx, MIB)
    base = rx.info().regions[0].addr
    real_notify = rx._receiver.hooks.notify

    def notify_then_stop(sender, payload):
        real_notify(sender, payload)
        if payload == b"w0":
            rx.disconnect(sender)  # the receive service drops the sender right after its first write

    rx._receiver.hooks = dataclasses.replace(rx._receiver.hooks, notify=notify_then_stop)
    _two_writes_announced_before_the_first_is_received(rx, tx, "rx")
    peer = _connect(rx, tx)
    pair = tx._sender.pair(peer)
    queued = threading.Event()
    pair._store = _GatedStore(pair._store, queued)  # both writes are queued before the first is posted
    data = [_random(64 * KIB, 1), _random(64 * KIB, 2)]
    for i, src in enumerate(data):
        tx.write(peer, [src], [base + i * 128 * KIB], b"w%d" % i)
    queued.set()
    assert _collect(rx, 2) == [("tx", b"w0"), ("tx", b"w1")], "a write announced before the stop was dropped"
    assert torch.equal(buf[: 64 * KIB], data[0]) and torch.equal(buf[128 * KIB : 192 * KIB], data[1])
    assert _eventually(lambda: _recv_threads("rx") == []), "the stopped pair's thread did not end"


def test_a_posted_write_that_never_lands_is_reported_failed_once_its_pair_is_down(make) -> None:
    """The sender announces a write whose bytes never come: the receiver's pair fails at that
    write's deadline, and the write is reported failed (its request can fail at once) only
    after the pair's group was torn down; the write received before it is notified as usual."""
    rx, tx = make("rx", timeout_s=2.0), make("tx")
    _recv_buffer(rx, MIB)
    base = rx.info().regions[0].addr
    events: list[str] = []
    real_failed = rx._receiver.hooks.write_failed
    real_drop = group_ops.drop_group

    def slow_drop(group):
        time.sleep(0.5)  # a slow abort: the failure must still come after it
        real_drop(group)
        events.append("torn down")

    def failed(sender, payload, why):
        real_failed(sender, payload, why)
        events.append("reported")  # once queued: the test reads the failure when it sees this

    rx._receiver.hooks = dataclasses.replace(rx._receiver.hooks, write_failed=failed)
    peer = _connect(rx, tx)
    pair = tx._sender.pair(peer)
    real_send = pair._send
    pair._send = lambda src, piece_bytes, deadline: [] if src.numel() == KIB else real_send(src, piece_bytes, deadline)
    with _patch.object(group_ops, "drop_group", slow_drop):
        tx.write(peer, [_random(64 * KIB, 1)], [base], b"landed")
        tx.write(peer, [_random(KIB, 2)], [base + 128 * KIB], b"never")  # its doorbell rings, no byte follows
        assert _collect(rx, 1) == [("tx", b"landed")]
        assert _eventually(lambda: "reported" in events, timeout_s=WAIT_S), "the failed write was never reported"
    assert [(n.peer, n.payload) for n in rx.get_failed_writes()] == [("tx", b"never")]
    assert events.index("torn down") < events.index("reported"), "reported failed before its pair was torn down"
    assert rx.get_failed_writes() == [] and _collect(rx, 1, timeout_s=0.5) == []


def test_an_idle_receiver_whose_stop_wake_missed_still_ends(make) -> None:
    """A stop whose BYE went where the thread does not wait (the doorbell moved on meanwhile) is
    still seen: an idle serving thread re-checks its flag, it does not sleep out its idle wait."""
    rx, tx = make("rx"), make("tx")
    _recv_buffer(rx, MIB)
    _connect(rx, tx)
    assert _eventually(lambda: _serving(rx, "tx"))
    rx._receiver.serving("tx").stop(None)  # the flag only: no wake reaches the doorbell
    assert _eventually(lambda: _recv_threads("rx") == [], timeout_s=WAIT_S), "a stopped idle pair kept waiting"


def test_write_guard_refuses_a_write_before_any_byte_of_it_is_received(make) -> None:
    rx, tx = make("rx"), make("tx")
    buf = _recv_buffer(rx, MIB)
    base = rx.info().regions[0].addr
    asked: list[tuple[str, list[tuple[int, int]], bytes]] = []

    def guard(sender: str, dests: list[tuple[int, int]], notif: bytes) -> str:
        asked.append((sender, dests, notif))
        return "" if notif.startswith(b"granted") else "not granted to this sender"

    rx.set_write_guard(guard)
    peer = _connect(rx, tx)
    good = _random(64 * KIB, 1)
    tx.wait(tx.write(peer, [good], [base], b"granted"), WAIT_S)
    assert _collect(rx, 1) == [("tx", b"granted")]
    assert torch.equal(buf[: 64 * KIB], good)
    handle = tx.write(peer, [_random(64 * KIB, 2), _random(KIB, 3)], [base + 128 * KIB, base + 256 * KIB], b"stray")
    with contextlib.suppress(TransportError):  # Gloo may report the send done once its bytes are buffered
        tx.wait(handle, WAIT_S)
    assert _eventually(lambda: _recv_threads("rx") == []), "a refused write must end the pair"
    assert asked[1] == ("tx", [(base + 128 * KIB, 64 * KIB), (base + 256 * KIB, KIB)], b"stray")
    assert not buf[64 * KIB :].any(), "bytes of a refused write landed"
    assert _collect(rx, 1, timeout_s=0.5) == []
    # The sender drops the broken pair and reconnects (a new Hello); its granted writes flow again.
    tx.disconnect(peer)
    assert _connect(rx, tx) == peer
    again = _random(KIB, 4)
    tx.wait(tx.write(peer, [again], [base + 512 * KIB], b"granted-again"), WAIT_S)
    assert _collect(rx, 1) == [("tx", b"granted-again")]
    assert torch.equal(buf[512 * KIB : 513 * KIB], again)


def test_receiver_disconnect_stops_a_pair_still_pairing(make) -> None:
    rx, tx = make("rx"), make("tx", timeout_s=2.0)
    _recv_buffer(rx, MIB)
    rx.accept(tx.info())
    assert _recv_threads("rx") == ["nccl-recv:rx<-tx"]
    rx.disconnect("tx")  # before the sender joined: the offer is retracted, the thread ends
    assert _eventually(lambda: _recv_threads("rx") == []), "a pairing thread outlived its sender's disconnect"
    with pytest.raises(PeerUnreachable):
        tx.connect(rx.info(), 2.0)


def test_killed_sender_restarted_under_the_same_name_gets_a_new_pair(fresh_pair) -> None:
    pair = fresh_pair
    first, _ = pair.tx.call("write", pair.peer, [(0, 4096)], [pair.slot_addr(0)], b"before-kill")
    pair.tx.call("wait", first, WAIT_S)
    assert pair.rx.call("notifications", 1, WAIT_S) == [(pair.tx.name, b"before-kill")]
    pair.tx.kill()
    restarted = type(pair.tx)(pair.case, pair.tx.name, "tx")  # conftest's PeerProcess, same transport name
    try:
        tx_info = restarted.call("setup", 4 * MIB, 0)
        pair.rx.call("accept", tx_info)
        assert restarted.call("connect", pair.rx_info_bytes, WAIT_S) == pair.peer
        handle, digests = restarted.call("write", pair.peer, [(13, 100_000)], [pair.slot_addr(2)], b"after-restart")
        pair.rx.begin("notifications", 1, WAIT_S)
        restarted.call("wait", handle, WAIT_S)
        assert pair.rx.finish("notifications", WAIT_S + 5) == [(pair.tx.name, b"after-restart")]
        landed, _ = pair.rx.call("check", [(2 * pair.slot_bytes, 100_000)], pair.fill)
        assert landed == digests
    finally:
        restarted.stop()


def test_receiver_close_while_a_sender_is_connected_does_not_hang(make) -> None:
    # a close that has to wait out its close timeout (a thread that did not end) takes 20 s: the bounds below are
    # half that, far above what a loaded machine adds to a close that joins at once
    rx = make("rx", close_timeout_s=20.0)
    tx = make("tx", timeout_s=3.0, close_timeout_s=20.0)
    _recv_buffer(rx, MIB)
    base = rx.info().regions[0].addr
    peer = _connect(rx, tx)
    tx.wait(tx.write(peer, [_random(4096, 1)], [base], b"ok"), WAIT_S)
    start = time.monotonic()
    rx.close()
    assert time.monotonic() - start < 10.0
    assert _recv_threads("rx") == []
    start = time.monotonic()
    handle = tx.write(peer, [_random(4096, 2)], [base], b"too-late")
    with pytest.raises(TransportError):
        tx.wait(handle, 60.0)
    assert time.monotonic() - start < 30.0, "the sender waited for the wait's timeout, not its 3 s deadline"
    with pytest.raises(PeerUnreachable):
        tx.write(peer, [_random(16, 3)], [base], b"down")
    start = time.monotonic()
    tx.close()
    assert time.monotonic() - start < 10.0


def test_accept_returns_at_once_and_an_absent_sender_is_given_up(make) -> None:
    rx = make("rx", timeout_s=5.0)
    tx = make("ghost")
    start = time.monotonic()
    rx.accept(tx.info())
    assert time.monotonic() - start < 2.5  # not the 5 s pairing wait (a loaded machine can stall a thread's start)
    assert _recv_threads("rx") == ["nccl-recv:rx<-ghost"]
    assert _eventually(lambda: _recv_threads("rx") == [], timeout_s=30.0)
    with pytest.raises(PeerUnreachable):  # the expired offer was retracted: nobody may join it late
        tx.connect(rx.info(), 1.0)


def test_close_with_a_pairing_in_flight_returns_at_once(make) -> None:
    rx = make("rx", timeout_s=60.0)
    rx.accept(TransportInfo(kind="nccl", name="ghost"))
    time.sleep(0.3)  # it has offered and waits for the claim
    start = time.monotonic()
    rx.close()
    # not the 60 s pairing wait; the margin is for a loaded 2-core CI machine (it took 1.02 s there once)
    assert time.monotonic() - start < 10.0
    assert _recv_threads("rx") == []


def test_typed_multi_dimensional_buffers_land_bytewise(make) -> None:
    rx, tx = make("rx"), make("tx")
    kv = torch.zeros(2, 4, 64, 32, dtype=torch.bfloat16)  # a KV_2LTD-shaped receive buffer
    rx.register(kv)
    base = rx.info().regions[0].addr
    peer = _connect(rx, tx)
    chunk = torch.randn(4, 64, 32).to(torch.bfloat16)
    tx.wait(tx.write(peer, [chunk], [base + kv[1].data_ptr() - kv.data_ptr()], b"v"), WAIT_S)
    assert _collect(rx, 1) == [("tx", b"v")]
    assert torch.equal(kv[1], chunk)
    assert not kv[0].any()


def test_connect_without_accept_is_unreachable_after_its_timeout(make) -> None:
    rx, tx = make("rx"), make("tx", timeout_s=60.0)
    start = time.monotonic()
    with pytest.raises(PeerUnreachable, match="accept"):
        tx.connect(rx.info(), 1.0)
    assert 1.0 <= time.monotonic() - start < 10.0  # its own 1 s, not the transport's 60 s


def test_connect_to_a_closed_port_is_unreachable(make) -> None:
    tx = make("tx")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(PeerUnreachable):
        tx.connect(TransportInfo(kind="nccl", name="nobody", host="127.0.0.1", port=port), 1.0)


def test_writes_are_checked_before_they_are_queued(make) -> None:
    rx, tx = make("rx"), make("tx")
    _recv_buffer(rx, 4096)
    base = rx.info().regions[0].addr
    peer = _connect(rx, tx)
    with pytest.raises(ValueError, match="outside"):
        tx.write(peer, [torch.zeros(100, dtype=torch.uint8)], [base + 4000], b"")
    with pytest.raises(ValueError):
        tx.write(peer, [torch.zeros(1, dtype=torch.uint8)], [base, base + 1], b"")
    with pytest.raises(ValueError, match="contiguous"):
        tx.write(peer, [torch.zeros(8, 8, dtype=torch.uint8).t()], [base], b"")
    with pytest.raises(PeerUnreachable):
        tx.write("stranger", [torch.zeros(1, dtype=torch.uint8)], [base], b"")
    with pytest.raises(PeerUnreachable, match="speaks"):
        tx.connect(TransportInfo(kind="nixl", name="other"), 1.0)


class _HeldStore(_GatedStore):
    """A gated store client that also says when the pair's thread first tried to ring."""

    def __init__(self, store, go: threading.Event, entered: threading.Event) -> None:
        super().__init__(store, go)
        self._entered = entered

    def set(self, key, value) -> None:
        self._entered.set()
        super().set(key, value)


def test_a_full_send_queue_refuses_a_write_at_once_and_keeps_nothing_of_it(make) -> None:
    """A pair whose thread cannot post (its doorbell hangs) holds at most ``max_queued_writes``
    writes: one more is refused at once with an error naming the setting, nothing of it queued,
    the pair stays up, and the queued writes land once the thread moves again."""
    with pytest.raises(ValueError, match="max_queued_writes"):
        NcclTransport("bad", max_queued_writes=0)
    rx, tx = make("rx"), make("tx", max_queued_writes=2)
    buf = _recv_buffer(rx, MIB)
    base = rx.info().regions[0].addr
    peer = _connect(rx, tx)
    pair = tx._sender.pair(peer)
    go, entered = threading.Event(), threading.Event()
    pair._store = _HeldStore(pair._store, go, entered)
    data = [_random(4 * KIB, i + 1) for i in range(4)]
    handles = [tx.write(peer, [data[0]], [base], b"w0")]
    assert entered.wait(WAIT_S), "the pair's thread never took the first write"
    handles += [tx.write(peer, [data[i]], [base + i * 8 * KIB], b"w%d" % i) for i in (1, 2)]
    with pytest.raises(TransportError, match=r"holds 2 writes.*raise p2p\.nccl_max_queued_writes") as refused:
        tx.write(peer, [data[3]], [base + 3 * 8 * KIB], b"w3")
    assert not isinstance(refused.value, PeerUnreachable), "a full queue is not a broken pair"
    assert pair._queue.qsize() == 2 and not pair.down, "the refused write was queued or took the pair down"
    go.set()
    for handle in handles:
        tx.wait(handle, WAIT_S)
    assert _collect(rx, 3) == [("tx", b"w0"), ("tx", b"w1"), ("tx", b"w2")]
    tx.wait(tx.write(peer, [data[3]], [base + 3 * 8 * KIB], b"w3"), WAIT_S)  # room again once drained
    assert _collect(rx, 1) == [("tx", b"w3")]
    for i, src in enumerate(data):
        assert torch.equal(buf[i * 8 * KIB : i * 8 * KIB + 4 * KIB], src)


def test_construction_opens_nothing_and_a_failed_start_leaves_it_closed() -> None:
    """The store listens only from start(); a start that cannot bind raises, closes, and stays closed."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    transport = NcclTransport("rx", port=port)
    assert _listen_addresses(port) == set(), "the constructor opened the store"
    with pytest.raises(ClosedError, match="not started"):
        transport.info()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        with pytest.raises(TransportError):
            transport.start()
    transport.close()
    transport.close()
    with pytest.raises(ClosedError, match="closed"):
        transport.start()
    started = NcclTransport("rx2", port=port).start()
    try:
        assert started.start() is started and started.info().port == port  # a second start does nothing
    finally:
        started.close()


def _listen_addresses(port: int) -> set[str]:
    """Local addresses of the LISTEN sockets on ``port`` (Linux /proc/net/tcp[6], hex encoded)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, port_hex = local.rsplit(":", 1)
            if state == "0A" and int(port_hex, 16) == port:
                found.add(addr)
    return found


def test_the_store_listens_on_the_configured_host_only(make) -> None:
    port = make("rx").info().port
    addresses = _listen_addresses(port)
    if not addresses:
        pytest.skip("no /proc/net/tcp to inspect")
    assert addresses == {"0100007F"}, f"store listens on {addresses}, expected 127.0.0.1 only"


# ---- on the GPU machine ----------------------------------------------------------------------

needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"
)


@pytest.fixture
def nccl_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


def _gpu_round_trip(
    make, rx_buffer: Callable[[NcclTransport], torch.Tensor], src_of: Callable[[int, int], torch.Tensor], **tx_kwargs
) -> None:
    rx = make("rx", device="cuda:1")
    tx = make("tx", device="cuda:0", **tx_kwargs)
    buf = rx_buffer(rx)
    base = rx.info().regions[0].addr
    peer = _connect(rx, tx)
    sizes = [1, 4093, 3 * MIB + 5, 8 * MIB]
    offsets = [0, 4 * KIB, MIB, 8 * MIB]
    srcs = [src_of(n, seed) for seed, n in enumerate(sizes)]
    handles = [
        tx.write(peer, srcs[:2], [base + o for o in offsets[:2]], b"a"),
        tx.write(peer, srcs[2:], [base + o for o in offsets[2:]], b"b"),
    ]
    for handle in handles:
        tx.wait(handle, WAIT_S)
    assert _collect(rx, 2) == [("tx", b"a"), ("tx", b"b")]
    for src, offset, n in zip(srcs, offsets, sizes):
        assert torch.equal(buf[offset : offset + n].cpu(), src.cpu()), f"chunk of {n} bytes at {offset} differs"


@pytest.mark.gpu
@needs_two_gpus
def test_gpu_device_sources_into_a_device_buffer(make, nccl_env) -> None:
    _gpu_round_trip(make, lambda rx: _recv_buffer(rx, 32 * MIB, "cuda:1"), lambda n, s: _random(n, s, "cuda:0"))


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("pin", [True, False], ids=["pinned", "pageable"])
def test_gpu_host_sources_are_staged_through_the_ring(make, nccl_env, pin: bool) -> None:
    # 1 MiB slots x 3: an 8 MiB chunk wraps the ring several times.
    _gpu_round_trip(
        make,
        lambda rx: _recv_buffer(rx, 32 * MIB, "cuda:1"),
        lambda n, s: _random(n, s, pin=pin),
        stage_slot_bytes=MIB,
        stage_slots=3,
    )


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("pin", [True, False], ids=["pinned", "pageable"])
def test_gpu_host_receive_buffer(make, nccl_env, pin: bool) -> None:
    _gpu_round_trip(make, lambda rx: _recv_buffer(rx, 32 * MIB, pin=pin), lambda n, s: _random(n, s, "cuda:0"))


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("source", ["cuda", "pinned"])
def test_gpu_throughput(make, nccl_env, source: str) -> None:
    """Not a pass/fail bound: prints GB/s of 1 GiB in 32 MiB chunks, 8 chunks per write."""
    rx = make("rx", device="cuda:1")
    tx = make("tx", device="cuda:0")
    chunk, count = 32 * MIB, 32
    _recv_buffer(rx, chunk * count, "cuda:1")
    base = rx.info().regions[0].addr
    peer = _connect(rx, tx)
    pool = (
        torch.empty(chunk * count, dtype=torch.uint8, device="cuda:0")
        if source == "cuda"
        else torch.empty(chunk * count, dtype=torch.uint8, pin_memory=True)
    )
    chunks = [pool[i * chunk : (i + 1) * chunk] for i in range(count)]
    for _ in range(2):  # warm-up, then the measured round
        start = time.monotonic()
        handles = [
            tx.write(peer, chunks[i : i + 8], [base + j * chunk for j in range(i, i + 8)], b"w")
            for i in range(0, count, 8)
        ]
        for handle in handles:
            tx.wait(handle, WAIT_S)
        elapsed = time.monotonic() - start
        _collect(rx, len(handles))
    print(
        f"\nNCCL transport {source} -> cuda: {chunk * count / elapsed / 1e9:.1f} GB/s ({elapsed * 1e3:.1f} ms per GiB)"
    )


# ---- keeping NCCL failures inside one pair ------------------------------------------------------


@pytest.mark.parametrize("before, after", [
    ({}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0"}),
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
                                                 "TORCH_NCCL_ENABLE_MONITORING": "0"}),
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_ENABLE_MONITORING": "1"},
     {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "1"}),
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
                                                 "TORCH_NCCL_ENABLE_MONITORING": "0"}),
])
def test_nccl_pairs_never_run_with_a_process_ending_error_mode(before: dict, after: dict) -> None:
    from lmcache_p2p.transport.nccl.group import nccl_env_for_pairs

    env = dict(before)
    nccl_env_for_pairs(env)
    assert env == after
    assert nccl_env_for_pairs(env) == {}, "a second call changed the environment again"


def test_importing_and_building_gloo_transports_leaves_the_environment_alone() -> None:
    """The NCCL settings are applied right before an NCCL group is built: never at import, never
    for Gloo (a CPU-only engine's environment stays as its operator set it)."""
    import os
    import subprocess
    import sys

    code = (
        "import os; before = dict(os.environ)\n"
        "from lmcache_p2p.transport.nccl.transport import NcclTransport\n"
        "NcclTransport('probe', device='cpu').start().close()\n"
        "print(sorted(k for k in set(os.environ) ^ set(before) if k.startswith('TORCH_NCCL')))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_NCCL")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.gpu
@needs_two_gpus
def test_gpu_host_receive_buffer_gets_nothing_of_a_failed_receive(make, nccl_env) -> None:
    """A GPU pair receiving into pinned host memory (the receive ring): the sender sends only the
    first piece of a write, so the receive of the second fails at its deadline and the pair is
    aborted. No byte of the failed pieces may reach the host buffer, before or after the write
    is reported failed (a copy-out queued behind a receive would land after the abort)."""
    rx = make("rx", device="cuda:1", timeout_s=3.0, stage_slot_bytes=MIB)
    tx = make("tx", device="cuda:0")
    buf = torch.full((8 * MIB,), 0x11, dtype=torch.uint8, pin_memory=True)
    rx.register(buf)
    base = rx.info().regions[0].addr
    peer = _connect(rx, tx)
    pair = tx._sender.pair(peer)
    real_send = pair._send
    pair._send = lambda src, piece_bytes, deadline: real_send(src[:MIB], piece_bytes, deadline)
    src = _random(4 * MIB, 1, device="cuda:0")
    tx.write(peer, [src], [base], b"partial")
    failed: list = []

    def reported() -> bool:
        failed.extend(rx.get_failed_writes())
        return bool(failed)

    assert _eventually(reported, timeout_s=WAIT_S), "the failed write was never reported"
    assert [(n.peer, n.payload) for n in failed] == [("tx", b"partial")]
    time.sleep(1.0)  # a copy-out queued behind the failed receive would have landed by now
    assert bool((buf[MIB : 4 * MIB] == 0x11).all()), "bytes of a failed receive reached the host buffer"
    assert _collect(rx, 1, timeout_s=0.5) == []
