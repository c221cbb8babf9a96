"""ReceiveService integrity: quarantined slots, Written ownership, the KV fingerprint, pair teardown.

The service runs for real (its thread, its ZMQ control socket); senders are DEALER sockets speaking
the protocol, the transport is a fake whose notifications the test injects, and the pool's clock
is the test's, so lease and quarantine expiry happen exactly when the test moves time.
"""

from __future__ import annotations

import collections
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence

import pytest
import zmq

from lmcache_p2p import protocol
from lmcache_p2p.backend.receive_service import ReceiveService
from lmcache_p2p.buffer import SlotPool, SlotState
from lmcache_p2p.config import P2PConfig
from lmcache_p2p.errors import ClosedError, ProtocolError
from lmcache_p2p.transport.base import Notification, Transport, WriteHandle

from fake_proxy import FakeProxy

SLOT_BYTES = 4096
REGION_ADDR = 1 << 20
REPLY_TIMEOUT_MS = 30_000  # bounds a reply of the service thread, which a loaded machine can hold for seconds
SHAPE = protocol.ChunkShape([2, 2, 16, 64], "bfloat16", SLOT_BYTES)
FINGERPRINT = protocol.Fingerprint(model="tiny", num_layers=2, kv_heads=2, head_size=32, dtype="bfloat16",
                                   chunk_tokens=16, tp_size=1, tp_rank=0, kv_format="KV_2LTD",
                                   weights="files:0123")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def eventually(check: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeTransport(Transport):
    """Receiver side only: notifications are injected by the test; disconnects are recorded."""

    kind = "loopback"

    def __init__(self) -> None:
        self.notifs: collections.deque[Notification] = collections.deque()
        self.failed: collections.deque[Notification] = collections.deque()
        self.disconnected: list[str] = []
        self.disconnect_gate = threading.Event()
        self.disconnect_gate.set()
        self.guard = None

    def start(self) -> FakeTransport:
        return self

    def register(self, tensor):  # pragma: no cover - unused
        raise NotImplementedError

    def info(self) -> protocol.TransportInfo:
        return protocol.TransportInfo(kind=self.kind, name="rx")

    def accept(self, peer) -> None:  # two-sided, like NCCL: it has a write guard and failed writes
        pass

    def connect(self, peer, timeout_s):  # pragma: no cover - unused
        raise NotImplementedError

    def set_write_guard(self, guard) -> None:
        self.guard = guard

    def write(self, peer, srcs, dst_addrs, notif) -> WriteHandle:  # pragma: no cover - unused
        raise NotImplementedError

    def poll(self, handle) -> bool:  # pragma: no cover - unused
        return True

    def get_notifications(self) -> list[Notification]:
        out = []
        while self.notifs:
            out.append(self.notifs.popleft())
        return out



    def get_failed_writes(self) -> list[Notification]:
        out = []
        while self.failed:
            out.append(self.failed.popleft())
        return out

    def disconnect(self, peer: str) -> None:
        self.disconnect_gate.wait(30)  # a test may hold this to show the control thread is not blocked
        self.disconnected.append(peer)

    def close(self) -> None:
        pass

    def land(self, peer: str, sender_id: str, req_id: str, slots: Sequence[int]) -> None:
        self.notifs.append(Notification(peer, protocol.encode(protocol.Written(sender_id, req_id, list(slots)))))


    def fail_write(self, peer: str, sender_id: str, req_id: str, slots: Sequence[int]) -> None:
        self.failed.append(Notification(peer, protocol.encode(protocol.Written(sender_id, req_id, list(slots)))))


class Sender:
    """A DEALER socket speaking the control protocol as sender ``sender_id`` with transport ``writer``."""

    def __init__(self, ctx: zmq.Context, endpoint: str, sender_id: str, writer: str) -> None:
        self.sender_id, self.writer = sender_id, writer
        self.codec = protocol.Codec()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, REPLY_TIMEOUT_MS)
        self.sock.connect(endpoint)
        self.seq = 0

    def send(self, msg: protocol.Message) -> None:
        self.sock.send_multipart(self.codec.pack(msg))

    def call(self, msg: protocol.Message) -> protocol.Message:
        self.send(msg)
        return self.codec.unpack(self.sock.recv_multipart())

    def hello(self, fingerprint: protocol.Fingerprint | None = FINGERPRINT) -> protocol.Message:
        info = protocol.TransportInfo(kind="loopback", name=self.writer)
        rank = fingerprint.tp_rank if fingerprint is not None else 0
        return self.call(protocol.Hello(protocol.PROTOCOL_VERSION, self.sender_id, rank, info, fingerprint))

    def alloc(self, req_id: str, keys: list[str], last: bool = True,
              shape: protocol.ChunkShape = SHAPE) -> protocol.Message:
        self.seq += 1
        return self.call(protocol.Alloc(self.seq, req_id, keys, [shape] * len(keys), last))

    def cancel(self, req_id: str) -> protocol.Message:
        self.seq += 1
        return self.call(protocol.Cancel(self.seq, req_id, "test"))


class Rig:
    def __init__(self, num_slots: int = 2, fingerprint: protocol.Fingerprint | None = FINGERPRINT, buffer=None,
                 **cfg) -> None:
        self.cfg = P2PConfig.from_mapping({"role": "receiver", "control_ports": [free_port()],
                                           "transfer_timeout_s": 30, "quarantine_margin_s": 5, **cfg})
        self.clock = Clock()
        self.pool = SlotPool(num_slots, clock=self.clock, write_window_s=self.cfg.write_window_s)
        self.transport = FakeTransport()
        self.service = ReceiveService(self.cfg, tp_rank=0, tp_size=1, transport=self.transport, pool=self.pool,
                                      slot_bytes=SLOT_BYTES, region_addr=REGION_ADDR, chunk_tokens=16,
                                      dtype="bfloat16", fingerprint=fingerprint, buffer=buffer).start()
        self.ctx = zmq.Context()
        self.senders: list[Sender] = []

    def sender(self, sender_id: str, writer: str, hello: bool = True) -> Sender:
        sender = Sender(self.ctx, self.service.control_endpoint, sender_id, writer)
        self.senders.append(sender)
        if hello:
            welcome = sender.hello()
            assert isinstance(welcome, protocol.Welcome)
            # the sender times its writes against our window (a late write must not land in a re-granted slot)
            assert welcome.transfer_timeout_s == self.cfg.transfer_timeout_s
        return sender

    def granted(self, sender: Sender, req_id: str, keys: list[str]) -> list[int]:
        grant = sender.alloc(req_id, keys)
        assert isinstance(grant, protocol.Grant), grant
        return grant.slots

    def close(self) -> None:
        self.transport.disconnect_gate.set()
        for sender in self.senders:
            sender.sock.close()
        self.service.close()
        self.ctx.term()


@pytest.fixture
def make_rig() -> Iterator[Callable[..., Rig]]:
    rigs: list[Rig] = []

    def make(**kwargs) -> Rig:
        rigs.append(Rig(**kwargs))
        return rigs[-1]

    yield make
    for rig in rigs:
        rig.close()


# ---- quarantine: a cancelled request's slot is not granted while its write may still land --------


def test_cancelled_slot_is_not_granted_again_until_its_writer_confirms(make_rig) -> None:
    rig = make_rig(num_slots=2)
    a = rig.sender("sender-a", "tx-a")
    (slot_a,) = rig.granted(a, "req-a", ["k1"])
    assert isinstance(a.cancel("req-a"), protocol.Ack)
    assert rig.pool.state(slot_a) is SlotState.QUARANTINED
    # The other slot is granted; the quarantined one is not, even with the buffer otherwise full.
    (slot_b,) = rig.granted(a, "req-b", ["k2"])
    assert slot_b != slot_a
    refused = a.alloc("req-c", ["k3"])
    assert isinstance(refused, protocol.Refused) and refused.code is protocol.RefusalCode.FULL
    # The cancelled write lands late: it is confirmed, never READY, never indexed.
    rig.transport.land("tx-a", "sender-a", "req-a", [slot_a])
    assert eventually(lambda: rig.pool.state(slot_a) is SlotState.FREE)
    assert eventually(lambda: rig.service.counters.slots_confirmed == 1)  # counted just after the slot is freed
    assert rig.service.count_ready(["k1"]) == 0
    assert rig.granted(a, "req-d", ["k4"]) == [slot_a]


def test_a_write_the_transport_reports_failed_fails_its_request_and_frees_its_slots_at_once(make_rig) -> None:
    """A two-sided transport reports a write whose receive failed once nothing more of it lands:
    the request fails now (its next batch is refused FINISHED) and its slots are free again,
    without waiting for its lease or its write window."""
    rig = make_rig(num_slots=2)
    a = rig.sender("sender-a", "tx-a")
    slots = rig.granted(a, "req-a", ["k1", "k2"])
    rig.transport.fail_write("tx-b", "sender-a", "req-a", slots)  # another peer's report changes nothing
    time.sleep(0.2)
    assert [rig.pool.state(s) for s in slots] == [SlotState.RESERVED] * 2
    rig.transport.fail_write("tx-a", "sender-a", "req-a", slots)
    assert eventually(lambda: all(rig.pool.state(s) is SlotState.FREE for s in slots))
    refused = a.alloc("req-a", ["k3"])
    assert isinstance(refused, protocol.Refused) and refused.code is protocol.RefusalCode.FINISHED
    assert sorted(rig.granted(a, "req-b", ["k4", "k5"])) == sorted(slots)


def test_cancelled_slot_returns_after_the_write_window_without_confirmation(make_rig) -> None:
    rig = make_rig(num_slots=1)
    a = rig.sender("sender-a", "tx-a")
    (slot,) = rig.granted(a, "req-a", ["k1"])
    a.cancel("req-a")
    rig.clock.now += rig.cfg.write_window_s - 1
    time.sleep(0.2)  # several expiry rounds of the service thread: still quarantined
    assert rig.pool.state(slot) is SlotState.QUARANTINED
    assert isinstance(a.alloc("req-b", ["k2"]), protocol.Refused)
    rig.clock.now += 1
    assert eventually(lambda: rig.pool.state(slot) is SlotState.FREE)
    assert rig.granted(a, "req-c", ["k3"]) == [slot]


def test_expired_reserve_lease_quarantines_and_a_stale_written_never_makes_it_ready(make_rig) -> None:
    rig = make_rig(num_slots=1, reserve_lease_s=40)
    a = rig.sender("sender-a", "tx-a")
    (slot,) = rig.granted(a, "req-a", ["k1"])
    rig.clock.now += 40  # lease passed; the write window (35 s) too: nothing can land any more
    assert eventually(lambda: rig.pool.state(slot) is SlotState.FREE)
    (again,) = rig.granted(a, "req-b", ["k2"])
    assert again == slot
    rig.transport.land("tx-a", "sender-a", "req-a", [slot])  # the old request's Written, very late
    time.sleep(0.2)
    assert rig.pool.state(slot) is SlotState.RESERVED and rig.pool.owner(slot) == "req-b"
    assert rig.service.count_ready(["k1"]) == 0 and rig.service.count_ready(["k2"]) == 0


def test_sender_goodbye_quarantines_its_unwritten_slots(make_rig) -> None:
    rig = make_rig(num_slots=1)
    a = rig.sender("sender-a", "tx-a")
    (slot,) = rig.granted(a, "req-a", ["k1"])
    a.send(protocol.Goodbye("sender-a"))
    assert eventually(lambda: rig.pool.state(slot) is SlotState.QUARANTINED)
    b = rig.sender("sender-b", "tx-b")
    assert isinstance(b.alloc("req-b", ["k2"]), protocol.Refused)


# ---- Written must come from the sender that owns the slots ---------------------------------------


def test_written_from_the_wrong_sender_changes_nothing(make_rig) -> None:
    rig = make_rig(num_slots=2)
    a, b = rig.sender("sender-a", "tx-a"), rig.sender("sender-b", "tx-b")
    (slot_a,) = rig.granted(a, "req-a", ["ka"])
    (slot_b,) = rig.granted(b, "req-b", ["kb"])
    rig.transport.land("tx-b", "sender-b", "req-a", [slot_a])  # B claims A's request
    rig.transport.land("tx-b", "sender-a", "req-a", [slot_a])  # B's transport, A's name
    rig.transport.land("tx-a", "sender-a", "req-a", [slot_b])  # A names B's slot
    assert eventually(lambda: rig.service.counters.written_slots_ignored == 3)
    assert rig.service.counters.written_ignored == 2
    assert rig.pool.state(slot_a) is SlotState.RESERVED and rig.pool.state(slot_b) is SlotState.RESERVED
    assert rig.service.count_ready(["ka"]) == 0 and rig.service.count_ready(["kb"]) == 0
    # The owner's Written counts.
    rig.transport.land("tx-a", "sender-a", "req-a", [slot_a])
    assert eventually(lambda: rig.service.count_ready(["ka"]) == 1)
    assert rig.pool.state(slot_b) is SlotState.RESERVED


def test_alloc_for_a_request_of_another_sender_is_refused(make_rig) -> None:
    rig = make_rig(num_slots=4)
    a, b = rig.sender("sender-a", "tx-a"), rig.sender("sender-b", "tx-b")
    rig.granted(a, "req-a", ["k1"])
    reply = b.alloc("req-a", ["k2"])
    assert isinstance(reply, protocol.ErrorReply) and "another sender" in reply.message
    assert rig.pool.free_slots == 3


# ---- the transport's write guard (NCCL asks it for every doorbell) -----------------------------


def _dests(*slots: int) -> list[tuple[int, int]]:
    return [(REGION_ADDR + s * SLOT_BYTES, SLOT_BYTES) for s in slots]


def _notif(sender_id: str, req_id: str, slots: list[int]) -> bytes:
    return protocol.encode(protocol.Written(sender_id, req_id, slots))


def test_write_guard_admits_only_the_granted_slots_of_that_writer(make_rig) -> None:
    rig = make_rig(num_slots=3)
    a, b = rig.sender("sender-a", "tx-a"), rig.sender("sender-b", "tx-b")
    slots_a = rig.granted(a, "req-a", ["k1", "k2"])
    (slot_b,) = rig.granted(b, "req-b", ["k3"])
    guard = rig.transport.guard
    assert guard is not None
    assert guard("tx-a", _dests(*slots_a), _notif("sender-a", "req-a", slots_a)) == ""
    refusals = [
        guard("tx-b", _dests(*slots_a), _notif("sender-b", "req-a", slots_a)),  # another peer
        guard("tx-a", _dests(slot_b), _notif("sender-a", "req-a", [slot_b])),  # another request's slot
        guard("tx-a", _dests(slots_a[0]), _notif("sender-a", "req-a", [slots_a[1]])),  # Written names another
        guard("tx-a", [(REGION_ADDR + 1, 16)], _notif("sender-a", "req-a", [0])),  # not a slot start
        guard("tx-a", [(REGION_ADDR + 3 * SLOT_BYTES, SLOT_BYTES)], _notif("sender-a", "req-a", [3])),  # past end
        guard("tx-a", [(REGION_ADDR, 2 * SLOT_BYTES)], _notif("sender-a", "req-a", [0])),  # longer than a slot
        guard("tx-a", _dests(*slots_a), b"not msgpack"),
        guard("tx-a", _dests(*slots_a), _notif("sender-a", "req-a", slots_a)),  # the same grant written twice
    ]
    assert all(refusals), refusals
    assert rig.service.counters.writes_refused == len(refusals)
    assert "not granted" in refusals[0] and "names" in refusals[2] and "not a slot" in refusals[3]


def test_write_admitted_into_a_slot_keeps_it_quarantined_until_its_receive_deadline(make_rig) -> None:
    rig = make_rig(num_slots=1)
    a = rig.sender("sender-a", "tx-a")
    (slot,) = rig.granted(a, "req-a", ["k1"])
    rig.clock.now += 20  # the doorbell comes late, but within the sender's deadline
    assert rig.transport.guard("tx-a", _dests(slot), _notif("sender-a", "req-a", [slot])) == ""
    a.cancel("req-a")
    rig.clock.now += rig.cfg.write_window_s - 1  # past the grant's window, not the receive's
    time.sleep(0.2)
    assert rig.pool.state(slot) is SlotState.QUARANTINED
    rig.clock.now += 1
    assert eventually(lambda: rig.pool.state(slot) is SlotState.FREE)


# ---- the KV fingerprint -------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [("dtype", "float16"), ("model", "other-model"), ("chunk_tokens", 256),
                                              ("weights", "files:4567")])
def test_hello_with_another_fingerprint_is_refused_naming_the_field(make_rig, field, value) -> None:
    import msgspec

    rig = make_rig(num_slots=2)
    s = rig.sender("sender-x", "tx-x", hello=False)
    theirs = msgspec.structs.replace(FINGERPRINT, **{field: value})
    reply = s.hello(theirs)
    assert isinstance(reply, protocol.ErrorReply)
    assert f"mismatch in {field} " in reply.message
    assert repr(getattr(FINGERPRINT, field)) in reply.message and repr(value) in reply.message
    assert rig.service.counters.hello_refused_fingerprint == 1
    refused = s.alloc("req-x", ["k1"])  # nothing registered, nothing reserved
    assert isinstance(refused, protocol.Refused) and refused.code is protocol.RefusalCode.UNKNOWN_PEER
    assert rig.pool.free_slots == 2


@pytest.mark.parametrize(("changes", "says"), [
    ({"tp_size": 3, "kv_heads": 1, "kv_heads_total": 3}, "3 KV heads vs 2"),
    ({"tp_size": 2, "kv_heads": 2, "kv_heads_total": 4}, "4 KV heads vs 2"),
    ({"tp_size": 2, "kv_heads_total": 2}, "should hold 1 heads"),
    ({"kv_format": "KV_MLA_FMT", "kv_heads": 1, "head_size": 32}, "MLA on one side only"),
])
def test_hello_with_an_irreconcilable_tp_layout_is_refused_naming_both(make_rig, changes, says) -> None:
    import msgspec

    rig = make_rig(num_slots=2)
    s = rig.sender("sender-x", "tx-x", hello=False)
    reply = s.hello(msgspec.structs.replace(FINGERPRINT, **changes))
    assert isinstance(reply, protocol.ErrorReply) and says in reply.message
    if "should hold" not in says:
        assert "prefiller " in reply.message and "decoder KV heads [0, 2) of 2 on TP 1 (rank 0)" in reply.message
    assert rig.service.counters.hello_refused_fingerprint == 1
    refused = s.alloc("req-x", ["k1"])
    assert isinstance(refused, protocol.Refused) and refused.code is protocol.RefusalCode.UNKNOWN_PEER
    assert rig.pool.free_slots == 2


def test_a_sender_of_a_reconcilable_tp_layout_is_welcomed_and_told_ours(make_rig) -> None:
    import msgspec

    rig = make_rig(num_slots=2)
    s = rig.sender("sender-x", "tx-x", hello=False)
    welcome = s.hello(msgspec.structs.replace(FINGERPRINT, tp_size=2, kv_heads=1, kv_heads_total=2))
    assert isinstance(welcome, protocol.Welcome) and welcome.fingerprint == FINGERPRINT


def test_a_sender_that_does_not_know_its_weights_is_judged_by_the_other_fields(make_rig) -> None:
    import msgspec

    rig = make_rig(num_slots=2)
    s = rig.sender("sender-x", "tx-x", hello=False)
    assert isinstance(s.hello(msgspec.structs.replace(FINGERPRINT, weights="")), protocol.Welcome)


def test_hello_without_a_fingerprint_is_refused_when_we_have_one(make_rig) -> None:
    rig = make_rig()
    s = rig.sender("sender-x", "tx-x", hello=False)
    reply = s.hello(None)
    assert isinstance(reply, protocol.ErrorReply) and "sent none" in reply.message


def test_announce_carries_the_fingerprint(make_rig) -> None:
    rig = make_rig()
    assert rig.service._announce().fingerprint == FINGERPRINT


def test_freed_slots_are_announced_at_once_not_at_the_next_heartbeat(make_rig) -> None:
    """A request waiting in the proxy's admission for this buffer hears of freed slots a moment after
    they free, not a heartbeat interval later."""
    proxy = FakeProxy()
    try:
        rig = make_rig(num_slots=2, proxy_url=proxy.url, heartbeat_interval_s=60)
        assert proxy.recv(protocol.Announce).free_slots == 2  # the start announcement
        a = rig.sender("sender-a", "tx-a")
        slots = rig.granted(a, "req-a", ["k1", "k2"])
        time.sleep(0.2)  # reserving frees nothing: no announcement
        rig.transport.fail_write("tx-a", "sender-a", "req-a", slots)  # the slots are FREE again at once
        assert proxy.recv(protocol.Announce, timeout_s=30).free_slots == 2  # at once: the next heartbeat is 60 s off
    finally:
        proxy.close()


# ---- teardown of dead senders' pairs -----------------------------------------------------------


def test_goodbye_tears_the_pair_down_without_blocking_the_control_thread(make_rig) -> None:
    rig = make_rig(num_slots=2)
    rig.transport.disconnect_gate.clear()  # disconnect blocks until the test lets it go
    a = rig.sender("sender-a", "tx-a")
    a.send(protocol.Goodbye("sender-a"))
    b = rig.sender("sender-b", "tx-b")  # answered while the teardown is stuck
    assert rig.granted(b, "req-b", ["k1"])
    rig.transport.disconnect_gate.set()
    assert eventually(lambda: rig.transport.disconnected == ["tx-a"])
    assert rig.service.counters.senders_torn_down == 1


def test_replaced_sender_pair_is_torn_down_but_a_reconnect_keeps_it(make_rig) -> None:
    rig = make_rig()
    rig.sender("sender-a", "tx-a")
    again = rig.sender("sender-a", "tx-a")  # the same sender on a new socket: its pair stays
    time.sleep(0.2)
    assert rig.transport.disconnected == [] and rig.service.counters.senders_torn_down == 0
    # A new incarnation (a restarted prefiller) on that identity replaces it: the old pair goes.
    again.sender_id, again.writer = "sender-a-v2", "tx-a-v2"
    assert isinstance(again.hello(), protocol.Welcome)
    assert eventually(lambda: rig.transport.disconnected == ["tx-a"])


def test_silent_sender_is_forgotten_and_its_pair_torn_down(make_rig) -> None:
    rig = make_rig(sender_idle_timeout_s=0.3)
    a = rig.sender("sender-a", "tx-a")
    assert eventually(lambda: rig.transport.disconnected == ["tx-a"])
    refused = a.alloc("req-a", ["k1"])  # forgotten: it must say Hello again
    assert isinstance(refused, protocol.Refused) and refused.code is protocol.RefusalCode.UNKNOWN_PEER


# ---- end to end on the NCCL transport (Gloo on CPU): a doorbell outside the grant lands nothing ----


class NcclRig:
    """A ReceiveService on a real NCCL transport (Gloo on CPU) and one sender: transport + control socket."""

    def __init__(self, fingerprint: protocol.Fingerprint | None = None, **cfg) -> None:
        import torch

        from lmcache_p2p.transport.nccl.transport import NcclTransport

        self.cfg = P2PConfig.from_mapping({"role": "receiver", "transport": "nccl", "control_ports": [free_port()],
                                           "transport_ports": [free_port()], "transfer_timeout_s": 10, **cfg})
        self.tag = uuid.uuid4().hex[:6]  # unique thread names: an earlier test's pair may still be ending
        self.rx = NcclTransport(f"rx-{self.tag}", port=self.cfg.transport_port(0), timeout_s=10).start()
        self.tx = NcclTransport(f"tx-{self.tag}", timeout_s=10).start()
        self.buf = torch.zeros(3 * SLOT_BYTES, dtype=torch.uint8)
        region = self.rx.register(self.buf)
        self.pool = SlotPool(3, write_window_s=self.cfg.write_window_s)
        self.service = ReceiveService(self.cfg, tp_rank=0, tp_size=1, transport=self.rx, pool=self.pool,
                                      slot_bytes=SLOT_BYTES, region_addr=region.addr, chunk_tokens=16,
                                      dtype="bfloat16", fingerprint=fingerprint).start()
        self.ctx = zmq.Context()
        self.sender = Sender(self.ctx, self.service.control_endpoint, "sender-a", f"tx-{self.tag}")

    def hello_and_connect(self) -> tuple[protocol.Welcome, str]:
        welcome = self.sender.call(protocol.Hello(protocol.PROTOCOL_VERSION, "sender-a", 0, self.tx.info()))
        assert isinstance(welcome, protocol.Welcome)
        return welcome, self.tx.connect(welcome.transport, 10)

    def recv_threads(self) -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith(f"nccl-recv:rx-{self.tag}<-")]

    def close(self) -> None:
        self.sender.sock.close()
        self.service.close()
        self.tx.close()
        self.rx.close()
        self.ctx.term()


@pytest.fixture
def nccl_rig() -> Iterator[NcclRig]:
    rig = NcclRig()
    yield rig
    rig.close()


def test_nccl_write_into_a_slot_not_granted_to_that_sender_lands_nothing(nccl_rig) -> None:
    import torch

    tx, buf, pool, service, sender = nccl_rig.tx, nccl_rig.buf, nccl_rig.pool, nccl_rig.service, nccl_rig.sender
    welcome, peer = nccl_rig.hello_and_connect()
    (slot,) = sender.alloc("req-a", ["k1"]).slots
    data = torch.randint(0, 256, (SLOT_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))

    def write(to_slot: int, req_id: str) -> None:
        notif = protocol.encode(protocol.Written("sender-a", req_id, [to_slot]))
        handle = tx.write(peer, [data], [welcome.buffer_addr + to_slot * SLOT_BYTES], notif)
        try:
            tx.wait(handle, 10)
        except Exception:  # noqa: BLE001 - a refused write may fail on the sender; the receiver side is checked
            pass

    write(slot, "req-a")
    assert eventually(lambda: service.count_ready(["k1"]) == 1)
    assert torch.equal(buf[slot * SLOT_BYTES:(slot + 1) * SLOT_BYTES], data)
    stray = (slot + 1) % 3  # FREE: granted to nobody
    write(stray, "req-a")
    assert eventually(lambda: service.counters.writes_refused == 1)
    assert not buf[stray * SLOT_BYTES:(stray + 1) * SLOT_BYTES].any(), "a refused write landed"
    assert pool.state(stray) is SlotState.FREE


def test_nccl_pair_of_a_sender_that_says_goodbye_is_torn_down(nccl_rig) -> None:
    nccl_rig.hello_and_connect()
    assert eventually(lambda: nccl_rig.recv_threads() == [f"nccl-recv:rx-{nccl_rig.tag}<-tx-{nccl_rig.tag}"])
    nccl_rig.sender.send(protocol.Goodbye("sender-a"))
    assert eventually(lambda: nccl_rig.recv_threads() == []), "the receiver kept serving a departed sender"
    assert nccl_rig.service.counters.senders_torn_down == 1


def _send_service(fingerprint: protocol.Fingerprint | None, tx) -> object:
    from lmcache_p2p.backend.send_service import SendService

    cfg = P2PConfig.from_mapping({"role": "sender", "transport": "nccl", "transfer_timeout_s": 10,
                                  "connect_timeout_s": 10})
    return SendService(cfg, tp_rank=0, tp_size=1, transport=tx, fingerprint=fingerprint).start()


@pytest.mark.parametrize("fingerprint", [FINGERPRINT, None])
def test_real_send_service_over_nccl_passes_the_write_guard(fingerprint) -> None:
    import torch

    from lmcache_p2p.backend.send_service import Chunk as SendChunk
    from lmcache_p2p.backend.send_service import Target

    rig = NcclRig(fingerprint)
    sender = _send_service(fingerprint, rig.tx)
    try:
        data = [torch.randint(0, 256, (SLOT_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
                for i in range(2)]
        chunks = [SendChunk(f"k{i}", SHAPE, d, lambda: None) for i, d in enumerate(data)]
        sender.submit("req-1", Target("127.0.0.1", rig.cfg.control_port(0)), chunks, last=True)
        assert eventually(lambda: rig.service.count_ready(["k0", "k1"]) == 2)
        for i in range(2):
            chunk = rig.service.take(f"k{i}")
            assert torch.equal(rig.buf[chunk.slot * SLOT_BYTES:(chunk.slot + 1) * SLOT_BYTES], data[i])
        assert rig.service.counters.writes_refused == 0 and rig.service.counters.written_ignored == 0
    finally:
        sender.close()
        rig.close()


def test_real_send_service_with_another_fingerprint_is_refused_and_fails_its_request() -> None:
    import msgspec
    import torch

    from lmcache_p2p.backend.send_service import Chunk as SendChunk
    from lmcache_p2p.backend.send_service import Target

    rig = NcclRig(FINGERPRINT)
    sender = _send_service(msgspec.structs.replace(FINGERPRINT, num_layers=3), rig.tx)
    try:
        chunk = SendChunk("k0", SHAPE, torch.zeros(SLOT_BYTES, dtype=torch.uint8), lambda: None)
        sender.submit("req-1", Target("127.0.0.1", rig.cfg.control_port(0)), [chunk], last=True)
        assert eventually(lambda: sender.stats().requests_failed == 1)
        assert rig.service.counters.hello_refused_fingerprint == 1
        assert rig.pool.free_slots == rig.pool.num_slots and rig.service.count_ready(["k0"]) == 0
    finally:
        sender.close()
        rig.close()


# ---- the buffer cache: loaded chunks stay, a later request is told not to send them ----------------


def load(rig: Rig, keys: list[str]) -> None:
    """The engine loads ``keys`` (as LMCache would) and drops its references."""
    for key in keys:
        chunk = rig.service.take(key)
        assert chunk is not None, key
        rig.service.release(chunk)


def test_loaded_chunks_are_cached_and_a_later_request_is_told_not_to_send_them(make_rig) -> None:
    rig = make_rig(num_slots=3)
    a = rig.sender("sender-a", "tx-a")
    first = rig.granted(a, "turn-1", ["k1", "k2"])
    rig.transport.land("tx-a", "sender-a", "turn-1", first)
    assert eventually(lambda: rig.service.count_ready(["k1", "k2"]) == 2)
    load(rig, ["k1", "k2"])
    assert [rig.pool.state(s) for s in first] == [SlotState.CACHED] * 2
    assert rig.service.free_slots == 3 and rig.service.cached_slots == 2
    second = rig.granted(a, "turn-2", ["k1", "k2", "k3"])
    assert second[:2] == [-1, -1] and second[2] not in first
    assert [rig.pool.pins(s) for s in first] == [["turn-2"]] * 2
    assert rig.service.free_slots == 0  # pinned cached slots are not credit
    assert (rig.service.counters.chunks_held, rig.service.counters.bytes_held) == (2, 2 * SLOT_BYTES)
    rig.transport.land("tx-a", "sender-a", "turn-2", second[2:])
    assert eventually(lambda: rig.service.count_ready(["k1", "k2", "k3"]) == 3)
    assert rig.service.count_ready(["k1", "k2", "k3"], pin=True) == 3  # LMCache's lookup
    # The lookup's pins replaced the grant's; LMCache's unpin after its retrieve releases them.
    assert [rig.pool.pins(s) for s in first] == [["lookup"]] * 2
    chunk = rig.service.take("k1")
    assert chunk.cached and chunk.slot == first[0] and chunk.shape == SHAPE
    for key in ("k1", "k2"):
        rig.service.unpin(key)
    rig.service.release(chunk)
    load(rig, ["k3"])
    assert all(not rig.pool.pins(s) and not rig.pool.readers(s) for s in first)
    assert rig.service.free_slots == 3 and rig.service.cached_slots == 3
    assert rig.service.counters.bytes_received == 3 * SLOT_BYTES
    assert not rig.service.grants.requests  # both requests are done and forgotten


def test_a_cached_chunk_in_use_by_the_engine_is_never_granted_to_a_writer(make_rig) -> None:
    rig = make_rig(num_slots=2)
    a = rig.sender("sender-a", "tx-a")
    (slot,) = rig.granted(a, "turn-1", ["k1"])
    rig.transport.land("tx-a", "sender-a", "turn-1", [slot])
    assert eventually(lambda: rig.service.count_ready(["k1"]) == 1)
    load(rig, ["k1"])
    reading = rig.service.take("k1")  # another request's retrieve holds a zero-copy view of it
    refused = a.alloc("big", ["x1", "x2"])
    assert isinstance(refused, protocol.Refused) and refused.code is protocol.RefusalCode.FULL
    assert rig.pool.state(slot) is SlotState.CACHED
    rig.service.release(reading)
    granted = rig.granted(a, "big-again", ["x1", "x2"])
    assert slot in granted and rig.service.count_ready(["k1"]) == 0  # evicted only once unread


def test_cancel_returns_pinned_chunks_to_the_cache(make_rig) -> None:
    rig = make_rig(num_slots=2)
    a = rig.sender("sender-a", "tx-a")
    (slot,) = rig.granted(a, "turn-1", ["k1"])
    rig.transport.land("tx-a", "sender-a", "turn-1", [slot])
    assert eventually(lambda: rig.service.count_ready(["k1"]) == 1)
    load(rig, ["k1"])
    assert rig.granted(a, "turn-2", ["k1", "k2"])[0] == -1
    assert isinstance(a.cancel("turn-2"), protocol.Ack)
    assert rig.pool.state(slot) is SlotState.CACHED and rig.pool.pins(slot) == []
    assert rig.pool.quarantined_slots == 1  # turn 2's own unwritten slot: a write may still land


def test_pins_of_a_request_that_never_loads_expire(make_rig) -> None:
    rig = make_rig(num_slots=1, ready_lease_s=10)
    a = rig.sender("sender-a", "tx-a")
    (slot,) = rig.granted(a, "turn-1", ["k1"])
    rig.transport.land("tx-a", "sender-a", "turn-1", [slot])
    assert eventually(lambda: rig.service.count_ready(["k1"]) == 1)
    load(rig, ["k1"])
    assert rig.granted(a, "turn-2", ["k1"]) == [-1]
    assert rig.service.free_slots == 0
    rig.clock.now += 10
    assert eventually(lambda: rig.service.free_slots == 1)
    assert rig.pool.state(slot) is SlotState.CACHED


def test_buffer_cache_off_frees_loaded_chunks_and_grants_every_chunk(make_rig) -> None:
    rig = make_rig(num_slots=2, buffer_cache=False)
    a = rig.sender("sender-a", "tx-a")
    (slot,) = rig.granted(a, "turn-1", ["k1"])
    rig.transport.land("tx-a", "sender-a", "turn-1", [slot])
    assert eventually(lambda: rig.service.count_ready(["k1"]) == 1)
    load(rig, ["k1"])
    assert rig.pool.state(slot) is SlotState.FREE and rig.service.count_ready(["k1"]) == 0
    assert -1 not in rig.granted(a, "turn-2", ["k1"])


def test_cancel_after_kv_ready_of_a_request_made_only_of_held_chunks_drops_its_pins(make_rig) -> None:
    # The proxy cancels KV it will not use (the client left, or it decodes elsewhere) after KvReady.
    rig = make_rig(num_slots=1)
    a = rig.sender("sender-a", "tx-a")
    (slot,) = rig.granted(a, "turn-1", ["k1"])
    rig.transport.land("tx-a", "sender-a", "turn-1", [slot])
    assert eventually(lambda: rig.service.count_ready(["k1"]) == 1)
    load(rig, ["k1"])
    assert rig.granted(a, "repeat", ["k1"]) == [-1]  # ready at once, nothing of its own
    assert rig.pool.pins(slot) == ["repeat"] and rig.service.free_slots == 0
    assert isinstance(a.cancel("repeat"), protocol.Ack)
    assert rig.pool.pins(slot) == [] and rig.service.free_slots == 1


# ---- the signed envelope: the signer is the sender it speaks for, the recipient is this receiver -------

SECRET = "members-secret"


class SignedSender(Sender):
    """A member that holds the shared secret: signs as ``signer``, addresses frames as it is told."""

    def __init__(self, ctx: zmq.Context, rig: Rig, sender_id: str, writer: str, *, signer: str | None = None,
                 identity: bytes | None = None) -> None:
        super().__init__(ctx, rig.service.control_endpoint, sender_id, writer)
        self.codec = protocol.Codec(SECRET, identity=signer or sender_id, names=[signer or sender_id])
        if identity is not None:  # a socket that takes over another's ZMQ identity (ROUTER_HANDOVER)
            self.sock.close()
            self.sock = ctx.socket(zmq.DEALER)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.RCVTIMEO, REPLY_TIMEOUT_MS)
            self.sock.setsockopt(zmq.IDENTITY, identity)
            self.sock.connect(rig.service.control_endpoint)
        self.address = rig.service.control_endpoint.removeprefix("tcp://")
        self.receiver_id = ""
        self.sent: list[list[bytes]] = []  # every frame sent, as a wire tap would capture it

    def send(self, msg: protocol.Message) -> None:
        frames = self.codec.pack(msg, self.receiver_id or self.address)
        self.sent.append(frames)
        self.sock.send_multipart(frames)

    def replay(self, frames: list[bytes]) -> protocol.Message:
        self.sock.send_multipart(frames)
        return self.codec.unpack(self.sock.recv_multipart())

    def hello(self, fingerprint: protocol.Fingerprint | None = FINGERPRINT) -> protocol.Message:
        welcome = super().hello(fingerprint)
        self.receiver_id = getattr(welcome, "receiver_id", "")
        return welcome


def signed(rig: Rig, sender_id: str, **kwargs) -> SignedSender:
    sender = SignedSender(rig.ctx, rig, sender_id, f"tx-{sender_id}", **kwargs)
    rig.senders.append(sender)
    return sender


def test_a_member_that_signs_as_one_sender_cannot_say_hello_as_another(make_rig) -> None:
    rig = make_rig(num_slots=2, shared_secret=SECRET)
    impostor = signed(rig, "sender-y", signer="sender-x")
    refused = impostor.hello()
    assert isinstance(refused, protocol.ErrorReply)
    assert "speaks for sender 'sender-y' but is signed by 'sender-x'" in refused.message
    assert rig.service.rejected_frames() == {"spoofed": 1}
    alloc = impostor.alloc("req-y", ["k1"])  # it never became a sender here
    assert isinstance(alloc, protocol.Refused) and alloc.code is protocol.RefusalCode.UNKNOWN_PEER
    assert rig.pool.reserved_slots == 0
    honest = signed(rig, "sender-x")  # the signer, as itself, is welcome
    assert isinstance(honest.hello(), protocol.Welcome)
    assert len(rig.granted(honest, "req-x", ["k1"])) == 1 and rig.pool.reserved_slots == 1


def test_a_member_cannot_speak_on_another_senders_connection(make_rig) -> None:
    rig = make_rig(num_slots=2, shared_secret=SECRET)
    victim = signed(rig, "sender-x", identity=b"sender-x@victim")
    assert isinstance(victim.hello(), protocol.Welcome)
    (slot,) = rig.granted(victim, "req-x", ["k1"])
    # Another member takes the connection over (same ZMQ identity) and signs as itself.
    intruder = signed(rig, "sender-x", signer="sender-z", identity=b"sender-x@victim")
    intruder.receiver_id = rig.service.receiver_id
    refused = intruder.cancel("req-x")
    assert isinstance(refused, protocol.ErrorReply) and "is signed by 'sender-z'" in refused.message
    assert rig.service.rejected_frames() == {"spoofed": 1}
    assert rig.pool.state(slot) is SlotState.RESERVED  # the victim's request was not cancelled


def test_a_frame_captured_for_one_receiver_is_refused_by_another_within_the_window(make_rig) -> None:
    rig_a = make_rig(num_slots=2, shared_secret=SECRET)
    rig_b = make_rig(num_slots=2, shared_secret=SECRET)
    at_a = signed(rig_a, "sender-m")
    assert isinstance(at_a.hello(), protocol.Welcome)
    rig_a.granted(at_a, "req-a", ["k1"])
    hello_for_a, alloc_for_a = at_a.sent
    # An eavesdropper replays both frames to B, on a connection of its own.
    tap = signed(rig_b, "sender-m", identity=b"sender-m@tap")  # named so that it can read B's refusals
    for frames in (hello_for_a, alloc_for_a):
        reply = tap.replay(frames)
        assert isinstance(reply, protocol.ErrorReply) and "addressed to" in reply.message
    assert rig_b.service.rejected_frames() == {"misaddressed": 2}
    assert rig_b.pool.reserved_slots == 0
    # ... and on the connection of the very sender, once it said Hello to B too.
    at_b = signed(rig_b, "sender-m")
    assert isinstance(at_b.hello(), protocol.Welcome)
    reply = at_b.replay(alloc_for_a)
    assert isinstance(reply, protocol.ErrorReply) and rig_a.service.receiver_id in reply.message
    assert rig_b.service.rejected_frames() == {"misaddressed": 3}
    assert rig_b.pool.reserved_slots == 0
    assert len(rig_b.granted(at_b, "req-b", ["k2"])) == 1  # its own frames to B are granted
    assert rig_b.pool.reserved_slots == 1
    assert rig_a.service.rejected_frames() == {}


def test_a_signed_sender_is_served_and_answered_under_its_own_name(make_rig) -> None:
    rig = make_rig(num_slots=2, shared_secret=SECRET)
    sender = signed(rig, "sender-x")
    welcome = sender.hello()
    assert isinstance(welcome, protocol.Welcome) and welcome.receiver_id == rig.service.receiver_id
    slots = rig.granted(sender, "req-x", ["k1", "k2"])
    rig.transport.land("tx-sender-x", "sender-x", "req-x", slots)
    assert eventually(lambda: rig.service.count_ready(["k1", "k2"]) == 2)
    assert rig.service.rejected_frames() == {}


def test_a_cancel_from_a_connection_that_never_said_hello_is_taken_only_from_our_proxy(make_rig) -> None:
    proxy_name = f"127.0.0.1:{free_port()}"  # the proxy this receiver reports to, as it dials it
    rig = make_rig(num_slots=2, shared_secret=SECRET, proxy_url=f"tcp://{proxy_name}", heartbeat_interval_s=60)
    owner = signed(rig, "sender-x")
    assert isinstance(owner.hello(), protocol.Welcome)
    (slot,) = rig.granted(owner, "req-x", ["k1"])
    # Members that hold the secret, on connections that never said Hello: neither another sender, nor the
    # request's own sender off its connection, nor a proxy this receiver does not report to may cancel.
    for signer in ("sender-z", "sender-x", "127.0.0.1:1"):
        member = signed(rig, f"m-{signer}", signer=signer)
        refused = member.cancel("req-x")
        assert isinstance(refused, protocol.ErrorReply), refused
        assert f"never said Hello is signed by '{signer}'" in refused.message and proxy_name in refused.message
    assert rig.service.rejected_frames() == {"spoofed": 3}
    assert rig.pool.state(slot) is SlotState.RESERVED  # the request was not cancelled
    proxy = signed(rig, "proxy", signer=proxy_name)
    assert isinstance(proxy.cancel("req-x"), protocol.Ack)
    assert rig.pool.state(slot) is not SlotState.RESERVED and rig.pool.reserved_slots == 0
    assert isinstance(owner.alloc("req-x", ["k2"]), protocol.Refused)  # cancelled for good


def test_without_a_proxy_a_cancel_off_a_hello_connection_is_refused(make_rig) -> None:
    rig = make_rig(num_slots=2, shared_secret=SECRET)
    owner = signed(rig, "sender-x")
    assert isinstance(owner.hello(), protocol.Welcome)
    (slot,) = rig.granted(owner, "req-x", ["k1"])
    refused = signed(rig, "member", signer="proxy-elsewhere:9101").cancel("req-x")
    assert isinstance(refused, protocol.ErrorReply) and "it reports to none (p2p.proxy_url)" in refused.message
    assert rig.pool.state(slot) is SlotState.RESERVED


def test_a_sender_cancels_only_its_own_requests(make_rig) -> None:
    rig = make_rig(num_slots=2)
    x, y = rig.sender("sender-x", "tx-x"), rig.sender("sender-y", "tx-y")
    (slot,) = rig.granted(x, "req-x", ["k1"])
    refused = y.cancel("req-x")
    assert isinstance(refused, protocol.ErrorReply) and "belongs to another sender" in refused.message
    assert rig.service.rejected_frames() == {"foreign": 1}
    assert rig.pool.state(slot) is SlotState.RESERVED
    assert len(rig.granted(x, "req-x", ["k2"])) == 1  # the request goes on: nothing remembered it as cancelled
    assert isinstance(x.cancel("req-x"), protocol.Ack)
    assert rig.pool.reserved_slots == 0


# ---- lifecycle: construction opens nothing, start() binds and fails visibly, close() is idempotent -------

def _service(cfg: P2PConfig) -> ReceiveService:
    return ReceiveService(cfg, tp_rank=0, tp_size=1, transport=FakeTransport(), pool=SlotPool(2),
                          slot_bytes=SLOT_BYTES, region_addr=REGION_ADDR, chunk_tokens=16, dtype="bfloat16")


def test_construction_binds_nothing_and_a_failed_start_leaves_nothing_open() -> None:
    port = free_port()
    cfg = P2PConfig.from_mapping({"role": "receiver", "control_ports": [port]})
    idle = _service(cfg)
    with socket.socket() as probe:  # nothing listens yet: the port can be bound by anyone
        probe.bind(("127.0.0.1", port))
    first = _service(cfg).start()
    try:
        second = _service(cfg)
        with pytest.raises(ProtocolError, match=f"cannot listen on tcp://127.0.0.1:{port} .p2p.host / p2p.control_ports"):
            second.start()
        second.close()
        second.close()  # idempotent after a failed start
        with pytest.raises(ClosedError):
            second.start()
    finally:
        first.close()
    idle.close()  # never started: nothing to stop
    with socket.socket() as probe:  # the started one released its port on close
        probe.bind(("127.0.0.1", port))
