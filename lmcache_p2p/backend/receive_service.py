"""The receiver's service: grants slots to senders, tracks what landed, reports to the proxy.

One named thread owns the control socket (ZMQ ROUTER on ``p2p.host:control_port``), drains the
transport's notifications, expires leases and heartbeats. The engine's threads only call
``count_ready`` / ``take`` / ``release`` (under a lock); they never touch a socket.

Per request: ``Alloc`` batches arrive in order; each new chunk gets a RESERVED slot (re-sent
chunks get -1), a ``Written`` notification turns slots READY, and once the last batch was
announced and every granted slot is READY the request's KV is ready (KvReady to the proxy).
A refused, cancelled, expired or abandoned request frees its slots and reports KvFailed.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections import deque

import zmq

from lmcache_p2p import protocol
from lmcache_p2p.backend.announcer import Announcer
from lmcache_p2p.buffer import SlotPool
from lmcache_p2p.config import P2PConfig
from lmcache_p2p.errors import BufferFull, ClosedError, ProtocolError, VersionError
from lmcache_p2p.transport import Transport

logger = logging.getLogger(__name__)

_POLL_MS = 5
_EXPIRE_EVERY_S = 0.05
_SPIN_AFTER_ACTIVITY_S = 1.0  # spin-poll this long after a grant or a landed write, not for a dead sender


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A READY chunk: where it is and what LMCache needs to rebuild its MemoryObj."""

    req_id: str
    slot: int
    shape: protocol.ChunkShape


@dataclasses.dataclass
class _Request:
    req_id: str
    sender_id: str
    keys: dict[str, int] = dataclasses.field(default_factory=dict)  # key -> slot
    shapes: dict[int, tuple[str, protocol.ChunkShape]] = dataclasses.field(default_factory=dict)  # slot -> key
    ready: set[int] = dataclasses.field(default_factory=set)
    last: bool = False
    reported: bool = False
    nbytes: int = 0


class ReceiveService:
    """Slot grants, arrival tracking and reporting for one TP rank of a decoder."""

    def __init__(self, cfg: P2PConfig, *, tp_rank: int, tp_size: int, transport: Transport, pool: SlotPool,
                 slot_bytes: int, region_addr: int, chunk_tokens: int, dtype: str) -> None:
        self._cfg = cfg
        self._tp_rank = tp_rank
        self._tp_size = tp_size
        self._transport = transport
        self._pool = pool
        self._slot_bytes = slot_bytes
        self._region_addr = region_addr
        self._chunk_tokens = chunk_tokens
        self._dtype = dtype
        self.instance_id = cfg.default_instance_id()
        self.receiver_id = f"{self.instance_id}/r{tp_rank}/{uuid.uuid4().hex[:8]}"
        self._codec = protocol.Codec(cfg.shared_secret, identity=self.receiver_id, window_s=cfg.auth_window_s)
        self._rejections = protocol.RejectionLog(logger, "receiver control port")
        self._lock = threading.Lock()
        self._requests: dict[str, _Request] = {}
        self._index: dict[str, deque[Chunk]] = {}  # READY chunks by key, oldest first
        self._senders: dict[bytes, str] = {}  # ZMQ identity -> sender_id (after Hello)
        self._by_transport: dict[str, str] = {}  # transport peer name -> sender_id (after Hello)
        self._cancelled: dict[str, float] = {}  # req_id -> until when a late Alloc is refused
        self._stop = threading.Event()
        self._closed = False
        self._last_activity = 0.0
        self.control_endpoint = f"tcp://{cfg.host}:{cfg.control_port(tp_rank)}"
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted sender with the same identity takes over
        try:
            self._sock.bind(self.control_endpoint)
        except zmq.ZMQError as exc:
            self._sock.close()
            self._ctx.term()
            raise ProtocolError(f"cannot listen on {self.control_endpoint} (p2p.host / p2p.control_ports): {exc}") from exc
        self._announcer = Announcer(cfg.proxy_url, self._codec, cfg.heartbeat_interval_s)
        self._thread = threading.Thread(target=self._run, name=f"p2p-receiver-{tp_rank}", daemon=True)
        self._thread.start()

    # ---- engine-facing (any thread) ----------------------------------------------------------

    def count_ready(self, keys: list[str], refresh_lease: bool = False) -> int:
        """How many of ``keys``, as a prefix, have a READY chunk."""
        with self._lock:
            hits = 0
            for key in keys:
                if not self._index.get(key):
                    break
                hits += 1
        return hits

    def take(self, key: str) -> Chunk | None:
        """Hand one READY chunk of ``key`` to the engine (READY -> LOADING); None if there is none."""
        with self._lock:
            queue = self._index.get(key)
            while queue:
                chunk = queue.popleft()
                if not queue:
                    del self._index[key]
                if self._pool.acquire(chunk.slot, chunk.req_id):
                    return chunk
        return None

    def release(self, chunk: Chunk) -> None:
        """The engine dropped its reference: the slot is FREE again."""
        self._pool.release([chunk.slot])
        with self._lock:
            req = self._requests.get(chunk.req_id)
            if req is not None and req.reported and not self._pool.slots_of(req.req_id):
                del self._requests[req.req_id]

    def slot_addr(self, slot: int) -> int:
        return self._region_addr + slot * self._slot_bytes

    @property
    def free_slots(self) -> int:
        return self._pool.free_slots

    def rejected_frames(self) -> dict[str, int]:
        """Control frames refused so far, by reason (auth, replay, stale, oversized, malformed)."""
        return self._codec.rejected

    # ---- lifecycle ---------------------------------------------------------------------------

    def close(self, timeout_s: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.error("receiver thread did not stop within %.1fs", timeout_s)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        next_expire = 0.0
        try:
            while not self._stop.is_set():
                # While granted slots await their bytes, poll without sleeping: with NIXL's progress
                # thread off, UCX tcp moves a receiver's bytes only while it polls notifications.
                expecting = (self._pool.reserved_slots > 0
                             and time.monotonic() - self._last_activity < _SPIN_AFTER_ACTIVITY_S)
                events = dict(poller.poll(0 if expecting else _POLL_MS))
                if expecting and not events:
                    time.sleep(0)
                if self._sock in events:
                    self._drain_socket()
                self._drain_notifications()
                now = time.monotonic()
                if now >= next_expire:
                    self._expire()
                    next_expire = now + _EXPIRE_EVERY_S
                if self._announcer.heartbeat_due():
                    self._announcer.heartbeat(self._announce())
        except Exception:
            logger.exception("receiver service thread crashed; the decoder will recompute from now on")
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        self._announcer.close(protocol.Goodbye(self.instance_id, self._tp_rank))
        self._sock.close()
        self._ctx.term()

    # ---- control messages --------------------------------------------------------------------

    def _drain_socket(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, body = frames[0], frames[1:]
            try:
                msg = self._codec.unpack(body)
            except ProtocolError as exc:  # counted by the codec (rejected_frames)
                self._rejections.log(protocol.rejection_of(exc), f"from {identity!r}: {exc}")
                self._reply(identity, protocol.ErrorReply(seq=-1, message=str(exc)))
                continue
            reply = self._handle(identity, msg)
            if reply is not None:
                self._reply(identity, reply)

    def _reply(self, identity: bytes, msg: protocol.Message) -> None:
        try:
            self._sock.send_multipart([identity, *self._codec.pack(msg)], flags=zmq.DONTWAIT)
        except zmq.Again:
            logger.warning("could not reply to %r (peer gone?)", identity)

    def _handle(self, identity: bytes, msg: protocol.Message) -> protocol.Message | None:
        if isinstance(msg, protocol.Hello):
            return self._on_hello(identity, msg)
        if isinstance(msg, protocol.Alloc):
            return self._on_alloc(identity, msg)
        if isinstance(msg, protocol.Cancel):
            self._cancel(msg.req_id, msg.reason)
            return protocol.Ack(msg.seq)
        if isinstance(msg, protocol.Goodbye):
            self._on_sender_gone(identity, "sender said goodbye")
            return None
        return protocol.ErrorReply(seq=getattr(msg, "seq", -1), message=f"unexpected message {type(msg).__name__}")

    def _on_hello(self, identity: bytes, msg: protocol.Hello) -> protocol.Message:
        if msg.version != protocol.PROTOCOL_VERSION:
            err = VersionError(f"sender speaks protocol {msg.version}, this receiver {protocol.PROTOCOL_VERSION}")
            logger.error("refused sender %s: %s", msg.sender_id, err)
            return protocol.ErrorReply(seq=-1, message=str(err))
        if msg.transport.kind != self._transport.kind:
            return protocol.ErrorReply(seq=-1, message=(
                f"sender uses transport {msg.transport.kind}, this receiver {self._transport.kind} (p2p.transport)"))
        previous = self._senders.get(identity)
        if previous is not None and previous != msg.sender_id:
            self._on_sender_gone(identity, "replaced by a new sender incarnation")
        self._senders[identity] = msg.sender_id
        self._by_transport[msg.transport.name] = msg.sender_id
        self._transport.accept(msg.transport)
        logger.info("sender %s connected (rank %d)", msg.sender_id, msg.tp_rank)
        return protocol.Welcome(
            version=protocol.PROTOCOL_VERSION, receiver_id=self.receiver_id, buffer_addr=self._region_addr,
            slot_bytes=self._slot_bytes,
            num_slots=self._pool.num_slots, transport=self._transport.info(),
        )

    def _on_alloc(self, identity: bytes, msg: protocol.Alloc) -> protocol.Message:
        sender_id = self._senders.get(identity)
        if sender_id is None:
            return self._refuse(msg, protocol.RefusalCode.UNKNOWN_PEER, "say Hello first (receiver restarted?)")
        if self._stop.is_set():
            return self._refuse(msg, protocol.RefusalCode.CLOSED, "receiver is shutting down")
        if len(msg.keys) != len(msg.shapes):
            return protocol.ErrorReply(msg.seq, f"alloc has {len(msg.keys)} keys but {len(msg.shapes)} shapes")
        for shape in msg.shapes:
            if shape.nbytes > self._slot_bytes:
                return self._refuse(msg, protocol.RefusalCode.TOO_LARGE, (
                    f"chunk of {shape.nbytes} bytes exceeds the slot size {self._slot_bytes} "
                    "(sender and receiver must serve the same model and chunk_size)"))
            if shape.dtype != self._dtype:
                return self._refuse(msg, protocol.RefusalCode.TOO_LARGE, (
                    f"chunk dtype {shape.dtype} differs from this decoder's KV dtype {self._dtype}"))
        with self._lock:
            if msg.req_id in self._cancelled:
                return self._refuse(msg, protocol.RefusalCode.FINISHED, "request was cancelled")
            req = self._requests.get(msg.req_id)
            if req is None:
                req = self._requests[msg.req_id] = _Request(msg.req_id, sender_id)
            elif req.reported:
                return self._refuse(msg, protocol.RefusalCode.FINISHED, "request already completed or failed")
            new = [i for i, key in enumerate(msg.keys) if key not in req.keys]
            total = len(req.keys) + len(new)
            if total > self._pool.num_slots:
                reason = (f"decoder buffer holds {self._pool.num_slots} chunks, request needs at least {total}: "
                          "raise p2p.buffer_size on the decoder")
                refusal = self._refuse(msg, protocol.RefusalCode.TOO_LARGE, reason, needed=total)
                self._fail_locked(req, reason)
                return refusal
            try:
                slots = self._pool.reserve(msg.req_id, len(new), self._cfg.reserve_lease_s)
            except BufferFull as exc:
                if not req.keys:
                    del self._requests[msg.req_id]
                return self._refuse(msg, protocol.RefusalCode.FULL, str(exc), needed=exc.needed_slots)
            self._last_activity = time.monotonic()
            granted = [-1] * len(msg.keys)
            for i, slot in zip(new, slots):
                req.keys[msg.keys[i]] = slot
                req.shapes[slot] = (msg.keys[i], msg.shapes[i])
                req.nbytes += msg.shapes[i].nbytes
                granted[i] = slot
            req.last = req.last or msg.last
            self._maybe_ready_locked(req)
        return protocol.Grant(seq=msg.seq, req_id=msg.req_id, slots=granted, free_slots=self._pool.free_slots)

    def _refuse(self, msg: protocol.Alloc, code: protocol.RefusalCode, reason: str, needed: int = 0) -> protocol.Refused:
        return protocol.Refused(seq=msg.seq, req_id=msg.req_id, code=code, reason=reason, needed_slots=needed,
                                free_slots=self._pool.free_slots, capacity_slots=self._pool.num_slots)

    def _on_sender_gone(self, identity: bytes, why: str) -> None:
        sender_id = self._senders.pop(identity, None)
        if sender_id is None:
            return
        self._by_transport = {name: sid for name, sid in self._by_transport.items() if sid != sender_id}
        with self._lock:
            pending = [r for r in self._requests.values() if r.sender_id == sender_id and not r.reported]
            for req in pending:
                self._fail_locked(req, f"sender {sender_id} left before finishing ({why})")

    # ---- arrivals, expiry, completion ---------------------------------------------------------

    def _drain_notifications(self) -> None:
        for notif in self._transport.get_notifications():
            try:
                msg = protocol.decode(notif.payload)
            except ProtocolError as exc:
                logger.warning("dropped a transfer notification from %s: %s", notif.peer, exc)
                continue
            if not isinstance(msg, protocol.Written):
                logger.warning("unexpected notification %s from %s", type(msg).__name__, notif.peer)
                continue
            if self._by_transport.get(notif.peer) != msg.sender_id:
                self._codec.count_rejected(protocol.Rejection.FOREIGN)
                self._rejections.log(protocol.Rejection.FOREIGN, (
                    f"write notification from transport peer {notif.peer} claims sender {msg.sender_id}, which that "
                    f"peer did not greet as (request {msg.req_id}, slots {msg.slots})"))
                continue
            self._on_written(msg)

    def _on_written(self, msg: protocol.Written) -> None:
        self._last_activity = time.monotonic()
        with self._lock:
            owner = self._requests.get(msg.req_id)
            if owner is not None and owner.sender_id != msg.sender_id:
                self._codec.count_rejected(protocol.Rejection.FOREIGN)
                self._rejections.log(protocol.Rejection.FOREIGN, (
                    f"sender {msg.sender_id} reported writing slots {msg.slots} of request {msg.req_id}, which "
                    f"belongs to sender {owner.sender_id}: ignored"))
                return
        stale = self._pool.mark_ready(msg.req_id, msg.slots, self._cfg.ready_lease_s)
        with self._lock:
            req = self._requests.get(msg.req_id)
            if req is None:
                logger.warning("write for unknown or finished request %s ignored (slots %s)", msg.req_id, msg.slots)
                return
            for slot in msg.slots:
                if slot in stale or slot not in req.shapes:
                    continue
                key, shape = req.shapes[slot]
                req.ready.add(slot)
                self._index.setdefault(key, deque()).append(Chunk(req.req_id, slot, shape))
            self._maybe_ready_locked(req)

    def _maybe_ready_locked(self, req: _Request) -> None:
        if req.reported or not req.last or len(req.ready) != len(req.keys):
            return
        req.reported = True
        self._announcer.send(protocol.KvReady(req.req_id, self.instance_id, self._tp_rank, len(req.keys), req.nbytes))
        logger.debug("request %s: KV ready (%d chunks, %d bytes)", req.req_id, len(req.keys), req.nbytes)

    def _cancel(self, req_id: str, reason: str) -> None:
        """The sender gave up, or the proxy will not decode here: drop the request's KV.

        A cancel may arrive before the request's first Alloc (the proxy cancels as soon as it
        decides); the id is remembered for ``reserve_lease_s`` so a late Alloc is refused.
        """
        now = time.monotonic()
        with self._lock:
            self._cancelled[req_id] = now + self._cfg.reserve_lease_s
            for old in [r for r, until in self._cancelled.items() if until < now]:
                del self._cancelled[old]
            req = self._requests.get(req_id)
            if req is not None:
                self._fail_locked(req, f"cancelled: {reason}", expected=True)

    def _fail_locked(self, req: _Request, reason: str, *, expected: bool = False) -> None:
        """Free every slot of ``req`` that the engine does not hold, and report the failure once."""
        self._pool.release_owner(req.req_id)
        self._unindex_locked(req, set(req.shapes))
        if not req.reported:
            req.reported = True
            logger.log(logging.INFO if expected else logging.ERROR, "request %s from %s dropped: %s",
                       req.req_id, req.sender_id, reason)
            self._announcer.send(protocol.KvFailed(req.req_id, self.instance_id, self._tp_rank, reason))
        if not self._pool.slots_of(req.req_id):
            self._requests.pop(req.req_id, None)

    def _unindex_locked(self, req: _Request, slots: set[int]) -> None:
        for slot in slots:
            key, _ = req.shapes[slot]
            queue = self._index.get(key)
            if queue:
                remaining = deque(c for c in queue if not (c.req_id == req.req_id and c.slot == slot))
                if remaining:
                    self._index[key] = remaining
                else:
                    del self._index[key]

    def _expire(self) -> None:
        expired = self._pool.expire()
        if not expired:
            return
        with self._lock:
            for req_id, slots in expired.items():
                req = self._requests.get(req_id)
                if req is None:
                    continue
                self._unindex_locked(req, set(slots))
                self._fail_locked(req, f"lease expired on {len(slots)} slot(s) (p2p.reserve_lease_s / ready_lease_s)")

    def _announce(self) -> protocol.Announce:
        return protocol.Announce(
            version=protocol.PROTOCOL_VERSION, instance_id=self.instance_id, role="receiver",
            http_url=self._cfg.http_url or "", tp_rank=self._tp_rank, tp_size=self._tp_size,
            control_host=self._cfg.advertised_host(), control_port=self._cfg.control_port(self._tp_rank),
            transport_port=self._cfg.transport_port(self._tp_rank), capacity_slots=self._pool.num_slots,
            free_slots=self._pool.free_slots, slot_bytes=self._slot_bytes, chunk_tokens=self._chunk_tokens,
        )

    def check_open(self) -> None:
        if self._closed:
            raise ClosedError("receiver is closed")
