"""The sender's service: asks receivers for slots and writes chunks into them, pipelined.

The engine thread calls :meth:`SendService.submit` and returns at once. One named thread owns
every socket and drives all requests as a small event loop, never blocking on one of them:

    submit -> per-request FIFO of batches -> Alloc (one round trip per batch, not per chunk)
           -> Grant -> transport.write(chunks -> slots, notification=Written) -> poll -> done

Within a request at most one Alloc is outstanding, so the receiver sees batches in order and the
``last`` flag only after every earlier batch was granted; across requests everything overlaps,
and a batch's write overlaps the next batch's Alloc. A refused Alloc (buffer full) is retried
with backoff until ``p2p.alloc_timeout_s``; then THAT request fails, its slots are cancelled on
the receiver and nothing waits forever. A receiver that sends nothing at all within
``p2p.connect_timeout_s`` (Hello) / ``alloc_timeout_s`` (an Alloc) is dropped with every request
to it, and greeted afresh next time, so a restarted decoder is found again without restarting
the prefiller. A request whose last batch never comes fails after ``p2p.request_timeout_s``.

Liveness: the thread never dies of one bad message or request. An unexpected error while
handling a message or a request fails that request only (logged with request id, peer and
cause); should the thread stop anyway, ``submit`` refuses with ClosedError. Transport pairing
runs on a helper thread (NCCL pairing can take seconds), so one slow decoder never stalls the
others.

Memory: a chunk's reference goes back to LMCache (``Chunk.done``) only once the transport says
nothing reads it any more (``Transport.settled``): at once for a completed write, later for an
aborted one. One that never settles within ``p2p.settle_timeout_s`` is kept (leaked, logged):
LMCache reusing memory that a transfer still reads would put other KV on the wire.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from lmcache_p2p import protocol
from lmcache_p2p.backend.announcer import Announcer
from lmcache_p2p.config import SENDER_IDLE_POLL_S, P2PConfig
from lmcache_p2p.errors import ClosedError, P2PError, ProtocolError, RequestFailed, TransportError
from lmcache_p2p.transport import Transport, WriteHandle

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = round(SENDER_IDLE_POLL_S * 1000)
# While writes are in flight the thread polls them every p2p.write_poll_interval_s, sleeping in
# between (never spinning): it runs in the engine's process, on the engine's core and under its GIL,
# and a spin there slowed the prefill's sampling and answer right after the store (issue 9: store ->
# answer p90 19 -> 11 ms on 2 CPU cores) while the transfer itself took no longer (p50 1.5 ms both
# ways). With chunks in VRAM the default is 0.1 ms: a 2-GPU peer copy of 128 MiB takes ~0.45 ms, and a
# 1 ms poll saw it complete 1.35 ms after posting (p50, 2x H200).
_RETRY_POLL_MS = 1  # while only refused Allocs wait for their retry
_RETRY_FIRST_S = 0.002
_RETRY_MAX_S = 0.05
_CONNECT_GRACE_S = 1.0  # past the transport's own connect timeout, before a pairing is given up
_LOOP_ERROR_PAUSE_S = 0.05  # after an unexpected error in the loop itself (never a hot error loop)
_LOOP_ERRORS_MAX = 100  # consecutive loop errors after which the thread gives up (submit then refuses)


@dataclasses.dataclass
class Chunk:
    """One chunk to send: its key, shape and bytes; ``done`` drops the caller's reference."""

    key: str
    shape: protocol.ChunkShape
    tensor: Any  # torch.Tensor, contiguous
    done: Callable[[], None]


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a request's KV goes: the receiver's control endpoint for this TP rank."""

    host: str
    control_port: int

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.control_port}"

    @property
    def address(self) -> str:
        """The name a Hello addresses the receiver by (it answers to its control address)."""
        return f"{self.host}:{self.control_port}"


@dataclasses.dataclass
class _Batch:
    chunks: list[Chunk]
    last: bool
    called_s: float = 0.0  # perf_counter when the engine's store call began (the request's timeline)
    submit_s: float = 0.0  # time the engine's thread spent in that store call, up to queueing it


class _PeerState(enum.Enum):
    GREETING = "greeting"  # Hello sent, waiting for Welcome
    CONNECTING = "connecting"  # Welcome received, transport.connect running on a helper thread
    READY = "ready"


@dataclasses.dataclass
class _Peer:
    target: Target
    sock: zmq.Socket
    state: _PeerState
    deadline: float
    name: str = ""  # transport peer name, after Welcome
    receiver_id: str = ""  # the receiver's id, after Welcome: we address it by this, and it signs with it
    buffer_addr: int = 0  # the receiver's slot 0, after Welcome
    slot_bytes: int = 0
    num_slots: int = 0
    # How long after its Alloc left a write may still be in flight: our p2p.transfer_timeout_s, or the
    # receiver's when smaller (Welcome): past the receiver's, a slot it gave up may be granted again.
    write_timeout_s: float = 0.0
    last_heard: float = 0.0  # monotonic time of the last valid message from this receiver
    waiting: list[str] = dataclasses.field(default_factory=list)  # req ids waiting for the handshake


@dataclasses.dataclass
class _Request:
    req_id: str
    target: Target
    queue: deque[_Batch] = dataclasses.field(default_factory=deque)
    alloc_seq: int | None = None  # outstanding Alloc
    alloc_batch: _Batch | None = None
    alloc_deadline: float = 0.0  # buffer credit: the first Alloc of the batch + p2p.alloc_timeout_s
    alloc_sent_at: float = 0.0  # when the outstanding Alloc left (a silent receiver never answers it)
    retry_at: float | None = None
    retry_delay_s: float = _RETRY_FIRST_S
    refusal: str = ""  # the receiver's last FULL refusal, for the error if credit never comes
    writes: list[tuple[WriteHandle, list[Chunk], float]] = dataclasses.field(default_factory=list)
    last_granted: bool = False
    last_received: bool = False  # the engine's last store batch arrived
    granted_any: bool = False  # the receiver holds some of this request's chunks
    started: float = dataclasses.field(default_factory=time.monotonic)
    nbytes: int = 0
    first_called_s: float = 0.0  # perf_counter: the first store call's start (KvSent's times)
    last_stored_s: float = 0.0  # perf_counter: the last store call's end
    submit_s: float = 0.0  # summed over the request's store calls
    chunks_sent: int = 0
    # perf_counter stamps of the request's first pass through each step (KvSent's split of transfer_s)
    picked_s: float = 0.0  # the service thread took its first batch
    alloc_s: float = 0.0  # its first Alloc left
    granted_s: float = 0.0  # its first Grant came back
    posted_s: float = 0.0  # its first write was posted


@dataclasses.dataclass
class _Unsettled:
    """A failed or aborted write whose chunks wait until the transport says nothing reads them."""

    handle: WriteHandle
    chunks: list[Chunk]
    req_id: str
    give_up_at: float


@dataclasses.dataclass(frozen=True)
class _Connected:
    """What a pairing thread hands back to the service thread."""

    peer: _Peer
    name: str
    error: Exception | None


@dataclasses.dataclass(frozen=True)
class SendStats:
    requests_done: int
    requests_failed: int
    bytes_sent: int
    rejected_frames: dict[str, int] = dataclasses.field(default_factory=dict)  # by reason, see protocol.Rejection
    chunks_leaked: int = 0  # never handed back: their transfer never confirmed it stopped reading
    chunks_skipped: int = 0  # not sent: the receiver already held them (its buffer cache, or sent before)


class SendService:
    """Drives every in-flight request of one TP rank of a prefiller."""

    def __init__(self, cfg: P2PConfig, *, tp_rank: int, tp_size: int, transport: Transport,
                 fingerprint: protocol.Fingerprint | None = None) -> None:
        self._cfg = cfg
        self._write_poll_s = cfg.write_poll_s
        self._fingerprint = fingerprint  # what our KV means; receivers refuse a mismatch at Hello
        self._tp_rank = tp_rank
        self._tp_size = tp_size
        self._transport = transport
        self.instance_id = cfg.default_instance_id()
        self.sender_id = f"{self.instance_id}/r{tp_rank}/{uuid.uuid4().hex[:8]}"
        self._codec = protocol.Codec(cfg.shared_secret, identity=self.sender_id, window_s=cfg.auth_window_s,
                                     names=[self.sender_id])
        self._rejections = protocol.RejectionLog(logger, "sender control socket")
        self._seq = itertools.count(1)
        self._inbox: deque[tuple[str, Target, _Batch]] = deque()
        self._connected: deque[_Connected] = deque()  # results of pairing threads (under _inbox_lock)
        self._inbox_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._peers: dict[Target, _Peer] = {}
        self._requests: dict[str, _Request] = {}
        self._by_seq: dict[int, str] = {}
        self._unsettled: list[_Unsettled] = []
        # Chunks given up on (never settled): held for the process's life. Dropping the last reference
        # would not leak them: LMCache's TensorMemoryObj frees itself into its allocator when collected.
        self._leaked_chunks: list[Chunk] = []
        self._done = self._failed = self._bytes = self._leaked = self._skipped = 0
        self._stop = threading.Event()
        self._closed = False
        self._dead = ""  # why the service thread stopped, once it has
        self._ctx = zmq.Context()
        self._poller = zmq.Poller()
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._announcer = Announcer(cfg.proxy_url, self._codec, cfg.heartbeat_interval_s)
        self._thread = threading.Thread(target=self._run, name=f"p2p-sender-{tp_rank}", daemon=True)
        self._thread.start()

    # ---- engine-facing -----------------------------------------------------------------------

    def submit(self, req_id: str, target: Target, chunks: list[Chunk], last: bool, called_s: float = 0.0) -> None:
        """Queue one store batch of a request; returns immediately. ClosedError if the service
        cannot send it (closed, or its thread stopped): the chunks are released then. ``called_s``:
        ``time.perf_counter()`` when the engine's store call began (the proxy's request timeline)."""
        called_s = called_s or time.perf_counter()
        with self._inbox_lock:
            refusal = self._refusal()
            if not refusal:
                self._inbox.append((req_id, target, _Batch(chunks, last, called_s, time.perf_counter() - called_s)))
                self._wake_locked()
        if refusal:
            for c in chunks:
                c.done()
            raise ClosedError(f"request {req_id}: KV not sent to {target.endpoint}: {refusal}")

    def _refusal(self) -> str:
        if self._closed:
            return "the sender is closed"
        if self._dead or not self._thread.is_alive():
            return (f"the sender's service thread stopped ({self._dead or 'unknown cause'}); "
                    "restart the prefiller (see its log for the cause)")
        return ""

    def stats(self) -> SendStats:
        return SendStats(self._done, self._failed, self._bytes, self._codec.rejected, self._leaked, self._skipped)

    def pending_requests(self) -> int:
        return len(self._requests) + len(self._inbox)

    def close(self, timeout_s: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.error("sender thread did not stop within %.1fs", timeout_s)

    def _wake(self) -> None:
        with self._inbox_lock:
            self._wake_locked()

    def _wake_locked(self) -> None:
        if self._wake_w < 0:
            return  # the loop is gone (its pipe is closed)
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # a full pipe wakes the loop anyway

    # ---- the loop ----------------------------------------------------------------------------

    def _run(self) -> None:
        errors = 0
        try:
            while not self._stop.is_set():
                try:
                    self._step()
                    errors = 0
                except Exception:  # a bug in one step must not stop every later request
                    errors += 1
                    if errors >= _LOOP_ERRORS_MAX:
                        raise
                    logger.exception("sender service loop error (the loop goes on)")
                    self._stop.wait(_LOOP_ERROR_PAUSE_S)
        except BaseException as exc:
            self._dead = f"{type(exc).__name__}: {exc}"
            logger.critical("sender service thread stopped: %s; KV of new requests will not be sent", self._dead)
            raise
        finally:
            self._dead = self._dead or "stopped"
            self._shutdown()

    def _step(self) -> None:
        events = self._wait()
        if self._wake_r in events:
            self._drain_wake()
        self._take_connected()
        self._take_inbox()
        for peer in list(self._peers.values()):
            if peer.sock in events:
                self._drain_peer(peer)
        self._progress_writes()
        self._progress_unsettled()
        self._check_deadlines()
        if self._announcer.heartbeat_due():
            self._announcer.heartbeat(self._announce())

    def _wait(self) -> dict[Any, int]:
        """Sockets with input, waiting at most until the next check of writes in flight or retries.
        Unsettled writes (a failure path) are checked at the idle pace: no spinning for them."""
        writing = any(r.writes for r in self._requests.values())
        if writing and self._write_poll_s < 0.001:  # zmq's poll counts whole milliseconds
            events = dict(self._poller.poll(0))
            if not events:
                time.sleep(self._write_poll_s)
                events = dict(self._poller.poll(0))
            return events
        if writing:
            return dict(self._poller.poll(self._write_poll_s * 1000))
        retrying = any(r.retry_at is not None for r in self._requests.values())
        return dict(self._poller.poll(_RETRY_POLL_MS if retrying else _IDLE_POLL_MS))

    def _guarded(self, req_id: str, peer: str, what: str, step: Callable[[], None]) -> None:
        """Run one request's step; an unexpected error fails that request only."""
        try:
            step()
        except Exception as exc:
            logger.exception("request %s (receiver %s): unexpected error while %s", req_id, peer, what)
            self._fail(req_id, f"internal error while {what}: {type(exc).__name__}: {exc}")

    def _shutdown(self) -> None:
        for req_id in list(self._requests):
            self._fail(req_id, "prefiller is shutting down")
        with self._inbox_lock:
            pending, self._inbox = list(self._inbox), deque()
        for _, _, batch in pending:
            for c in batch.chunks:
                c.done()
        self._progress_unsettled(final=True)
        for peer in list(self._peers.values()):
            self._send(peer, protocol.Goodbye(self.sender_id, self._tp_rank))
            self._drop_peer(peer)
        self._announcer.close(protocol.Goodbye(self.instance_id, self._tp_rank))
        self._ctx.term()
        with self._inbox_lock:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_w = -1

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _take_inbox(self) -> None:
        with self._inbox_lock:
            items, self._inbox = self._inbox, deque()
        for req_id, target, batch in items:
            self._guarded(req_id, target.endpoint, "queueing a store batch",
                          lambda r=req_id, t=target, b=batch: self._queue_batch(r, t, b))

    def _queue_batch(self, req_id: str, target: Target, batch: _Batch) -> None:
        req = self._requests.get(req_id)
        if req is None:
            req = self._requests[req_id] = _Request(req_id, target)
        elif req.target != target:
            logger.error("request %s changed receiver mid-way (%s -> %s); ignoring batch",
                         req_id, req.target.endpoint, target.endpoint)
            for c in batch.chunks:
                c.done()
            return
        req.queue.append(batch)
        req.last_received = req.last_received or batch.last
        req.picked_s = req.picked_s or time.perf_counter()
        req.first_called_s = req.first_called_s or batch.called_s
        req.last_stored_s = batch.called_s + batch.submit_s
        req.submit_s += batch.submit_s
        self._advance(req)

    # ---- peers -------------------------------------------------------------------------------

    def _peer(self, target: Target) -> _Peer:
        peer = self._peers.get(target)
        if peer is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
            sock.setsockopt(zmq.IDENTITY, f"{self.sender_id}@{uuid.uuid4().hex[:6]}".encode())
            sock.connect(target.endpoint)
            self._poller.register(sock, zmq.POLLIN)
            peer = _Peer(target, sock, _PeerState.GREETING, time.monotonic() + self._cfg.connect_timeout_s)
            self._peers[target] = peer
            self._send(peer, protocol.Hello(protocol.PROTOCOL_VERSION, self.sender_id, self._tp_rank,
                                            self._transport.info(), self._fingerprint))
        return peer

    def _drop_peer(self, peer: _Peer) -> None:
        if self._peers.get(peer.target) is peer:
            del self._peers[peer.target]
        self._poller.unregister(peer.sock)
        peer.sock.close()
        if peer.name:
            self._disconnect(peer.name)

    def _disconnect(self, name: str) -> None:
        """Forget a transport peer; the transport must return at once (teardown runs on its side)."""
        try:
            self._transport.disconnect(name)
        except P2PError as exc:
            logger.warning("disconnecting transport peer %s failed: %s", name, exc)

    def _send(self, peer: _Peer, msg: protocol.Message) -> None:
        try:
            peer.sock.send_multipart(self._codec.pack(msg, peer.receiver_id or peer.target.address),
                                     flags=zmq.DONTWAIT)
        except zmq.Again:
            logger.debug("control queue to %s full; message dropped", peer.target.endpoint)

    def _drain_peer(self, peer: _Peer) -> None:
        while self._peers.get(peer.target) is peer:
            try:
                frames = peer.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                env = self._codec.open(frames)
            except ProtocolError as exc:  # counted by the codec (stats().rejected_frames)
                self._rejections.log(protocol.rejection_of(exc), f"from {peer.target.endpoint}: {exc}")
                continue
            spoofed = self._signer_refusal(peer, env)
            if spoofed:
                self._codec.count_rejected(protocol.Rejection.SPOOFED)
                self._rejections.log(protocol.Rejection.SPOOFED, f"from {peer.target.endpoint}: {spoofed}")
                continue
            peer.last_heard = time.monotonic()
            self._on_message_guarded(peer, env.msg)

    def _signer_refusal(self, peer: _Peer, env: protocol.Envelope) -> str:
        """Under a shared secret, a receiver's frames are signed by the id its Welcome gave (a Grant
        another receiver made for us never counts here); "" when acceptable."""
        if not self._codec.authenticated:
            return ""
        expected = peer.receiver_id or (env.msg.receiver_id if isinstance(env.msg, protocol.Welcome) else env.sender)
        if env.sender == expected:
            return ""
        return f"{type(env.msg).__name__} signed by {env.sender!r}, but this receiver is {expected!r}"

    def _on_message_guarded(self, peer: _Peer, msg: protocol.Message) -> None:
        """Handle one message; an unexpected error fails the request it concerns, or the peer."""
        try:
            self._on_message(peer, msg)
        except Exception as exc:
            req_id = self._by_seq.get(getattr(msg, "seq", -1)) or getattr(msg, "req_id", "")
            logger.exception("unexpected error handling %s from receiver %s (request %s)",
                             type(msg).__name__, peer.target.endpoint, req_id or "-")
            reason = f"internal error handling {type(msg).__name__}: {type(exc).__name__}: {exc}"
            if req_id in self._requests:
                self._fail(req_id, reason)
            elif self._peers.get(peer.target) is peer and peer.state is not _PeerState.READY:
                self._fail_peer(peer, reason)

    def _on_message(self, peer: _Peer, msg: protocol.Message) -> None:
        if isinstance(msg, protocol.Welcome):
            self._on_welcome(peer, msg)
        elif isinstance(msg, protocol.Grant):
            self._on_grant(peer, msg)
        elif isinstance(msg, protocol.Refused):
            self._on_refused(peer, msg)
        elif isinstance(msg, protocol.ErrorReply):
            if msg.seq in self._by_seq:
                self._fail(self._by_seq[msg.seq], f"receiver error: {msg.message}")
            else:
                self._fail_peer(peer, f"receiver {peer.target.endpoint} refused us: {msg.message}")
        # Ack needs nothing.

    def _on_welcome(self, peer: _Peer, msg: protocol.Welcome) -> None:
        if peer.state is not _PeerState.GREETING:
            return
        if msg.num_slots <= 0 or msg.slot_bytes <= 0:
            self._fail_peer(peer, f"receiver {peer.target.endpoint} offers {msg.num_slots} slots of "
                                  f"{msg.slot_bytes} bytes: nothing can be granted")
            return
        peer.state = _PeerState.CONNECTING
        peer.receiver_id = msg.receiver_id
        peer.buffer_addr, peer.slot_bytes, peer.num_slots = msg.buffer_addr, msg.slot_bytes, msg.num_slots
        theirs = msg.transfer_timeout_s
        peer.write_timeout_s = min(self._cfg.transfer_timeout_s, theirs) if theirs > 0 else self._cfg.transfer_timeout_s
        peer.deadline = time.monotonic() + self._cfg.connect_timeout_s + _CONNECT_GRACE_S
        logger.debug("receiver %s at %s welcomed us; pairing its transport", msg.receiver_id, peer.target.endpoint)
        threading.Thread(target=self._pair, args=(peer, msg.transport), daemon=True,
                         name=f"p2p-sender-{self._tp_rank}-pair").start()

    def _pair(self, peer: _Peer, info: protocol.TransportInfo) -> None:
        """On a helper thread: the transport's connect (NCCL pairing can block for seconds)."""
        try:
            result = _Connected(peer, self._transport.connect(info, self._cfg.connect_timeout_s), None)
        except Exception as exc:  # handed to the service thread, which fails the peer
            result = _Connected(peer, "", exc)
        with self._inbox_lock:
            self._connected.append(result)
            self._wake_locked()

    def _take_connected(self) -> None:
        with self._inbox_lock:
            results, self._connected = self._connected, deque()
        for result in results:
            self._on_connected(result)

    def _on_connected(self, result: _Connected) -> None:
        peer = result.peer
        if self._peers.get(peer.target) is not peer or peer.state is not _PeerState.CONNECTING:
            # Given up meanwhile: undo a pairing nobody uses, unless a newer peer shares it.
            if result.name and not any(p.name == result.name or p.state is _PeerState.CONNECTING
                                       for p in self._peers.values() if p.target == peer.target):
                self._disconnect(result.name)
            return
        if result.error is not None:
            self._fail_peer(peer, f"transport connect to {peer.target.endpoint} failed: {result.error}")
            return
        peer.name, peer.state = result.name, _PeerState.READY
        logger.info("connected to receiver at %s (%d slots of %d bytes)",
                    peer.target.endpoint, peer.num_slots, peer.slot_bytes)
        waiting, peer.waiting = peer.waiting, []
        for req_id in waiting:
            if req_id in self._requests:
                self._guarded(req_id, peer.target.endpoint, "starting after the handshake",
                              lambda r=self._requests[req_id]: self._advance(r))

    def _fail_peer(self, peer: _Peer, reason: str) -> None:
        for req_id in [r.req_id for r in self._requests.values() if r.target == peer.target]:
            self._fail(req_id, reason, cancel=False)
        self._drop_peer(peer)

    # ---- requests ----------------------------------------------------------------------------

    def _advance(self, req: _Request) -> None:
        """Send the next Alloc of ``req`` if none is outstanding; finish it when all is written."""
        if req.alloc_seq is not None or req.retry_at is not None:
            return
        if not req.queue:
            if req.last_granted and not req.writes:
                self._finish(req)
            return
        peer = self._peer(req.target)
        if peer.state is not _PeerState.READY:
            if req.req_id not in peer.waiting:
                peer.waiting.append(req.req_id)
            return
        batch = req.queue.popleft()
        self._send_alloc(peer, req, batch)

    def _send_alloc(self, peer: _Peer, req: _Request, batch: _Batch) -> None:
        seq = next(self._seq)
        req.alloc_seq, req.alloc_batch = seq, batch
        req.alloc_sent_at = time.monotonic()
        req.alloc_s = req.alloc_s or time.perf_counter()
        if not req.alloc_deadline:
            req.alloc_deadline = req.alloc_sent_at + self._cfg.alloc_timeout_s
        self._by_seq[seq] = req.req_id
        self._send(peer, protocol.Alloc(seq, req.req_id, [c.key for c in batch.chunks],
                                        [c.shape for c in batch.chunks], batch.last))

    def _on_grant(self, peer: _Peer, msg: protocol.Grant) -> None:
        req = self._pop_alloc(msg.seq)
        if req is None:
            return
        batch, req.alloc_batch = req.alloc_batch, None
        asked_at = req.alloc_sent_at  # this Grant's Alloc (one is outstanding per request)
        req.granted_s = req.granted_s or time.perf_counter()
        req.alloc_deadline = 0.0
        req.retry_delay_s = _RETRY_FIRST_S
        problem = _grant_problem(msg.slots, batch.chunks, peer)
        if problem:
            for c in batch.chunks:
                c.done()  # nothing of this batch was written
            self._fail(req.req_id, f"bad grant from {peer.target.endpoint}: {problem}")
            return
        to_write = [(c, s) for c, s in zip(batch.chunks, msg.slots) if s >= 0]
        for c, s in zip(batch.chunks, msg.slots):
            if s < 0:
                c.done()  # the receiver already holds this chunk (its cache, or re-sent by a later store)
                self._skipped += 1
        req.last_granted = req.last_granted or batch.last
        req.granted_any = req.granted_any or any(s >= 0 for s in msg.slots)
        if to_write:
            self._write(req, to_write, asked_at)
        if req.req_id in self._requests:  # the write may have failed the request
            self._advance(req)

    def _write(self, req: _Request, pairs: Sequence[tuple[Chunk, int]], asked_at: float) -> None:
        """Write granted chunks; every write must end (or be aborted) within the write window of its
        Alloc (``_Peer.write_timeout_s``), so it can never land in a slot the receiver re-granted."""
        peer = self._peers.get(req.target)
        chunks = [c for c, _ in pairs]
        slots = [s for _, s in pairs]
        if peer is None or not peer.name:
            for c in chunks:
                c.done()
            self._fail(req.req_id, "receiver connection lost before writing")
            return
        deadline = asked_at + (peer.write_timeout_s or self._cfg.transfer_timeout_s)
        if time.monotonic() >= deadline:
            for c in chunks:
                c.done()  # nothing was posted
            self._fail(req.req_id, f"grant from {req.target.endpoint} came {time.monotonic() - asked_at:.1f}s after "
                                   f"its Alloc, past the {deadline - asked_at:.1f}s write window (p2p.transfer_timeout_s): "
                                   "not written, the receiver may have given those slots up")
            return
        notif = protocol.encode(protocol.Written(self.sender_id, req.req_id, slots))
        try:
            handle = self._transport.write(peer.name, [c.tensor for c in chunks],
                                           [peer.buffer_addr + s * peer.slot_bytes for s in slots], notif)
        except Exception as exc:  # a write that raises posted nothing (the transport's contract)
            if not isinstance(exc, (TransportError, ValueError)):
                logger.exception("request %s: unexpected error writing to %s", req.req_id, req.target.endpoint)
            for c in chunks:
                c.done()
            self._fail(req.req_id, f"write to {req.target.endpoint} failed: {type(exc).__name__}: {exc}")
            return
        req.writes.append((handle, chunks, deadline))
        req.posted_s = req.posted_s or time.perf_counter()

    def _progress_writes(self) -> None:
        for req in list(self._requests.values()):
            if req.writes:
                self._guarded(req.req_id, req.target.endpoint, "polling its writes",
                              lambda r=req: self._progress_request_writes(r))

    def _progress_request_writes(self, req: _Request) -> None:
        failed: str | None = None
        # A write leaves req.writes before its chunks are released: should a later poll raise, _fail
        # then handles only the writes not yet released (a second done would free a reused page).
        for write in list(req.writes):
            handle, chunks, deadline = write
            try:
                done = self._transport.poll(handle)
            except TransportError as exc:
                _drop(req, write)
                self._release_after(handle, chunks, req.req_id)
                failed = f"write to {req.target.endpoint} failed: {exc}"
                continue
            if not done and time.monotonic() > deadline:
                _drop(req, write)
                self._transport.abort(handle)
                self._release_after(handle, chunks, req.req_id)
                failed = (f"write of {handle.nbytes} bytes to {req.target.endpoint} not done within its write "
                          f"window (p2p.transfer_timeout_s, the smaller of ours and the receiver's, from the Alloc)")
            elif done:
                _drop(req, write)
                for c in chunks:
                    c.done()  # completed: settled by contract
                req.nbytes += handle.nbytes
                req.chunks_sent += len(chunks)
        if failed:
            self._fail(req.req_id, failed)
        elif not req.writes:
            self._advance(req)

    def _release_after(self, handle: WriteHandle, chunks: list[Chunk], req_id: str) -> None:
        """Hand ``chunks`` back once nothing reads them: now if the write settled, else later."""
        if self._transport.settled(handle):
            for c in chunks:
                c.done()
            return
        self._unsettled.append(_Unsettled(handle, chunks, req_id, time.monotonic() + self._cfg.settle_timeout_s))

    def _progress_unsettled(self, final: bool = False) -> None:
        """Release chunks of failed writes whose reads ended; give up (leak) past settle_timeout_s."""
        if not self._unsettled:
            return
        now = time.monotonic()
        keep: list[_Unsettled] = []
        for item in self._unsettled:
            if self._transport.settled(item.handle):
                for c in item.chunks:
                    c.done()
            elif final or now >= item.give_up_at:
                self._leaked += len(item.chunks)
                self._leaked_chunks.extend(item.chunks)
                logger.log(logging.WARNING if final else logging.ERROR,
                           "request %s: a failed write of %d bytes to %s did not confirm that its reads ended %s; "
                           "its %d chunk(s) stay referenced (leaked) so that LMCache never reuses memory a "
                           "transfer may still read", item.req_id, item.handle.nbytes, item.handle.peer,
                           "before shutdown" if final else
                           f"within {self._cfg.settle_timeout_s:.1f}s (p2p.settle_timeout_s)", len(item.chunks))
            else:
                keep.append(item)
        self._unsettled = keep

    def _on_refused(self, peer: _Peer, msg: protocol.Refused) -> None:
        req = self._requests.get(self._by_seq.get(msg.seq, ""))
        if req is None:
            return
        if msg.code is protocol.RefusalCode.FULL:
            req.refusal = f"{msg.free_slots} of {msg.capacity_slots} slots free, {msg.needed_slots} needed"
        if msg.code is protocol.RefusalCode.FULL and time.monotonic() < req.alloc_deadline:
            self._pop_alloc(msg.seq)
            req.retry_at = time.monotonic() + req.retry_delay_s  # alloc_batch stays for the retry
            req.retry_delay_s = min(req.retry_delay_s * 2, _RETRY_MAX_S)
            return
        if msg.code is protocol.RefusalCode.UNKNOWN_PEER:
            self._on_receiver_restarted(peer)
            return
        if msg.code is protocol.RefusalCode.FULL:
            reason = (f"decoder buffer stayed full for {self._cfg.alloc_timeout_s:.1f}s (p2p.alloc_timeout_s): "
                      f"{msg.free_slots} of {msg.capacity_slots} slots free, {msg.needed_slots} needed")
        else:
            reason = f"refused by receiver ({msg.code.value}): {msg.reason}"
        self._fail(req.req_id, reason, expected=msg.code is protocol.RefusalCode.FINISHED)

    def _on_receiver_restarted(self, peer: _Peer) -> None:
        """The receiver forgot us (it restarted): greet it afresh; requests that lost chunks fail."""
        logger.warning("receiver %s restarted; greeting it again", peer.target.endpoint)
        resumable = []
        for req in [r for r in self._requests.values() if r.target == peer.target]:
            if req.granted_any or req.writes:
                self._fail(req.req_id, f"receiver {peer.target.endpoint} restarted and lost this request's KV",
                           cancel=False)
                continue
            if req.alloc_seq is not None:
                self._by_seq.pop(req.alloc_seq, None)
                req.alloc_seq = None
            if req.alloc_batch is not None:
                req.queue.appendleft(req.alloc_batch)
                req.alloc_batch = None
            req.retry_at = None
            resumable.append(req)
        self._drop_peer(peer)
        for req in resumable:
            self._guarded(req.req_id, peer.target.endpoint, "greeting a restarted receiver",
                          lambda r=req: self._advance(r))

    def _pop_alloc(self, seq: int) -> _Request | None:
        req_id = self._by_seq.pop(seq, None)
        req = self._requests.get(req_id) if req_id else None
        if req is None or req.alloc_seq != seq:
            return None
        req.alloc_seq = None
        return req

    # ---- deadlines ---------------------------------------------------------------------------

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for peer in list(self._peers.values()):
            if peer.state is _PeerState.GREETING and now > peer.deadline:
                self._fail_peer(peer, f"receiver {peer.target.endpoint} did not answer Hello within "
                                      f"{self._cfg.connect_timeout_s:.1f}s (p2p.connect_timeout_s)")
            elif peer.state is _PeerState.CONNECTING and now > peer.deadline:
                self._fail_peer(peer, f"transport pairing with {peer.target.endpoint} did not finish within "
                                      f"{self._cfg.connect_timeout_s:.1f}s (p2p.connect_timeout_s)")
        for req in list(self._requests.values()):
            if req.req_id in self._requests:  # an earlier one may have failed its whole peer
                self._guarded(req.req_id, req.target.endpoint, "checking its deadlines",
                              lambda r=req, t=now: self._check_request(r, t))

    def _check_request(self, req: _Request, now: float) -> None:
        peer = self._peers.get(req.target)
        if req.alloc_seq is not None and peer is not None and self._silent(peer, req, now):
            # No reply to this Alloc and nothing else from the receiver since it left: it is gone.
            self._fail_peer(peer, f"receiver {req.target.endpoint} sent nothing for "
                                  f"{now - req.alloc_sent_at:.1f}s after an allocation (p2p.alloc_timeout_s)")
        elif req.alloc_deadline and now > req.alloc_deadline and (req.alloc_seq is not None or req.retry_at):
            # The receiver is alive but had no buffer credit for this request in time: it alone fails.
            self._fail(req.req_id, f"no buffer credit on {req.target.endpoint} within "
                                   f"{self._cfg.alloc_timeout_s:.1f}s (p2p.alloc_timeout_s)"
                                   + (f"; last refusal: {req.refusal}" if req.refusal else ""))
        elif req.retry_at is not None and now >= req.retry_at:
            self._retry_alloc(req, peer)
        elif not req.last_received and now > req.started + self._cfg.request_timeout_s:
            self._fail(req.req_id, f"its last store batch did not arrive within {self._cfg.request_timeout_s:.1f}s "
                                   "of its first (p2p.request_timeout_s): the client left mid-prefill?")

    def _silent(self, peer: _Peer, req: _Request, now: float) -> bool:
        return now > req.alloc_sent_at + self._cfg.alloc_timeout_s and peer.last_heard < req.alloc_sent_at

    def _retry_alloc(self, req: _Request, peer: _Peer | None) -> None:
        req.retry_at = None
        batch, req.alloc_batch = req.alloc_batch, None
        if peer is None or peer.state is not _PeerState.READY:
            req.queue.appendleft(batch)
            self._advance(req)
        else:
            self._send_alloc(peer, req, batch)

    # ---- endings -----------------------------------------------------------------------------

    def _finish(self, req: _Request) -> None:
        del self._requests[req.req_id]
        self._done += 1
        self._bytes += req.nbytes
        logger.debug("request %s: %d bytes sent in %.1f ms", req.req_id, req.nbytes,
                     (time.monotonic() - req.started) * 1000)
        self._announcer.send(self._sent_report(req))

    def _sent_report(self, req: _Request) -> protocol.KvSent:
        """The request's times for the proxy's timeline (its last write was just seen complete)."""
        now = time.perf_counter()

        def span(start: float, end: float) -> float:
            return max(0.0, end - start) if start and end else 0.0

        return protocol.KvSent(req.req_id, self.instance_id, self._tp_rank,
                               store_s=req.last_stored_s - req.first_called_s, submit_s=req.submit_s,
                               transfer_s=now - req.first_called_s, chunks=req.chunks_sent, nbytes=req.nbytes,
                               pickup_s=span(req.first_called_s, req.picked_s),
                               grant_s=span(req.alloc_s, req.granted_s), write_s=span(req.posted_s, now))

    def _fail(self, req_id: str, reason: str, *, cancel: bool = True, expected: bool = False) -> None:
        req = self._requests.pop(req_id, None)
        if req is None:
            return
        self._failed += 1
        if req.alloc_seq is not None:
            self._by_seq.pop(req.alloc_seq, None)
        for batch in [req.alloc_batch, *req.queue]:
            for c in batch.chunks if batch else ():
                c.done()
        for handle, chunks, _ in req.writes:
            self._transport.abort(handle)
            self._release_after(handle, chunks, req_id)  # only once nothing reads them
        err = RequestFailed(f"request {req_id} to {req.target.endpoint}: {reason}")
        logger.log(logging.INFO if expected else logging.ERROR, "%s", err)
        peer = self._peers.get(req.target)
        if cancel and peer is not None and peer.state is _PeerState.READY:
            self._send(peer, protocol.Cancel(next(self._seq), req_id, reason))
        self._announcer.send(protocol.KvFailed(req_id, self.instance_id, self._tp_rank, reason))

    def _announce(self) -> protocol.Announce:
        return protocol.Announce(
            version=protocol.PROTOCOL_VERSION, instance_id=self.instance_id, role="sender",
            http_url=self._cfg.http_url or "", tp_rank=self._tp_rank, tp_size=self._tp_size,
            fingerprint=self._fingerprint,
        )


def _drop(req: _Request, write: tuple[WriteHandle, list[Chunk], float]) -> None:
    """Take one write out of ``req.writes`` (by identity: handles may compare equal)."""
    req.writes = [w for w in req.writes if w is not write]


def _grant_problem(slots: Sequence[int], chunks: Sequence[Chunk], peer: _Peer) -> str:
    """What is wrong with a Grant for ``chunks`` from ``peer`` ("" when it can be written)."""
    if len(slots) != len(chunks):
        return f"{len(slots)} slots for {len(chunks)} chunks"
    seen: set[int] = set()
    for slot, chunk in zip(slots, chunks):
        if slot < 0:
            continue  # already held by the receiver
        if slot >= peer.num_slots:
            return f"slot {slot} is outside the receiver's {peer.num_slots} slots"
        if slot in seen:
            return f"slot {slot} granted twice"
        seen.add(slot)
        nbytes = int(chunk.tensor.nbytes)
        if nbytes > peer.slot_bytes:  # it would spill into the next slot
            return f"chunk {chunk.key} is {nbytes} bytes but a slot of {peer.target.endpoint} holds {peer.slot_bytes}"
    return ""


__all__ = ["Chunk", "P2PError", "SendService", "SendStats", "Target"]
