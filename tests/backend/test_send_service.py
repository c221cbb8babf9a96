"""SendService against a scripted receiver (a real ZMQ ROUTER) and a test-double transport.

The receiver side is played by the test: it reads the sender's control messages and answers
with whatever the case needs (bad grants, refusals, silence). The transport double records
writes and lets the test decide when each completes, fails or settles, so the tests check what
the service does with LMCache's memory (``Chunk.done``) and with other requests.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
import zmq

from lmcache_p2p import protocol
from lmcache_p2p.backend.send_service import Chunk, SendService, Target
from lmcache_p2p.backend.send_types import StoreReady
from lmcache_p2p.config import P2PConfig, Role
from lmcache_p2p.errors import ClosedError, PeerUnreachable, QueueFull, TransportError
from lmcache_p2p.transport import Notification, Transport, WriteHandle

from fake_proxy import FakeProxy

WAIT_S = 10.0
SLOT_BYTES = 4096
NUM_SLOTS = 8
BUFFER_ADDR = 1 << 20
SHAPE = protocol.ChunkShape(shape=[2, 1, 4, 8], dtype="uint8", nbytes=256)
CREDIT_TIMEOUT_S = 3.0  # what the credit tests run into; it also bounds each answer of the scripted receiver


def wait_for(cond: Any, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.005)


# ---- the transport double ------------------------------------------------------------------------


@dataclasses.dataclass
class FakeWrite:
    peer: str
    nbytes: int
    addrs: list[int]
    done: bool = False
    error: str = ""
    aborted: bool = False
    reads_ended: bool = False  # what settled() reports for a failed/aborted write
    crash_after: FakeWrite | None = None  # poll raises an unexpected error once that write is done


class FakeTransport(Transport):
    """Writes complete, fail and settle when the test says so; destinations are checked like the
    real transports do (ValueError outside the peer's registered memory)."""

    kind = "fake"

    def __init__(self) -> None:
        self.writes: list[FakeWrite] = []
        self.connected: list[str] = []
        self.disconnected: list[str] = []
        self.connect_gate: dict[str, threading.Event] = {}  # peer name -> released when set
        self.auto_complete = True
        self.polls = 0

    def start(self) -> FakeTransport:
        return self

    def register(self, tensor: torch.Tensor) -> Any:
        raise NotImplementedError

    def info(self) -> protocol.TransportInfo:
        return protocol.TransportInfo(kind=self.kind, name="fake-sender")

    def connect(self, peer: protocol.TransportInfo, timeout_s: float) -> str:
        gate = self.connect_gate.get(peer.name)
        if gate is not None and not gate.wait(WAIT_S):
            raise PeerUnreachable(f"{peer.name} did not pair within {timeout_s}s")
        self.connected.append(peer.name)
        return peer.name

    def write(self, peer: str, srcs: Sequence[torch.Tensor], dst_addrs: Sequence[int], notif: bytes) -> WriteHandle:
        for src, addr in zip(srcs, dst_addrs):
            if not BUFFER_ADDR <= addr <= BUFFER_ADDR + NUM_SLOTS * SLOT_BYTES - src.nbytes:
                raise ValueError(f"destination 0x{addr:x} is outside every region of {peer}")
        write = FakeWrite(peer, sum(s.nbytes for s in srcs), list(dst_addrs), done=self.auto_complete)
        self.writes.append(write)
        return WriteHandle(peer=peer, nbytes=write.nbytes, token=write)

    def poll(self, handle: WriteHandle) -> bool:
        self.polls += 1
        write: FakeWrite = handle.token
        if write.crash_after is not None and write.crash_after.done:
            raise RuntimeError("unexpected error polling a write")
        if write.error:
            raise TransportError(write.error)
        return write.done

    def abort(self, handle: WriteHandle) -> None:
        write: FakeWrite = handle.token
        write.aborted = True
        if not write.done:
            write.error = write.error or "aborted"

    def settled(self, handle: WriteHandle) -> bool:
        write: FakeWrite = handle.token
        return write.done or write.reads_ended

    def get_notifications(self) -> list[Notification]:
        return []

    def disconnect(self, peer: str) -> None:
        self.disconnected.append(peer)

    def close(self) -> None:
        pass


# ---- the scripted receiver -----------------------------------------------------------------------


class ScriptedReceiver:
    """A ZMQ ROUTER playing a decoder's control port; the test reads and answers by hand."""

    def __init__(self, name: str, num_slots: int = NUM_SLOTS) -> None:
        self.name = name
        self.num_slots = num_slots
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.target = Target("127.0.0.1", port)
        self._codec = protocol.Codec()
        self.identity = b""
        self.seen: list[protocol.Message] = []

    def recv(self, kind: type, timeout_s: float = WAIT_S) -> Any:
        """The next message of type ``kind`` (others are kept in ``seen``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self._sock.poll(left_ms):
                raise AssertionError(f"{self.name}: no {kind.__name__} within {timeout_s}s (saw {self.seen})")
            identity, *frames = self._sock.recv_multipart()
            self.identity = identity
            msg = self._codec.unpack(frames)
            self.seen.append(msg)
            if isinstance(msg, kind):
                return msg

    def send(self, msg: protocol.Message) -> None:
        self._sock.send_multipart([self.identity, *self._codec.pack(msg)])

    def welcome(self, transfer_timeout_s: float = 0.0) -> None:
        self.recv(protocol.Hello)
        self.send(protocol.Welcome(protocol.PROTOCOL_VERSION, self.name, BUFFER_ADDR, SLOT_BYTES, self.num_slots,
                                   protocol.TransportInfo(kind="fake", name=self.name),
                                   transfer_timeout_s=transfer_timeout_s))

    def grant(self, slots: list[int] | None = None) -> protocol.Alloc:
        alloc = self.recv(protocol.Alloc)
        slots = list(range(len(alloc.keys))) if slots is None else slots
        self.send(protocol.Grant(alloc.seq, alloc.req_id, slots, free_slots=self.num_slots - len(slots)))
        return alloc

    def refuse_full(self, alloc: protocol.Alloc) -> None:
        self.send(protocol.Refused(alloc.seq, alloc.req_id, protocol.RefusalCode.FULL, "full",
                                   needed_slots=len(alloc.keys), free_slots=0, capacity_slots=self.num_slots))

    def cancels(self) -> list[str]:
        return [m.req_id for m in self.seen if isinstance(m, protocol.Cancel)]

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()


# ---- fixtures ------------------------------------------------------------------------------------


class Chunks:
    """Chunks whose ``done`` calls are counted: LMCache's references, as the service sees them."""

    def __init__(self) -> None:
        self.released: list[str] = []
        self._n = 0

    def make(self, count: int, nbytes: int = SHAPE.nbytes) -> list[Chunk]:
        out = []
        for _ in range(count):
            self._n += 1
            key = f"chunk-{self._n}"
            out.append(Chunk(key, SHAPE, torch.zeros(nbytes, dtype=torch.uint8),
                             lambda k=key: self.released.append(k)))
        return out


@pytest.fixture
def chunks() -> Chunks:
    return Chunks()


@pytest.fixture
def transport() -> FakeTransport:
    return FakeTransport()


@pytest.fixture
def make_service(transport: FakeTransport) -> Iterator[Any]:
    services: list[SendService] = []

    def make(**overrides: Any) -> SendService:
        # deadlines a test does not run into bound only its normal steps: far beyond what a loaded machine takes
        # (a test of a deadline sets its own)
        cfg = P2PConfig(role=Role.SENDER, **{"connect_timeout_s": 30.0, "alloc_timeout_s": 30.0,
                                              "transfer_timeout_s": 30.0, **overrides})
        service = SendService(cfg, tp_rank=0, tp_size=1, transport=transport).start()
        services.append(service)
        return service

    yield make
    for service in services:
        service.close()


@pytest.fixture
def receiver() -> Iterator[ScriptedReceiver]:
    rx = ScriptedReceiver("rx-a")
    yield rx
    rx.close()


def _keys(chunks: list[Chunk]) -> list[str]:
    return [c.key for c in chunks]


# ---- item 1: memory is handed back only once nothing reads it ------------------------------------


def test_a_write_is_aborted_within_the_receivers_window_counted_from_its_alloc(
        make_service, transport, receiver, chunks) -> None:
    """Our transfer_timeout_s is 30 s, the receiver's 0.4 s: a write still in flight 0.4 s after its Alloc left
    is aborted, since the receiver may then have given its slots up and granted them again."""
    transport.auto_complete = False
    service = make_service()  # transfer_timeout_s 30.0
    service.submit("req-1", receiver.target, chunks.make(1), last=True)
    receiver.welcome(transfer_timeout_s=0.4)
    receiver.grant()
    # within WAIT_S: the receiver's 0.4 s, not our 30 s
    wait_for(lambda: service.stats().requests_failed == 1, "the write to pass the receiver's window")
    assert transport.writes[0].aborted


def test_a_grant_that_comes_after_the_write_window_is_not_written(make_service, transport, receiver, chunks) -> None:
    service = make_service()
    service.submit("req-1", receiver.target, chunks.make(2), last=True)
    receiver.welcome(transfer_timeout_s=0.2)
    alloc = receiver.recv(protocol.Alloc)
    time.sleep(0.35)  # the receiver answers after its own write window: it may have given the slots up
    receiver.send(protocol.Grant(alloc.seq, alloc.req_id, [0, 1], free_slots=0))
    wait_for(lambda: service.stats().requests_failed == 1, "the late grant to fail the request")
    assert transport.writes == [], "a write was posted into slots the receiver may have re-granted"
    wait_for(lambda: len(chunks.released) == 2, "the unwritten chunks to go back to LMCache")


def test_aborted_write_keeps_its_chunks_until_the_transport_says_reads_ended(
        make_service, transport, receiver, chunks) -> None:
    transport.auto_complete = False
    service = make_service(transfer_timeout_s=0.3)
    batch = chunks.make(2)
    service.submit("req-1", receiver.target, batch, last=True)
    receiver.welcome()
    receiver.grant()
    wait_for(lambda: service.stats().requests_failed == 1, "the write to pass its transfer deadline")
    write = transport.writes[0]
    assert write.aborted
    assert receiver.recv(protocol.Cancel).req_id == "req-1"
    time.sleep(0.2)  # the loop keeps polling: nothing may be released while the write may still read
    assert chunks.released == [], "chunks went back to LMCache while the aborted write could still read them"
    write.reads_ended = True
    wait_for(lambda: sorted(chunks.released) == sorted(_keys(batch)), "the chunks to be released once settled")
    assert service.stats().chunks_leaked == 0


@pytest.mark.parametrize("interval_s", [None, 0.0001])
def test_a_pending_write_does_not_make_the_thread_spin(make_service, transport, receiver, chunks,
                                                       interval_s) -> None:
    """The service thread shares the engine's core (and GIL): between polls of a pending write it
    sleeps (1 ms with host chunks, p2p.write_poll_interval_s when set: the VRAM default 0.1 ms goes
    below zmq's whole-millisecond poll) instead of spinning, so the engine's forward pass and sampling
    after the store are not starved while the KV is on its way."""
    transport.auto_complete = False
    service = make_service(write_poll_interval_s=interval_s)
    service.submit("req-1", receiver.target, chunks.make(1), last=True)
    receiver.welcome()
    receiver.grant()
    wait_for(lambda: transport.writes, "the write")
    before = transport.polls
    time.sleep(0.5)
    polls = transport.polls - before
    most = 0.5 / (interval_s or 0.001)
    assert 0 < polls <= most, f"{polls} polls of one pending write in 0.5 s (at most {most:g}): the thread spins"
    transport.writes[0].done = True
    wait_for(lambda: service.stats().requests_done == 1, "the request to finish once its write is done")


def test_failed_write_that_never_settles_is_leaked_not_released(make_service, transport, receiver, chunks) -> None:
    transport.auto_complete = False
    service = make_service(settle_timeout_s=0.3)
    batch = chunks.make(3)
    service.submit("req-1", receiver.target, batch, last=True)
    receiver.welcome()
    receiver.grant()
    wait_for(lambda: transport.writes, "the write")
    transport.writes[0].error = "peer reset"
    wait_for(lambda: service.stats().chunks_leaked == 3, "the unsettled chunks to be given up")
    assert chunks.released == []
    assert service.stats().requests_failed == 1


def test_completed_writes_release_their_chunks_at_once(make_service, transport, receiver, chunks) -> None:
    service = make_service()
    batch = chunks.make(2)
    service.submit("req-1", receiver.target, batch, last=True)
    receiver.welcome()
    receiver.grant()
    wait_for(lambda: service.stats().requests_done == 1, "the request to finish")
    assert sorted(chunks.released) == sorted(_keys(batch))


# ---- item 2: a bad grant fails its request only; a dead thread refuses loudly --------------------


@pytest.mark.parametrize("slots, problem", [
    ([0, NUM_SLOTS], "outside the receiver's"),
    ([3, 3], "granted twice"),
    ([1], "1 slots for 2 chunks"),
])
def test_bad_grant_fails_that_request_only(make_service, transport, receiver, chunks, slots, problem,
                                           caplog) -> None:
    service = make_service()
    bad = chunks.make(2)
    service.submit("req-bad", receiver.target, bad, last=True)
    receiver.welcome()
    receiver.grant(slots)
    assert receiver.recv(protocol.Cancel).req_id == "req-bad"
    wait_for(lambda: sorted(chunks.released) == sorted(_keys(bad)), "the bad request's chunks to be released")
    assert problem in caplog.text and "req-bad" in caplog.text
    good = chunks.make(2)
    service.submit("req-good", receiver.target, good, last=True)
    receiver.grant()
    wait_for(lambda: service.stats().requests_done == 1, "a later request to complete (the thread lives)")
    assert service.stats().requests_failed == 1


def test_oversized_chunk_in_a_grant_is_refused_before_writing(make_service, transport, receiver, chunks) -> None:
    service = make_service()
    big = chunks.make(1, nbytes=SLOT_BYTES + 1)
    service.submit("req-big", receiver.target, big, last=True)
    receiver.welcome()
    receiver.grant([NUM_SLOTS - 1])
    assert receiver.recv(protocol.Cancel).req_id == "req-big"
    assert transport.writes == [], "a chunk larger than a slot was written over the next slot"


def test_a_write_raising_an_unexpected_error_fails_that_request_only(
        make_service, transport, receiver, chunks, monkeypatch) -> None:
    service = make_service()
    real_write = transport.write

    def exploding_write(peer, srcs, addrs, notif):
        if len(srcs) == 3:
            raise RuntimeError("boom")
        return real_write(peer, srcs, addrs, notif)

    monkeypatch.setattr(transport, "write", exploding_write)
    boom = chunks.make(3)
    service.submit("req-boom", receiver.target, boom, last=True)
    receiver.welcome()
    receiver.grant()
    assert receiver.recv(protocol.Cancel).req_id == "req-boom"
    wait_for(lambda: sorted(chunks.released) == sorted(_keys(boom)), "the failed request's chunks to be released")
    service.submit("req-ok", receiver.target, chunks.make(1), last=True)
    receiver.grant()
    wait_for(lambda: service.stats().requests_done == 1, "a later request to complete")


def test_an_unexpected_error_polling_one_request_does_not_stop_the_thread(
        make_service, transport, receiver, chunks, monkeypatch, caplog) -> None:
    service = make_service()
    real_poll = transport.poll

    def exploding_poll(handle):
        if handle.nbytes == 3 * SHAPE.nbytes:
            raise RuntimeError("boom")
        return real_poll(handle)

    transport.auto_complete = False
    monkeypatch.setattr(transport, "poll", exploding_poll)
    boom = chunks.make(3)
    service.submit("req-boom", receiver.target, boom, last=True)
    receiver.welcome()
    receiver.grant()
    assert receiver.recv(protocol.Cancel).req_id == "req-boom"
    assert "req-boom" in caplog.text and "boom" in caplog.text
    assert transport.writes[0].aborted
    transport.writes[0].reads_ended = True
    wait_for(lambda: sorted(chunks.released) == sorted(_keys(boom)), "the failed request's chunks to be released")
    transport.auto_complete = True
    service.submit("req-ok", receiver.target, chunks.make(1), last=True)
    receiver.grant()
    wait_for(lambda: service.stats().requests_done == 1, "a later request to complete")


class _Die(BaseException):
    """Stands for whatever might still kill the thread."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_submit_refuses_loudly_once_the_thread_died(make_service, chunks, receiver, monkeypatch) -> None:
    service = make_service()

    def die() -> None:
        raise _Die("simulated")

    monkeypatch.setattr(service, "_step", die)
    service._pipe.wake()
    wait_for(lambda: not service._thread.is_alive(), "the thread to die")
    batch = chunks.make(2)
    with pytest.raises(ClosedError, match="service thread stopped"):
        service.submit("req-late", receiver.target, batch, last=True)
    assert sorted(chunks.released) == sorted(_keys(batch))


# ---- item 3: a request out of buffer credit fails alone; a silent receiver fails all ------------


def allocs_of(receiver: ScriptedReceiver, *req_ids: str) -> dict[str, protocol.Alloc]:
    """The next Alloc of each of ``req_ids``, whatever order they come in."""
    allocs: dict[str, protocol.Alloc] = {}
    while set(allocs) != set(req_ids):
        alloc = receiver.recv(protocol.Alloc)
        allocs[alloc.req_id] = alloc
    return allocs


def answer_b_once_a_retries(receiver: ScriptedReceiver) -> protocol.Alloc:
    """A and B each have an Alloc out: A's is refused, and B's is granted once A's retry left, unanswered (the
    receiver is alive, A's credit runs out with its retry in flight). Each answer is the test's at once, well within
    ``CREDIT_TIMEOUT_S`` (B's Grant used to follow a round trip through the sender, which a loaded machine stretched
    past the credit timeout: the receiver then read as silent, and B failed with A)."""
    allocs = allocs_of(receiver, "req-a", "req-b")
    receiver.refuse_full(allocs["req-a"])
    retry = receiver.recv(protocol.Alloc)
    assert retry.req_id == "req-a"
    b = allocs["req-b"]
    receiver.send(protocol.Grant(b.seq, b.req_id, list(range(len(b.keys))), free_slots=NUM_SLOTS - len(b.keys)))
    return retry


def test_credit_timeout_with_a_retry_in_flight_fails_only_that_request(
        make_service, transport, receiver, chunks) -> None:
    service = make_service(alloc_timeout_s=CREDIT_TIMEOUT_S)
    b_first = chunks.make(1)
    service.submit("req-b", receiver.target, b_first, last=False)
    receiver.welcome()
    receiver.grant()
    service.submit("req-a", receiver.target, chunks.make(1), last=True)
    service.submit("req-b", receiver.target, chunks.make(1), last=False)
    answer_b_once_a_retries(receiver)
    assert receiver.recv(protocol.Cancel).req_id == "req-a"
    service.submit("req-b", receiver.target, chunks.make(1), last=True)
    receiver.grant()
    wait_for(lambda: service.stats().requests_done == 1, "request B to complete")
    assert service.stats().requests_failed == 1
    assert receiver.cancels() == ["req-a"]


def test_a_silent_receiver_fails_every_request_to_it(make_service, transport, receiver, chunks) -> None:
    service = make_service(alloc_timeout_s=0.5)
    # both wait for the pairing, so their Allocs leave together; the receiver never has to answer within 0.5 s (a
    # Grant the test sent later than that, on a loaded machine, failed the request before the silence began)
    service.submit("req-1", receiver.target, chunks.make(1), last=True)
    service.submit("req-2", receiver.target, chunks.make(1), last=True)
    receiver.welcome()
    receiver.recv(protocol.Alloc)
    receiver.recv(protocol.Alloc)  # neither is answered, nothing else is sent
    wait_for(lambda: service.stats().requests_failed == 2, "both requests to fail with the silent receiver")
    # its requests fail (and are counted) before the peer is dropped: their writes are aborted while it is paired
    wait_for(lambda: transport.disconnected == ["rx-a"], "the silent receiver's pairing to be undone")


# ---- item 4: a request whose last batch never comes ends ----------------------------------------


def test_request_without_its_last_batch_fails_at_request_timeout(make_service, transport, receiver, chunks) -> None:
    service = make_service(request_timeout_s=0.5)
    # a request before pairs us with the receiver: the next one's Alloc goes out as it is taken in, within its 0.5 s
    # however loaded the machine (a Hello answered later than that failed it before any Alloc, with no Cancel)
    paired = chunks.make(1)
    service.submit("req-paired", receiver.target, paired, last=True)
    receiver.welcome()
    receiver.grant()
    wait_for(lambda: service.stats().requests_done == 1, "the pairing request")
    first = chunks.make(2)
    service.submit("req-gone", receiver.target, first, last=False)
    receiver.grant()  # granted in time or not, the request ends at its timeout with a Cancel
    assert receiver.recv(protocol.Cancel, timeout_s=5.0).req_id == "req-gone"
    assert service.stats().requests_failed == 1
    assert service.pending_requests() == 0
    assert sorted(chunks.released) == sorted(_keys(paired + first))


# ---- item 5: a slow pairing does not stall other receivers ---------------------------------------


def test_slow_transport_pairing_does_not_block_other_receivers(make_service, transport, receiver, chunks) -> None:
    other = ScriptedReceiver("rx-b")
    gate = transport.connect_gate["rx-a"] = threading.Event()
    try:
        service = make_service()
        service.submit("req-slow", receiver.target, chunks.make(1), last=True)
        receiver.welcome()  # its transport pairing now hangs until the gate opens
        time.sleep(0.1)
        service.submit("req-fast", other.target, chunks.make(1), last=True)
        other.welcome()
        other.grant()
        wait_for(lambda: service.stats().requests_done == 1, "the other receiver's request, while pairing hangs")
        gate.set()
        receiver.grant()
        wait_for(lambda: service.stats().requests_done == 2, "the slow receiver's request after pairing")
    finally:
        gate.set()
        other.close()


def test_pairing_that_never_finishes_fails_its_requests_and_is_undone_later(
        make_service, transport, receiver, chunks) -> None:
    gate = transport.connect_gate["rx-a"] = threading.Event()
    # the deadline also bounds the Welcome: 3 s leaves a loaded machine's late Welcome inside it, and the gate holds
    # the pairing past it whatever the machine
    service = make_service(connect_timeout_s=3.0)
    service.submit("req-1", receiver.target, chunks.make(1), last=True)
    receiver.welcome()
    wait_for(lambda: service.stats().requests_failed == 1, "the request to fail at the pairing deadline")
    gate.set()  # too late: the transport reports success, but nobody uses this pairing now
    wait_for(lambda: transport.connected == ["rx-a"], "the late connect to return")
    wait_for(lambda: transport.disconnected == ["rx-a"], "the unused pairing to be undone")


# ---- the request's times for the proxy's timeline (KvSent) ---------------------------------------


@pytest.fixture
def proxy() -> Iterator[FakeProxy]:
    p = FakeProxy()
    yield p
    p.close()


def test_a_request_written_in_full_reports_its_times_to_the_proxy(make_service, receiver, chunks, proxy) -> None:
    service = make_service(proxy_url=proxy.url, instance_id="prefiller-t", heartbeat_interval_s=0.05)
    proxy.recv(protocol.Announce)  # connected: reports are no longer dropped
    earlier_s = 0.5  # the first store call "began" this long before submit: a lower bound for every span
    service.submit("req-1", receiver.target, chunks.make(2), last=False, called_s=time.perf_counter() - earlier_s)
    receiver.welcome()
    receiver.grant()
    service.submit("req-1", receiver.target, chunks.make(1), last=True)
    receiver.grant()
    sent = proxy.recv(protocol.KvSent)
    assert (sent.req_id, sent.instance_id, sent.tp_rank, sent.chunks, sent.nbytes) == ("req-1", "prefiller-t", 0, 3,
                                                                                        3 * SHAPE.nbytes)
    assert sent.submit_s >= earlier_s and sent.store_s >= earlier_s and sent.transfer_s >= sent.store_s
    # transfer_s split: the back-dated store shows in pickup; the Grant round trip and the writes follow it
    assert sent.pickup_s >= earlier_s and sent.grant_s > 0 and sent.write_s > 0
    assert sent.pickup_s + sent.grant_s + sent.write_s <= sent.transfer_s


def test_a_failed_request_reports_no_times(make_service, receiver, chunks, proxy) -> None:
    service = make_service(proxy_url=proxy.url, heartbeat_interval_s=0.05)
    proxy.recv(protocol.Announce)
    service.submit("req-1", receiver.target, chunks.make(1), last=True)
    receiver.welcome()
    receiver.grant([NUM_SLOTS])  # outside the buffer: the request fails
    failed = proxy.recv(protocol.KvFailed)
    assert failed.req_id == "req-1"
    with pytest.raises(AssertionError, match="no KvSent"):
        proxy.recv(protocol.KvSent, timeout_s=0.3)



def test_a_leaked_chunk_keeps_its_arena_page_once_the_service_lets_go_of_it(
        make_service, transport, receiver) -> None:
    """'Leaked' must mean the page stays taken: LMCache's TensorMemoryObj frees itself into its
    allocator when garbage collected (``__del__``, lmcache 0.5.3 and 0.5.6), so dropping the last
    Python reference to a chunk whose write never settled would hand its page to the next store
    while the transfer may still read it."""
    import gc

    from lmcache_p2p.backend.send_buffer import SendArena

    arena = SendArena(4 * torch.Size(SHAPE.shape).numel(), "cpu", [torch.Size(SHAPE.shape)], [torch.uint8])
    batch = []
    for i in range(2):
        obj = arena.allocate([torch.Size(SHAPE.shape)], [torch.uint8])
        obj.ref_count_up()  # the sender's reference (SenderBackend.batched_submit_put_task)
        batch.append(Chunk(f"page-{i}", SHAPE, obj.tensor, obj.ref_count_down))
        obj.ref_count_down()  # LMCache's own, dropped once every backend took the batch (batched_put)
    del obj  # from here on only the service holds the chunks, as in the engine
    transport.auto_complete = False
    service = make_service(settle_timeout_s=0.3)
    service.submit("req-1", receiver.target, batch, last=True)
    del batch
    receiver.welcome()
    receiver.grant()
    wait_for(lambda: transport.writes, "the write")
    transport.writes[0].error = "peer reset"  # failed, and never says its reads ended
    wait_for(lambda: service.stats().chunks_leaked == 2, "the unsettled chunks to be given up")
    gc.collect()
    assert arena.free_pages() == 2, "a page whose transfer never settled went back to the arena"


def test_an_unexpected_error_polling_one_write_releases_no_chunk_twice(
        make_service, transport, receiver, chunks) -> None:
    """A chunk's reference goes back exactly once: with the VRAM arena LMCache reuses the same
    MemoryObj for the page's next store, so a second ``done`` frees another request's chunk."""
    transport.auto_complete = False
    service = make_service()
    first, second = chunks.make(2), chunks.make(2)
    service.submit("req-1", receiver.target, first, last=False)
    receiver.welcome()
    receiver.grant([0, 1])
    wait_for(lambda: len(transport.writes) == 1, "the first write")
    service.submit("req-1", receiver.target, second, last=True)
    receiver.grant([2, 3])
    wait_for(lambda: len(transport.writes) == 2, "the second write")
    transport.writes[1].crash_after = transport.writes[0]
    transport.writes[0].done = True  # seen complete in the same pass that hits the error
    wait_for(lambda: service.stats().requests_failed == 1, "the request to fail")
    transport.writes[1].reads_ended = True
    wait_for(lambda: len(set(chunks.released)) == 4, "every chunk to be released")
    time.sleep(0.1)  # the loop goes on: a late second release would show here
    assert sorted(chunks.released) == sorted(_keys(first + second)), "a chunk was released twice"


# ---- the signed envelope: a receiver's frames are signed by its Welcome's id and addressed to us -------

SECRET = "members-secret"


class SignedReceiver(ScriptedReceiver):
    """A scripted receiver that holds the shared secret and answers to its id and control address."""

    def __init__(self, name: str, sender_id: str) -> None:
        super().__init__(name)
        self._codec = protocol.Codec(SECRET, identity=name, names=[name, self.target.address])
        self.sender_id = sender_id

    def send(self, msg: protocol.Message) -> None:
        self.forge(self._codec, msg, self.sender_id)

    def forge(self, codec: protocol.Codec, msg: protocol.Message, to: str) -> None:
        self._sock.send_multipart([self.identity, *codec.pack(msg, to)])


def test_a_grant_signed_by_another_receiver_or_for_another_sender_is_refused(make_service, transport, chunks) -> None:
    service = make_service(shared_secret=SECRET)
    rx = SignedReceiver("rx-b", service.sender_id)
    try:
        service.submit("req-1", rx.target, chunks.make(1), last=True)
        rx.welcome()  # the Hello was addressed to rx-b's control address (else its codec would refuse it)
        alloc = rx.recv(protocol.Alloc)  # addressed to rx-b's id, from its Welcome
        grant = protocol.Grant(alloc.seq, alloc.req_id, [0], free_slots=NUM_SLOTS - 1)
        rx.forge(protocol.Codec(SECRET, identity="rx-a"), grant, service.sender_id)  # another receiver's Grant
        rx.forge(protocol.Codec(SECRET, identity="rx-b"), grant, "prefiller-other/r0/0")  # for another sender
        wait_for(lambda: sum(service.stats().rejected_frames.values()) == 2, "both forged grants to be refused")
        assert service.stats().rejected_frames == {"spoofed": 1, "misaddressed": 1}
        assert transport.writes == [] and service.stats().requests_done == 0
        rx.send(grant)  # the receiver's own Grant is written
        wait_for(lambda: service.stats().requests_done == 1, "the request to finish")
        assert len(transport.writes) == 1 and chunks.released == [alloc.keys[0]]
    finally:
        rx.close()


def test_a_receiver_restarted_at_the_same_address_is_greeted_again_at_once(make_service, transport, chunks) -> None:
    """Under a shared secret the new incarnation's answers are signed by another id than the one that welcomed
    us; they used to be dropped as spoofed, so each request waited for the alloc timeout (10 s in the multi-host
    suite's Gloo restart). Now the sender greets the new one at once and the request goes on."""
    service = make_service(shared_secret=SECRET, alloc_timeout_s=60.0)
    rx = SignedReceiver("decoder-1/r0/aaaa", service.sender_id)
    try:
        service.submit("req-1", rx.target, chunks.make(1), last=True)
        rx.welcome()
        rx.grant()
        wait_for(lambda: service.stats().requests_done == 1, "the first request to finish")
        new = "decoder-1/r0/bbbb"  # the same decoder and rank, restarted: its process listens on the same port
        rx.name = new
        rx._codec = protocol.Codec(SECRET, identity=new, names=[new, rx.target.address, "decoder-1/r0/aaaa"])
        started = time.monotonic()
        service.submit("req-2", rx.target, chunks.make(1), last=True)
        rx.recv(protocol.Alloc)  # addressed to the old incarnation, which the new one never welcomed
        rx.send(protocol.ErrorReply(seq=-1, message="control message addressed to an earlier incarnation"))
        rx.welcome()  # greeted again
        alloc = rx.grant()
        wait_for(lambda: service.stats().requests_done == 2, "the second request to finish on the new incarnation")
        # within half the 60 s alloc timeout that a request greeted too late would wait out: a loaded machine can stretch
        # this exchange of five messages past a few seconds
        assert alloc.req_id.startswith("req-2") and time.monotonic() - started < 30.0
        assert service.stats().requests_failed == 0 and len(transport.writes) == 2
        assert service.stats().rejected_frames == {}
    finally:
        rx.close()


def test_a_sender_starts_nothing_until_start_and_close_is_safe_at_any_point(transport, chunks) -> None:
    cfg = P2PConfig(role=Role.SENDER)
    idle = SendService(cfg, tp_rank=0, tp_size=1, transport=transport)
    with pytest.raises(ClosedError, match="not started"):
        idle.submit("req-1", Target("127.0.0.1", 1), chunks.make(1), last=True)
    assert len(chunks.released) == 1  # refused chunks go back at once
    idle.close()
    idle.close()
    with pytest.raises(ClosedError, match="closed"):
        idle.start()
    started = SendService(cfg, tp_rank=0, tp_size=1, transport=transport).start()
    assert started.start() is started  # a second start does nothing
    started.close()
    started.close()


def test_a_grant_for_a_request_that_already_failed_is_cancelled_at_once(
        make_service, transport, receiver, chunks) -> None:
    """An Alloc held up on its way reaches the receiver after the sender gave its request up: the late
    Grant's slots are cancelled at once (nothing will write them), not left reserved until the lease."""
    service = make_service(alloc_timeout_s=CREDIT_TIMEOUT_S)
    service.submit("req-b", receiver.target, chunks.make(1), last=False)
    receiver.welcome()
    receiver.grant()
    service.submit("req-a", receiver.target, chunks.make(2), last=True)
    service.submit("req-b", receiver.target, chunks.make(1), last=False)
    retry = answer_b_once_a_retries(receiver)  # A's retry is answered only after its credit ran out
    assert receiver.recv(protocol.Cancel).req_id == "req-a"
    writes = len(transport.writes)
    receiver.send(protocol.Grant(retry.seq, retry.req_id, [5, 6], free_slots=0))
    late = receiver.recv(protocol.Cancel)
    assert late.req_id == "req-a" and "granted after" in late.reason
    assert len(transport.writes) == writes, "a write was posted into slots of a request that had ended"
    service.submit("req-b", receiver.target, chunks.make(1), last=True)
    receiver.grant()
    wait_for(lambda: service.stats().requests_done == 1, "request B to complete, untouched")


# ---- a store that failed before it reached the service; the bounded inbox ------------------------------


def test_a_store_failed_on_a_requests_first_batch_is_reported_kv_failed(make_service, receiver, proxy) -> None:
    service = make_service(proxy_url=proxy.url, heartbeat_interval_s=0.05)
    proxy.recv(protocol.Announce)
    service.fail_request("req-1", [(receiver.target, "")], "a store's GPU work did not finish within 1s "
                                                          "(p2p.store_ready_timeout_s)")
    failed = proxy.recv(protocol.KvFailed)
    assert failed.req_id == "req-1" and "p2p.store_ready_timeout_s" in failed.reason
    assert service.stats().requests_failed == 1 and service.pending_requests() == 0


def test_a_store_failed_after_earlier_batches_went_cancels_them_on_the_receiver(
        make_service, receiver, chunks, proxy) -> None:
    service = make_service(proxy_url=proxy.url, heartbeat_interval_s=0.05)
    proxy.recv(protocol.Announce)
    first = chunks.make(2)
    service.submit("req-1", receiver.target, first, last=False)
    receiver.welcome()
    receiver.grant()
    wait_for(lambda: sorted(chunks.released) == sorted(_keys(first)), "the first batch's writes")
    service.fail_request("req-1", [(receiver.target, "")], "a store's GPU work failed: RuntimeError: CUDA error")
    failed = proxy.recv(protocol.KvFailed)
    assert failed.req_id == "req-1" and "CUDA error" in failed.reason
    receiver.recv(protocol.Cancel)
    assert receiver.cancels() == ["req-1"]


def test_a_full_send_queue_refuses_with_the_setting_to_raise_and_releases_the_batch(
        make_service, receiver, chunks, monkeypatch) -> None:
    service = make_service(send_queue_max_batches=2)
    monkeypatch.setattr(service, "_take_inbox", lambda: None)  # the service's thread is behind
    service.submit("req-1", receiver.target, chunks.make(1), last=False)
    service.submit("req-1", receiver.target, chunks.make(1), last=False)
    third = chunks.make(2)
    with pytest.raises(QueueFull, match=r"p2p\.send_queue_max_batches") as refused:
        service.submit("req-1", receiver.target, third, last=True)
    assert refused.value.key == "p2p.send_queue_max_batches"
    assert sorted(chunks.released) == sorted(_keys(third)) and service.pending_requests() == 2


# ---- what a KvFailed tells the proxy about the decoder (its cause: the proxy fails over by it) -----------


def _silent_after_alloc(service: SendService, receiver: ScriptedReceiver, chunks: Chunks) -> None:
    service.submit("req-1", receiver.target, chunks.make(1), last=True)
    receiver.welcome()
    receiver.recv(protocol.Alloc)  # never answered: the decoder fell off the network


def _silent_at_hello(service: SendService, receiver: ScriptedReceiver, chunks: Chunks) -> None:
    service.submit("req-1", receiver.target, chunks.make(1), last=True)
    receiver.recv(protocol.Hello)  # never answered


def _too_large(service: SendService, receiver: ScriptedReceiver, chunks: Chunks) -> None:
    service.submit("req-1", receiver.target, chunks.make(1), last=True)
    receiver.welcome()
    alloc = receiver.recv(protocol.Alloc)
    receiver.send(protocol.Refused(alloc.seq, alloc.req_id, protocol.RefusalCode.TOO_LARGE, "a chunk exceeds a slot"))


def _store_failed(service: SendService, receiver: ScriptedReceiver, chunks: Chunks) -> None:
    service.fail_request("req-1", [(receiver.target, "")], "a store's GPU work failed")


@pytest.mark.parametrize("case, cause", [
    (_silent_after_alloc, protocol.KvFailCause.UNREACHABLE),
    (_silent_at_hello, protocol.KvFailCause.UNREACHABLE),
    (_too_large, protocol.KvFailCause.REFUSED),
    (_store_failed, protocol.KvFailCause.SENDER),
])
def test_kv_failed_says_what_is_known_about_the_decoder(make_service, receiver, chunks, proxy, case, cause) -> None:
    # short deadlines for the silent decoders; the others answer, in the time a loaded machine takes
    # each silent case shortens only the deadline it is about: a short Hello deadline also bounds a Welcome the
    # test sends late on a loaded machine, which would fail _silent_after_alloc before its Alloc
    short = {_silent_after_alloc: {"alloc_timeout_s": 0.5}, _silent_at_hello: {"connect_timeout_s": 0.5}}
    service = make_service(proxy_url=proxy.url, heartbeat_interval_s=0.05, **short.get(case, {}))
    proxy.recv(protocol.Announce)
    case(service, receiver, chunks)
    failed = proxy.recv(protocol.KvFailed)
    assert (failed.req_id, failed.cause) == ("req-1", cause), failed.reason


# ---- a batch handed over before its store's GPU work is done: Alloc at once, writes only once ready -----------


def test_no_write_is_posted_before_its_stores_gpu_work_is_done_even_once_granted(
        make_service, transport, receiver, chunks, proxy) -> None:
    service = make_service(proxy_url=proxy.url, instance_id="prefiller-t", heartbeat_interval_s=0.05)
    proxy.recv(protocol.Announce)
    ready = StoreReady()
    batch = chunks.make(2)
    service.submit("req-1", receiver.target, batch, last=True, ready=ready)
    receiver.welcome()
    alloc = receiver.grant()  # the Alloc went out while the GPU still works, and is granted
    assert alloc.keys == _keys(batch) and alloc.last
    time.sleep(0.3)  # the Grant is in, the bytes are not: nothing may be written
    assert transport.writes == [] and chunks.released == [] and service.stats().requests_done == 0
    ready.set_ready()
    wait_for(lambda: service.stats().requests_done == 1, "the writes once the GPU work is done")
    assert [w.addrs for w in transport.writes] == [[BUFFER_ADDR, BUFFER_ADDR + SLOT_BYTES]]
    assert sorted(chunks.released) == sorted(_keys(batch))
    sent = proxy.recv(protocol.KvSent)
    # pickup runs until the GPU work was seen done; the Grant's round trip overlapped it
    assert sent.pickup_s >= 0.3 and sent.grant_s < sent.pickup_s and sent.chunks == 2


def test_a_batch_whose_gpu_work_was_done_before_its_grant_is_written_at_the_grant(
        make_service, transport, receiver, chunks) -> None:
    service = make_service()
    ready = StoreReady()
    service.submit("req-1", receiver.target, chunks.make(1), last=True, ready=ready)
    receiver.welcome()
    alloc = receiver.recv(protocol.Alloc)  # held unanswered: the GPU finishes first
    ready.set_ready()
    time.sleep(0.1)
    assert transport.writes == []  # no slots yet
    receiver.send(protocol.Grant(alloc.seq, alloc.req_id, [3], free_slots=NUM_SLOTS - 1))
    wait_for(lambda: service.stats().requests_done == 1, "the write at the Grant")
    assert [w.addrs for w in transport.writes] == [[BUFFER_ADDR + 3 * SLOT_BYTES]]


def test_a_store_whose_gpu_work_ends_after_the_write_window_is_not_written(
        make_service, transport, receiver, chunks) -> None:
    service = make_service()
    ready = StoreReady()
    batch = chunks.make(2)
    service.submit("req-1", receiver.target, batch, last=True, ready=ready)
    receiver.welcome(transfer_timeout_s=0.2)
    receiver.grant()
    time.sleep(0.35)  # granted at once, but the bytes come after the receiver's window: it may have re-granted
    ready.set_ready()
    wait_for(lambda: service.stats().requests_failed == 1, "the request to fail past its write window")
    assert transport.writes == [], "a write was posted into slots the receiver may have re-granted"
    assert sorted(chunks.released) == sorted(_keys(batch))
    assert receiver.recv(protocol.Cancel).req_id == "req-1"


def _broken() -> bool:
    raise RuntimeError("CUDA error: an illegal memory access")


@pytest.mark.parametrize("done, reason", [
    (lambda: False, "p2p.store_ready_timeout_s"),
    (_broken, "illegal memory access"),
], ids=["gpu-timeout", "cuda-error"])
def test_a_store_that_fails_after_its_grant_fails_the_request_cancels_its_slots_and_releases_its_chunks(
        make_service, transport, receiver, chunks, proxy, done, reason) -> None:
    from lmcache_p2p.backend.store_ready import StoreWatch

    service = make_service(proxy_url=proxy.url, heartbeat_interval_s=0.05)
    proxy.recv(protocol.Announce)
    # a request before pairs us with the receiver: the store's Alloc then leaves as it is taken in, so the store's
    # deadline (0.3 s from its submission, where the timeout is the case) covers only an Alloc's round trip
    paired = chunks.make(1)
    service.submit("req-paired", receiver.target, paired, last=True)
    receiver.welcome()
    receiver.grant()
    wait_for(lambda: service.stats().requests_done == 1, "the pairing request")
    writes = len(transport.writes)
    gate = threading.Event()
    watch = StoreWatch("test-store", timeout_s=0.3 if reason == "p2p.store_ready_timeout_s" else 30.0, max_stores=8)
    try:
        ready = watch.watch(lambda: gate.is_set() and done())  # settles only once the test let the Grant in
        batch = chunks.make(2)
        service.submit("req-1", receiver.target, batch, last=True, ready=ready)
        receiver.grant()
        time.sleep(0.1)  # the Grant reached the sender before the store's GPU work failed
        gate.set()
        failed = proxy.recv(protocol.KvFailed)
    finally:
        watch.close()
    assert failed.req_id == "req-1" and reason in failed.reason and failed.cause is protocol.KvFailCause.SENDER
    assert receiver.recv(protocol.Cancel).req_id == "req-1"  # the granted slots go back on the decoder
    assert len(transport.writes) == writes and sorted(chunks.released) == sorted(_keys(paired + batch))
    assert service.stats().requests_failed == 1 and service.pending_requests() == 0


def test_a_store_that_fails_while_its_alloc_is_out_fails_the_request_and_its_late_grant_is_cancelled(
        make_service, transport, receiver, chunks, proxy) -> None:
    service = make_service(proxy_url=proxy.url, heartbeat_interval_s=0.05)
    proxy.recv(protocol.Announce)
    ready = StoreReady()
    batch = chunks.make(1)
    service.submit("req-1", receiver.target, batch, last=True, ready=ready)
    receiver.welcome()
    alloc = receiver.recv(protocol.Alloc)
    ready.set_failed("a store's GPU work failed: RuntimeError: CUDA error")
    failed = proxy.recv(protocol.KvFailed)  # at once, not at the Grant
    assert failed.req_id == "req-1" and "CUDA error" in failed.reason
    assert chunks.released == _keys(batch)
    receiver.recv(protocol.Cancel)
    receiver.send(protocol.Grant(alloc.seq, alloc.req_id, [0], free_slots=NUM_SLOTS - 1))
    assert "granted after" in receiver.recv(protocol.Cancel).reason
    assert transport.writes == []


def test_batches_stay_in_order_one_alloc_at_a_time_and_a_held_batch_holds_the_next_alloc(
        make_service, transport, receiver, chunks) -> None:
    service = make_service()
    first_ready, second_ready = StoreReady(), StoreReady()
    first, second, third = chunks.make(1), chunks.make(2), chunks.make(1)
    service.submit("req-1", receiver.target, first, last=False, ready=first_ready)
    service.submit("req-1", receiver.target, second, last=False, ready=second_ready)
    service.submit("req-1", receiver.target, third, last=True)  # host chunks: ready now
    receiver.welcome()
    assert receiver.grant([0]).keys == _keys(first)
    second_ready.set_ready()  # the later store's GPU work is seen done first
    with pytest.raises(AssertionError, match="no Alloc"):
        receiver.recv(protocol.Alloc, timeout_s=0.3)  # the first batch, granted but not ready, holds the next Alloc
    assert transport.writes == []
    first_ready.set_ready()
    assert receiver.grant([1, 2]).keys == _keys(second)
    alloc = receiver.grant([3])
    assert alloc.keys == _keys(third) and alloc.last
    wait_for(lambda: service.stats().requests_done == 1, "every batch written")
    assert [w.addrs for w in transport.writes] == [[BUFFER_ADDR + s * SLOT_BYTES for s in slots]
                                                   for slots in ([0], [1, 2], [3])]
    allocs = [m for m in receiver.seen if isinstance(m, protocol.Alloc)]
    assert [a.keys for a in allocs] == [_keys(first), _keys(second), _keys(third)]
