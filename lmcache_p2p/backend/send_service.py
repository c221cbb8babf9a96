"""The sender's service: asks receivers for slots and writes chunks into them, pipelined.

The engine thread calls :meth:`SendService.submit` and returns at once. One named thread owns
every socket and drives all requests as a small event loop, never blocking on one of them:

    submit -> per-request FIFO of batches -> Alloc (one round trip per batch, not per chunk)
           -> Grant -> transport.write(chunks -> slots, notification=Written) -> poll -> done

Within a request at most one Alloc is outstanding, so the receiver sees batches in order and the
``last`` flag only after every earlier batch was granted; across requests everything overlaps,
and a batch's write overlaps the next batch's Alloc. A refused Alloc (buffer full) is retried
with backoff until ``p2p.alloc_timeout_s``; then the request fails, its slots are cancelled on
the receiver and nothing waits forever. A receiver that does not answer within
``p2p.connect_timeout_s`` / ``alloc_timeout_s`` is dropped and greeted afresh next time, so a
restarted decoder is found again without restarting the prefiller.
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
from lmcache_p2p.config import P2PConfig
from lmcache_p2p.errors import ClosedError, P2PError, ProtocolError, RequestFailed, TransportError
from lmcache_p2p.transport import Transport, WriteHandle

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 50
_BUSY_POLL_MS = 0
_RETRY_FIRST_S = 0.002
_RETRY_MAX_S = 0.05


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


@dataclasses.dataclass
class _Batch:
    chunks: list[Chunk]
    last: bool


class _PeerState(enum.Enum):
    GREETING = "greeting"
    READY = "ready"


@dataclasses.dataclass
class _Peer:
    target: Target
    sock: zmq.Socket
    state: _PeerState
    deadline: float
    name: str = ""  # transport peer name, after Welcome
    buffer_addr: int = 0  # the receiver's slot 0, after Welcome
    slot_bytes: int = 0
    waiting: list[str] = dataclasses.field(default_factory=list)  # req ids waiting for the handshake


@dataclasses.dataclass
class _Request:
    req_id: str
    target: Target
    queue: deque[_Batch] = dataclasses.field(default_factory=deque)
    alloc_seq: int | None = None  # outstanding Alloc
    alloc_batch: _Batch | None = None
    alloc_deadline: float = 0.0
    retry_at: float | None = None
    retry_delay_s: float = _RETRY_FIRST_S
    writes: list[tuple[WriteHandle, list[Chunk], float]] = dataclasses.field(default_factory=list)
    last_granted: bool = False
    granted_any: bool = False  # the receiver holds some of this request's chunks
    started: float = dataclasses.field(default_factory=time.monotonic)
    nbytes: int = 0


@dataclasses.dataclass(frozen=True)
class SendStats:
    requests_done: int
    requests_failed: int
    bytes_sent: int


class SendService:
    """Drives every in-flight request of one TP rank of a prefiller."""

    def __init__(self, cfg: P2PConfig, *, tp_rank: int, tp_size: int, transport: Transport,
                 fingerprint: protocol.Fingerprint | None = None) -> None:
        self._cfg = cfg
        self._fingerprint = fingerprint  # what our KV means; receivers refuse a mismatch at Hello
        self._tp_rank = tp_rank
        self._tp_size = tp_size
        self._transport = transport
        self.instance_id = cfg.instance_id or f"prefiller-{os.getpid()}"
        self.sender_id = f"{self.instance_id}/r{tp_rank}/{uuid.uuid4().hex[:8]}"
        self._codec = protocol.Codec(cfg.shared_secret)
        self._seq = itertools.count(1)
        self._inbox: deque[tuple[str, Target, _Batch]] = deque()
        self._inbox_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._peers: dict[Target, _Peer] = {}
        self._requests: dict[str, _Request] = {}
        self._by_seq: dict[int, str] = {}
        self._done = self._failed = self._bytes = 0
        self._stop = threading.Event()
        self._closed = False
        self._ctx = zmq.Context()
        self._poller = zmq.Poller()
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._announcer = Announcer(cfg.proxy_url, self._codec, cfg.heartbeat_interval_s)
        self._thread = threading.Thread(target=self._run, name=f"p2p-sender-{tp_rank}", daemon=True)
        self._thread.start()

    # ---- engine-facing -----------------------------------------------------------------------

    def submit(self, req_id: str, target: Target, chunks: list[Chunk], last: bool) -> None:
        """Queue one store batch of a request; returns immediately."""
        if self._closed:
            for c in chunks:
                c.done()
            raise ClosedError("sender is closed")
        with self._inbox_lock:
            self._inbox.append((req_id, target, _Batch(chunks, last)))
        os.write(self._wake_w, b"x")

    def stats(self) -> SendStats:
        return SendStats(self._done, self._failed, self._bytes)

    def pending_requests(self) -> int:
        return len(self._requests) + len(self._inbox)

    def close(self, timeout_s: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        os.write(self._wake_w, b"x")
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.error("sender thread did not stop within %.1fs", timeout_s)

    # ---- the loop ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                busy = any(r.writes or r.retry_at is not None for r in self._requests.values())
                events = dict(self._poller.poll(_BUSY_POLL_MS if busy else _IDLE_POLL_MS))
                if self._wake_r in events:
                    self._drain_wake()
                self._take_inbox()
                for peer in list(self._peers.values()):
                    if peer.sock in events:
                        self._drain_peer(peer)
                self._progress_writes()
                self._check_deadlines()
                if self._announcer.heartbeat_due():
                    self._announcer.heartbeat(self._announce())
                if busy:
                    time.sleep(0)  # let the engine thread run on a 2-core machine
        except Exception:
            logger.exception("sender service thread crashed; KV of new requests will not be sent")
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        for req_id in list(self._requests):
            self._fail(req_id, "prefiller is shutting down")
        with self._inbox_lock:
            pending, self._inbox = list(self._inbox), deque()
        for _, _, batch in pending:
            for c in batch.chunks:
                c.done()
        for peer in list(self._peers.values()):
            self._send(peer, protocol.Goodbye(self.sender_id, self._tp_rank))
            self._drop_peer(peer)
        self._announcer.close(protocol.Goodbye(self.instance_id, self._tp_rank))
        self._ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)

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
            req = self._requests.get(req_id)
            if req is None:
                req = self._requests[req_id] = _Request(req_id, target)
            elif req.target != target:
                logger.error("request %s changed receiver mid-way (%s -> %s); ignoring batch",
                             req_id, req.target.endpoint, target.endpoint)
                for c in batch.chunks:
                    c.done()
                continue
            req.queue.append(batch)
            self._advance(req)

    # ---- peers -------------------------------------------------------------------------------

    def _peer(self, target: Target) -> _Peer:
        peer = self._peers.get(target)
        if peer is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
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
            self._transport.disconnect(peer.name)

    def _send(self, peer: _Peer, msg: protocol.Message) -> None:
        try:
            peer.sock.send_multipart(self._codec.pack(msg), flags=zmq.DONTWAIT)
        except zmq.Again:
            logger.debug("control queue to %s full; message dropped", peer.target.endpoint)

    def _drain_peer(self, peer: _Peer) -> None:
        while self._peers.get(peer.target) is peer:
            try:
                frames = peer.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = self._codec.unpack(frames)
            except ProtocolError as exc:
                logger.error("bad control message from %s: %s", peer.target.endpoint, exc)
                continue
            self._on_message(peer, msg)

    def _on_message(self, peer: _Peer, msg: protocol.Message) -> None:
        if isinstance(msg, protocol.Welcome):
            self._on_welcome(peer, msg)
        elif isinstance(msg, protocol.Grant):
            self._on_grant(msg)
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
        try:
            peer.name = self._transport.connect(msg.transport, self._cfg.connect_timeout_s)
        except TransportError as exc:
            self._fail_peer(peer, f"transport connect to {peer.target.endpoint} failed: {exc}")
            return
        peer.state = _PeerState.READY
        peer.buffer_addr, peer.slot_bytes = msg.buffer_addr, msg.slot_bytes
        logger.info("connected to receiver %s at %s (%d slots of %d bytes)",
                    msg.receiver_id, peer.target.endpoint, msg.num_slots, msg.slot_bytes)
        waiting, peer.waiting = peer.waiting, []
        for req_id in waiting:
            if req_id in self._requests:
                self._advance(self._requests[req_id])

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
        if not req.alloc_deadline:
            req.alloc_deadline = time.monotonic() + self._cfg.alloc_timeout_s
        self._by_seq[seq] = req.req_id
        self._send(peer, protocol.Alloc(seq, req.req_id, [c.key for c in batch.chunks],
                                        [c.shape for c in batch.chunks], batch.last))

    def _on_grant(self, msg: protocol.Grant) -> None:
        req = self._pop_alloc(msg.seq)
        if req is None:
            return
        batch, req.alloc_batch = req.alloc_batch, None
        req.alloc_deadline = 0.0
        req.retry_delay_s = _RETRY_FIRST_S
        if len(msg.slots) != len(batch.chunks):
            self._fail(req.req_id, f"grant has {len(msg.slots)} slots for {len(batch.chunks)} chunks")
            return
        to_write = [(c, s) for c, s in zip(batch.chunks, msg.slots) if s >= 0]
        for c, s in zip(batch.chunks, msg.slots):
            if s < 0:
                c.done()  # the receiver already holds this chunk (re-sent by a later store)
        req.last_granted = req.last_granted or batch.last
        req.granted_any = req.granted_any or any(s >= 0 for s in msg.slots)
        if to_write:
            self._write(req, to_write)
        if req.req_id in self._requests:  # the write may have failed the request
            self._advance(req)

    def _write(self, req: _Request, pairs: Sequence[tuple[Chunk, int]]) -> None:
        peer = self._peers.get(req.target)
        chunks = [c for c, _ in pairs]
        slots = [s for _, s in pairs]
        if peer is None or not peer.name:
            for c in chunks:
                c.done()
            self._fail(req.req_id, "receiver connection lost before writing")
            return
        notif = protocol.encode(protocol.Written(self.sender_id, req.req_id, slots))
        try:
            handle = self._transport.write(peer.name, [c.tensor for c in chunks],
                                           [peer.buffer_addr + s * peer.slot_bytes for s in slots], notif)
        except TransportError as exc:
            for c in chunks:
                c.done()
            self._fail(req.req_id, f"write to {req.target.endpoint} failed: {exc}")
            return
        req.writes.append((handle, chunks, time.monotonic() + self._cfg.transfer_timeout_s))

    def _progress_writes(self) -> None:
        for req in list(self._requests.values()):
            if not req.writes:
                continue
            still: list[tuple[WriteHandle, list[Chunk], float]] = []
            failed: str | None = None
            for handle, chunks, deadline in req.writes:
                try:
                    done = self._transport.poll(handle)
                except TransportError as exc:
                    done, failed = True, f"write to {req.target.endpoint} failed: {exc}"
                if not done and time.monotonic() > deadline:
                    self._transport.abort(handle)
                    done, failed = True, (f"write of {handle.nbytes} bytes to {req.target.endpoint} not done "
                                          f"after {self._cfg.transfer_timeout_s:.1f}s (p2p.transfer_timeout_s)")
                if done:
                    for c in chunks:
                        c.done()
                    req.nbytes += handle.nbytes
                else:
                    still.append((handle, chunks, deadline))
            req.writes = still
            if failed:
                self._fail(req.req_id, failed)
            elif not still:
                self._advance(req)

    def _on_refused(self, peer: _Peer, msg: protocol.Refused) -> None:
        req = self._requests.get(self._by_seq.get(msg.seq, ""))
        if req is None:
            return
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
            self._advance(req)

    def _pop_alloc(self, seq: int) -> _Request | None:
        req_id = self._by_seq.pop(seq, None)
        req = self._requests.get(req_id) if req_id else None
        if req is None or req.alloc_seq != seq:
            return None
        req.alloc_seq = None
        return req

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for peer in list(self._peers.values()):
            if peer.state is _PeerState.GREETING and now > peer.deadline:
                self._fail_peer(peer, f"receiver {peer.target.endpoint} did not answer Hello within "
                                      f"{self._cfg.connect_timeout_s:.1f}s (p2p.connect_timeout_s)")
        for req in list(self._requests.values()):
            if req.retry_at is not None and now >= req.retry_at:
                req.retry_at = None
                batch, req.alloc_batch = req.alloc_batch, None
                peer = self._peers.get(req.target)
                if peer is None or peer.state is not _PeerState.READY:
                    req.queue.appendleft(batch)
                    self._advance(req)
                else:
                    self._send_alloc(peer, req, batch)
            elif req.alloc_seq is not None and now > req.alloc_deadline:
                peer = self._peers.get(req.target)
                reason = (f"receiver {req.target.endpoint} did not answer an allocation within "
                          f"{self._cfg.alloc_timeout_s:.1f}s (p2p.alloc_timeout_s)")
                if peer is not None:
                    self._fail_peer(peer, reason)  # a silent receiver is dropped; next request greets again
                else:
                    self._fail(req.req_id, reason)

    def _finish(self, req: _Request) -> None:
        del self._requests[req.req_id]
        self._done += 1
        self._bytes += req.nbytes
        logger.debug("request %s: %d bytes sent in %.1f ms", req.req_id, req.nbytes,
                     (time.monotonic() - req.started) * 1000)

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
            for c in chunks:
                c.done()
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


__all__ = ["Chunk", "P2PError", "SendService", "SendStats", "Target"]
