"""The receiver's service: grants slots to senders, tracks what landed, reports to the proxy.

One named thread owns the control socket (ZMQ ROUTER on ``p2p.host:control_port``), drains the
transport's notifications, expires leases and heartbeats. The engine's threads only call
``count_ready`` / ``take`` / ``release`` (under a lock); they never touch a socket.

Per request: ``Alloc`` batches arrive in order; each new chunk gets a RESERVED slot (re-sent
chunks get -1), a ``Written`` notification turns slots READY, and once the last batch was
announced and every granted slot is READY the request's KV is ready (KvReady to the proxy).
A refused, cancelled, expired or abandoned request frees its slots and reports KvFailed.

The buffer cache (``p2p.buffer_cache``, on by default): a chunk the engine loaded stays in its
slot as CACHED (see ``buffer/pool.py``). An Alloc key that is CACHED is granted -1 (the sender
skips it) and pinned for the request until the decoder's LMCache lookup (which turns it into a
lookup pin, dropped by LMCache's ``unpin`` after its retrieve), the request's failure, or
``p2p.ready_lease_s``. Lookups and retrieves serve a key from a request's own READY chunk first,
else from the cache (a read reference: never evicted while the engine holds it). KvReady reports
what was moved (``chunks``/``nbytes``) and what was reused (``chunks_held``/``bytes_held``).

Integrity (a wrong answer is worse than a slow one):
  * a sender whose KV :class:`~lmcache_p2p.protocol.Fingerprint` differs from ours is refused at
    Hello (nothing is reserved for it); so a chunk key (the chunk hash) names the same KV on both
    sides, and the wire keeps the bare hash;
  * a slot is granted to one request of one sender (its *writer*: the sender's transport name and
    the request id). A slot given up before its bytes landed is QUARANTINED by the pool until that
    writer's Written arrives or the write window (``p2p.transfer_timeout_s`` +
    ``p2p.quarantine_margin_s`` after the grant) passes; it is never granted meanwhile;
  * a Written counts only from the transport peer and sender that own the request, and only for
    slots granted to that request; anything else is ignored and counted;
  * two-sided transports (NCCL) ask :meth:`ReceiveService.admit_write` before receiving: a write
    must target exactly the slots its Written names, all granted to that writer;
  * a sender that says Goodbye, is replaced, or stays silent for ``p2p.sender_idle_timeout_s``
    is forgotten and its transport pair torn down (off the control thread).
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
from lmcache_p2p.errors import BufferFull, ClosedError, P2PError, ProtocolError, VersionError
from lmcache_p2p.transport import Transport

logger = logging.getLogger(__name__)

_POLL_MS = 5
_EXPIRE_EVERY_S = 0.05
_SPIN_AFTER_ACTIVITY_S = 1.0  # spin-poll this long after a grant or a landed write, not for a dead sender
_IDLE_CHECK_EVERY_S = 1.0


@dataclasses.dataclass
class Counters:
    """What the receiver refused or ignored, for tests, logs and (later) metrics."""

    hello_refused_fingerprint: int = 0
    written_ignored: int = 0  # Writtens ignored whole: their peer or sender does not own the request
    written_slots_ignored: int = 0  # slots of any Written left unchanged: not granted to that request or peer
    writes_refused: int = 0  # transport writes (NCCL doorbells) refused before receiving
    slots_quarantined: int = 0  # RESERVED slots given up while a write could still land
    slots_confirmed: int = 0  # quarantined slots freed by their writer's Written
    senders_torn_down: int = 0
    chunks_held: int = 0  # Alloc chunks granted -1 because the buffer cache held them
    bytes_held: int = 0
    chunks_loaded_from_cache: int = 0  # retrieves served by a CACHED slot
    bytes_received: int = 0  # bytes landed for requests (moved over the transport)


@dataclasses.dataclass
class _Sender:
    """A sender after its Hello: who it is, the transport peer its writes come from, when last heard."""

    sender_id: str
    writer: str  # its TransportInfo.name: the peer of its transport notifications and pair
    last_seen: float


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A READY chunk: where it is and what LMCache needs to rebuild its MemoryObj."""

    req_id: str  # "" for a chunk read from the cache
    slot: int
    shape: protocol.ChunkShape
    cached: bool = False  # read from the cache (a read reference), not a request's own slot


_LOOKUP = "lookup"  # the pin holder of LMCache's lookups (pin ... unpin around a retrieve)


def _claimed_name(identity: bytes) -> str:
    """The sender id a peer's ZMQ identity claims (``sender_id@suffix``): whom to answer a frame we
    could not authenticate (unverified: the reply carries nothing but the refusal)."""
    return identity.split(b"@", 1)[0].decode("utf-8", errors="replace")


def _dec(counts: dict[str, int], key: str) -> None:
    """One less of ``key`` (forgotten at 0)."""
    if counts[key] <= 1:
        del counts[key]
    else:
        counts[key] -= 1


@dataclasses.dataclass
class _Request:
    req_id: str
    sender_id: str
    writer: str  # the sender's transport peer name
    keys: dict[str, int] = dataclasses.field(default_factory=dict)  # key -> slot
    shapes: dict[int, tuple[str, protocol.ChunkShape]] = dataclasses.field(default_factory=dict)  # slot -> key
    ready: set[str] = dataclasses.field(default_factory=set)  # keys landed (by key: a slot of ours that the
    # engine loaded for another request and that was evicted may be granted to us again for another key)
    held: dict[str, int] = dataclasses.field(default_factory=dict)  # key -> CACHED slot pinned for it
    last: bool = False
    reported: bool = False
    nbytes: int = 0
    held_bytes: int = 0


class ReceiveService:
    """Slot grants, arrival tracking and reporting for one TP rank of a decoder."""

    def __init__(self, cfg: P2PConfig, *, tp_rank: int, tp_size: int, transport: Transport, pool: SlotPool,
                 slot_bytes: int, region_addr: int, chunk_tokens: int, dtype: str,
                 fingerprint: protocol.Fingerprint | None = None) -> None:
        self._cfg = cfg
        self._tp_rank = tp_rank
        self._tp_size = tp_size
        self._transport = transport
        self._pool = pool
        self._slot_bytes = slot_bytes
        self._region_addr = region_addr
        self._chunk_tokens = chunk_tokens
        self._dtype = dtype
        self._fingerprint = fingerprint  # None: accept any sender (tests that move raw bytes)
        # Quarantine and cache policy are ours: a pool built without them (tests) gets them before any grant.
        pool.write_window_s = max(pool.write_window_s, cfg.write_window_s)
        pool.cache = cfg.buffer_cache
        self._slot_meta: dict[int, tuple[str, protocol.ChunkShape]] = {}  # slot -> what its last grant holds
        self._lookup_pins: dict[str, int] = {}  # key -> lookup pins we placed on its cached slot
        # key -> hits counted by pinning lookups whose unpin has not come (LMCache unpins every key its
        # lookup counted, READY or cached): a lookup pin stays while more claims than pins remain.
        self._lookup_claims: dict[str, int] = {}
        # Reported requests with nothing of their own left, whose Grant pins a Cancel must still drop.
        self._pinning: dict[str, tuple[list[int], float]] = {}  # req_id -> (held slots, until)
        self.counters = Counters()
        self._warned: set[tuple[str, str]] = set()  # (what, peer) already logged
        self._teardowns: list[threading.Thread] = []
        self.instance_id = cfg.default_instance_id()
        self.receiver_id = f"{self.instance_id}/r{tp_rank}/{uuid.uuid4().hex[:8]}"
        port = cfg.control_port(tp_rank)
        # The names a Hello or the proxy's Cancel may address us by: the control address peers dial.
        self.control_addresses = frozenset({f"{cfg.advertised_host()}:{port}", f"{cfg.host}:{port}"})
        self._codec = protocol.Codec(cfg.shared_secret, identity=self.receiver_id, window_s=cfg.auth_window_s,
                                     names=[self.receiver_id, *self.control_addresses])
        self._rejections = protocol.RejectionLog(logger, "receiver control port")
        self._lock = threading.Lock()
        self._requests: dict[str, _Request] = {}
        self._index: dict[str, deque[Chunk]] = {}  # READY chunks by key, oldest first
        self._senders: dict[bytes, _Sender] = {}  # ZMQ identity -> sender (after Hello)
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
        transport.set_write_guard(self.admit_write)
        self._thread = threading.Thread(target=self._run, name=f"p2p-receiver-{tp_rank}", daemon=True)
        self._thread.start()

    # ---- engine-facing (any thread) ----------------------------------------------------------

    def count_ready(self, keys: list[str], refresh_lease: bool = False, pin: bool = False) -> int:
        """How many of ``keys``, as a prefix, have a READY chunk (a request's own, or cached).

        ``pin`` (LMCache's lookup): each cached hit gets a lookup pin until :meth:`unpin`, and one
        pin a Grant placed on it (the request this lookup serves) is dropped.
        """
        with self._lock:
            hits = 0
            for key in keys:
                if self._index.get(key):
                    hits += 1
                    if pin:
                        self._lookup_claims[key] = self._lookup_claims.get(key, 0) + 1
                    continue
                slot = self._pool.cached_slot(key)
                if slot is None:
                    break
                hits += 1
                if pin:
                    self._lookup_claims[key] = self._lookup_claims.get(key, 0) + 1
                    self._pool.pin(key, _LOOKUP, self._cfg.ready_lease_s)
                    self._pool.unpin(slot, not_holder=_LOOKUP)
                    self._lookup_pins[key] = self._lookup_pins.get(key, 0) + 1
        return hits

    def unpin(self, key: str) -> None:
        """LMCache released one lookup's claim on ``key`` (after its retrieve). Lookup pins are
        dropped only down to the claims still open: the unpin of a lookup that counted ``key`` as a
        READY chunk (no pin) never drops the pin of a later lookup that found it cached."""
        with self._lock:
            claims = self._lookup_claims.get(key, 0)
            if not claims:
                return
            _dec(self._lookup_claims, key)
            pins = self._lookup_pins.get(key, 0)
            if pins <= claims - 1:
                return
            _dec(self._lookup_pins, key)
            slot = self._pool.cached_slot(key)
            if slot is not None:
                self._pool.unpin(slot, _LOOKUP)

    def take(self, key: str) -> Chunk | None:
        """Hand one READY chunk of ``key`` to the engine: a request's own (READY -> LOADING) first,
        else the cached one (a read reference); None if there is none."""
        with self._lock:
            queue = self._index.get(key)
            while queue:
                chunk = queue.popleft()
                if not queue:
                    del self._index[key]
                if self._pool.acquire(chunk.slot, chunk.req_id):
                    return chunk
            slot = self._pool.read(key)
            if slot is None:
                return None
            self.counters.chunks_loaded_from_cache += 1
            return Chunk("", slot, self._slot_meta[slot][1], cached=True)

    def release(self, chunk: Chunk) -> None:
        """The engine dropped its reference: the slot is cached (or FREE) again."""
        if chunk.cached:
            self._pool.unread(chunk.slot)
            return
        self._pool.release([chunk.slot])
        with self._lock:
            req = self._requests.get(chunk.req_id)
            if req is not None and req.reported and not self._pool.slots_of(req.req_id):
                del self._requests[req.req_id]

    def slot_addr(self, slot: int) -> int:
        return self._region_addr + slot * self._slot_bytes

    @property
    def free_slots(self) -> int:
        """Slots a reservation can get now (FREE plus evictable cached ones): the announced credit."""
        return self._pool.free_slots

    @property
    def cached_slots(self) -> int:
        return self._pool.cached_slots

    def rejected_frames(self) -> dict[str, int]:
        """Control frames refused so far, by reason (auth, replay, stale, oversized, malformed)."""
        return self._codec.rejected

    # ---- lifecycle ---------------------------------------------------------------------------

    def close(self, timeout_s: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.error("receiver thread did not stop within %.1fs", timeout_s)
        for thread in list(self._teardowns):  # pair teardowns in flight (each bounded by the transport)
            thread.join(max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        next_expire = next_idle_check = 0.0
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
                if now >= next_idle_check:
                    self._forget_idle_senders(now)
                    next_idle_check = now + _IDLE_CHECK_EVERY_S
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
            sender = self._senders.get(identity)
            try:
                env = self._codec.open(body)
            except ProtocolError as exc:  # counted by the codec (rejected_frames)
                self._rejections.log(protocol.rejection_of(exc), f"from {identity!r}: {exc}")
                to = sender.sender_id if sender is not None else _claimed_name(identity)
                self._reply(identity, protocol.ErrorReply(seq=-1, message=str(exc)), to)
                continue
            refusal = self._envelope_refusal(env, sender)
            if refusal is not None:
                reason, why = refusal
                self._codec.count_rejected(reason)
                self._rejections.log(reason, f"from {identity!r}: {why}")
                self._reply(identity, protocol.ErrorReply(seq=getattr(env.msg, "seq", -1), message=why), env.sender)
                continue
            if sender is not None:
                sender.last_seen = time.monotonic()
            reply = self._handle(identity, env.msg)
            if reply is not None:
                self._reply(identity, reply, env.sender)

    def _envelope_refusal(self, env: protocol.Envelope, sender: _Sender | None) -> tuple[protocol.Rejection, str] | None:
        """Under a shared secret: is the frame's signer the sender it speaks for, and was it addressed
        to us in this conversation? A Hello names our control address (the sender has no id of ours
        yet) and its signer must be its ``sender_id``; a registered sender's later frames name our
        ``receiver_id`` (a frame captured for another receiver, or an earlier incarnation of us, never
        does) and are signed by the sender that said Hello on this connection."""
        if not self._codec.authenticated:
            return None
        msg = env.msg
        if isinstance(msg, protocol.Hello):
            if env.sender != msg.sender_id:
                return protocol.Rejection.SPOOFED, (f"Hello speaks for sender {msg.sender_id!r} but is signed by "
                                                    f"{env.sender!r}: a peer may say Hello only as itself")
            if env.recipient not in self.control_addresses:
                return protocol.Rejection.MISADDRESSED, (
                    f"Hello is addressed to {env.recipient!r}, not to this receiver's control address "
                    f"({', '.join(sorted(self.control_addresses))}): replayed from another receiver, or the sender "
                    "dials an address this receiver does not advertise (p2p.advertise_host)")
            return None
        if sender is not None:
            if env.sender != sender.sender_id:
                return protocol.Rejection.SPOOFED, (f"{type(msg).__name__} on the connection of sender "
                                                    f"{sender.sender_id!r} is signed by {env.sender!r}")
            if env.recipient != self.receiver_id:
                return protocol.Rejection.MISADDRESSED, (
                    f"{type(msg).__name__} is addressed to {env.recipient!r}, not to this receiver "
                    f"({self.receiver_id!r}): replayed from another receiver or an earlier incarnation")
        return None

    def _reply(self, identity: bytes, msg: protocol.Message, to: str) -> None:
        try:
            self._sock.send_multipart([identity, *self._codec.pack(msg, to)], flags=zmq.DONTWAIT)
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
        mismatch = self._fingerprint_mismatch(msg.fingerprint)
        if mismatch:
            self.counters.hello_refused_fingerprint += 1
            self._warn_once("fingerprint", msg.sender_id, "refused sender %s (rank %d): %s",
                            msg.sender_id, msg.tp_rank, mismatch)
            return protocol.ErrorReply(seq=-1, message=mismatch)
        self._register_sender(identity, _Sender(msg.sender_id, msg.transport.name, time.monotonic()))
        self._transport.accept(msg.transport)
        logger.info("sender %s connected (rank %d)", msg.sender_id, msg.tp_rank)
        return protocol.Welcome(
            version=protocol.PROTOCOL_VERSION, receiver_id=self.receiver_id, buffer_addr=self._region_addr,
            slot_bytes=self._slot_bytes,
            num_slots=self._pool.num_slots, transport=self._transport.info(),
            transfer_timeout_s=self._cfg.transfer_timeout_s,
        )

    def _fingerprint_mismatch(self, theirs: protocol.Fingerprint | None) -> str:
        """Why a sender's KV cannot be loaded here ("" when it can)."""
        ours = self._fingerprint
        if ours is None:
            return ""
        if theirs is None:
            return (f"KV fingerprint mismatch: the sender sent none, this decoder serves {ours}; "
                    "a decoder loads KV only from a prefiller of the same model and layout")
        fields = ours.differing_fields(theirs)
        if not fields:
            return ""
        sides = "; ".join(f"{name}: decoder {getattr(ours, name)!r}, prefiller {getattr(theirs, name)!r}"
                          for name in fields)
        return (f"KV fingerprint mismatch in {', '.join(fields)} ({sides}): this decoder cannot load that "
                "prefiller's KV; serve the same model (same weights), dtype, chunk_size and tensor-parallel layout on both")

    def _register_sender(self, identity: bytes, sender: _Sender) -> None:
        """Record a Hello. An older incarnation on this identity is gone (its requests fail); another
        identity of the same sender (it reconnected its socket) is simply forgotten."""
        previous = self._senders.get(identity)
        if previous is not None and previous.sender_id != sender.sender_id:
            self._on_sender_gone(identity, "replaced by a new sender incarnation", keep_writer=sender.writer)
        for other, known in list(self._senders.items()):
            if other != identity and known.sender_id == sender.sender_id:
                del self._senders[other]
        self._senders[identity] = sender

    def _on_alloc(self, identity: bytes, msg: protocol.Alloc) -> protocol.Message:
        sender = self._senders.get(identity)
        if sender is None:
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
                return self._refuse(msg, protocol.RefusalCode.FINISHED, "request was cancelled or failed here")
            req = self._requests.get(msg.req_id)
            if req is None:
                req = self._requests[msg.req_id] = _Request(msg.req_id, sender.sender_id, sender.writer)
            elif req.sender_id != sender.sender_id:
                return protocol.ErrorReply(msg.seq, f"request {msg.req_id} belongs to another sender")
            elif req.reported:
                return self._refuse(msg, protocol.RefusalCode.FINISHED, "request already completed or failed")
            held = self._pin_held_locked(req, msg)  # before reserving: never evicted for this very batch
            new = [i for i, key in enumerate(msg.keys) if key not in req.keys and key not in req.held and i not in held]
            total = len(req.keys) + len(new)
            if total > self._pool.num_slots:
                self._unpin_locked(req.req_id, held.values())
                reason = (f"decoder buffer holds {self._pool.num_slots} chunks, request needs at least {total}: "
                          "raise p2p.buffer_size on the decoder")
                refusal = self._refuse(msg, protocol.RefusalCode.TOO_LARGE, reason, needed=total)
                self._fail_locked(req, reason)
                return refusal
            try:
                slots = self._pool.reserve(msg.req_id, len(new), self._cfg.reserve_lease_s,
                                           writer=(req.writer, msg.req_id), keys=[msg.keys[i] for i in new])
            except BufferFull as exc:
                self._unpin_locked(req.req_id, held.values())
                if not req.keys and not req.held:
                    del self._requests[msg.req_id]
                return self._refuse(msg, protocol.RefusalCode.FULL, str(exc), needed=exc.needed_slots)
            self._last_activity = time.monotonic()
            for i, slot in held.items():
                req.held[msg.keys[i]] = slot
                req.held_bytes += msg.shapes[i].nbytes
            self.counters.chunks_held += len(held)
            self.counters.bytes_held += sum(msg.shapes[i].nbytes for i in held)
            granted = [-1] * len(msg.keys)
            for i, slot in zip(new, slots):
                req.keys[msg.keys[i]] = slot
                req.shapes[slot] = (msg.keys[i], msg.shapes[i])
                self._slot_meta[slot] = (msg.keys[i], msg.shapes[i])
                req.nbytes += msg.shapes[i].nbytes
                granted[i] = slot
            req.last = req.last or msg.last
            self._maybe_ready_locked(req)
        return protocol.Grant(seq=msg.seq, req_id=msg.req_id, slots=granted, free_slots=self._pool.free_slots)

    def _pin_held_locked(self, req: _Request, msg: protocol.Alloc) -> dict[int, int]:
        """Pin the cached chunks of this Alloc for ``req`` ({index in the Alloc: slot}); a cached
        chunk of another shape (it cannot be the same KV) is not held."""
        held: dict[int, int] = {}
        if not self._pool.cache:
            return held
        seen = set(req.keys) | set(req.held)
        for i, key in enumerate(msg.keys):
            if key in seen:
                continue
            slot = self._pool.pin(key, req.req_id, self._cfg.ready_lease_s)
            if slot is None:
                continue
            if self._slot_meta.get(slot, ("", None))[1] != msg.shapes[i]:
                self._pool.unpin(slot, req.req_id)
                continue
            held[i] = slot
            seen.add(key)
        return held

    def _unpin_locked(self, req_id: str, slots) -> None:
        for slot in slots:
            self._pool.unpin(slot, req_id)

    def _refuse(self, msg: protocol.Alloc, code: protocol.RefusalCode, reason: str, needed: int = 0) -> protocol.Refused:
        return protocol.Refused(seq=msg.seq, req_id=msg.req_id, code=code, reason=reason, needed_slots=needed,
                                free_slots=self._pool.free_slots, capacity_slots=self._pool.num_slots)

    def _on_sender_gone(self, identity: bytes, why: str, *, keep_writer: str = "") -> None:
        """Forget a sender: fail its unfinished requests and tear its transport pair down
        (unless ``keep_writer``, the transport peer of its replacement, is the same)."""
        sender = self._senders.pop(identity, None)
        if sender is None:
            return
        with self._lock:
            pending = [r for r in self._requests.values() if r.sender_id == sender.sender_id and not r.reported]
            for req in pending:
                self._fail_locked(req, f"sender {sender.sender_id} left before finishing ({why})")
        still_used = sender.writer == keep_writer or any(s.writer == sender.writer for s in self._senders.values())
        if not still_used:
            self._tear_down(sender.writer, why)

    def _tear_down(self, writer: str, why: str) -> None:
        """Disconnect ``writer``'s transport pair in a thread: NCCL joins pair threads (blocking)."""
        self.counters.senders_torn_down += 1
        logger.info("tearing down the transport pair of %s (%s)", writer, why)
        self._teardowns = [t for t in self._teardowns if t.is_alive()]
        thread = threading.Thread(target=self._disconnect, args=(writer,), name=f"p2p-teardown-{self._tp_rank}",
                                  daemon=True)
        self._teardowns.append(thread)
        thread.start()

    def _disconnect(self, writer: str) -> None:
        try:
            self._transport.disconnect(writer)
        except ClosedError:
            pass
        except P2PError as exc:
            logger.warning("could not tear down the transport pair of %s: %s", writer, exc)

    def _forget_idle_senders(self, now: float) -> None:
        limit = self._cfg.sender_idle_timeout_s
        for identity, sender in list(self._senders.items()):
            if now - sender.last_seen > limit:
                self._on_sender_gone(identity, f"silent for more than {limit:.0f}s (p2p.sender_idle_timeout_s)")

    def _warn_once(self, what: str, peer: str, fmt: str, *args: object) -> None:
        if (what, peer) in self._warned:
            logger.debug(fmt, *args)
            return
        self._warned.add((what, peer))
        logger.warning(fmt + " (logged once per peer)", *args)

    # ---- the transport's write guard (called from transport threads) ---------------------------

    def admit_write(self, peer: str, dests: list[tuple[int, int]], notif: bytes) -> str:
        """May ``peer`` write ``dests`` ((address, bytes) each) with notification ``notif``? "" if so.

        Admitted only when the notification is a Written of a request granted to ``peer``, and
        ``dests`` are exactly its slots, each RESERVED (or QUARANTINED) for that request and writer
        and not written before under this grant.
        The slots then stay quarantined, if given up, until this write's receive deadline passed.
        """
        reason = self._write_refusal(peer, dests, notif)
        if reason:
            with self._lock:
                self.counters.writes_refused += 1
        return reason

    def _write_refusal(self, peer: str, dests: list[tuple[int, int]], notif: bytes) -> str:
        try:
            written = protocol.decode(notif)
        except ProtocolError as exc:
            return f"its notification is not a Written: {exc}"
        if not isinstance(written, protocol.Written):
            return f"its notification is a {type(written).__name__}, not a Written"
        slots = []
        for addr, nbytes in dests:
            offset = addr - self._region_addr
            slot, rest = divmod(offset, self._slot_bytes)
            if offset < 0 or rest or not 0 < nbytes <= self._slot_bytes or slot >= self._pool.num_slots:
                return f"destination 0x{addr:x} (+{nbytes} bytes) is not a slot of the receive buffer"
            slots.append(slot)
        if sorted(slots) != sorted(written.slots) or len(set(slots)) != len(slots):
            return f"it writes slots {slots} but its Written names {written.slots}"
        until = self._pool.now() + self._cfg.write_window_s
        refused = self._pool.admit_write((peer, written.req_id), slots, until)
        if refused:
            return (f"slots {refused} are not granted to request {written.req_id} of {peer}, "
                    "or this grant was already written")
        return ""

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
            self._on_written(notif.peer, msg)

    def _on_written(self, peer: str, msg: protocol.Written) -> None:
        """Bytes landed. Counted only from the peer and sender owning the request, for its slots."""
        self._last_activity = now = time.monotonic()
        for sender in self._senders.values():
            if sender.writer == peer:
                sender.last_seen = now
        writer = (peer, msg.req_id)
        with self._lock:
            req = self._requests.get(msg.req_id)
            if req is not None and (req.sender_id, req.writer) != (msg.sender_id, peer):
                self._ignore_written_locked(peer, msg, f"request {msg.req_id} belongs to {req.sender_id} "
                                                       f"via {req.writer}")
                return
            granted = [s for s in msg.slots if req is not None and s in req.shapes]
            foreign = [s for s in msg.slots if s not in granted]
            stale = self._pool.mark_ready(msg.req_id, granted, self._cfg.ready_lease_s, writer=writer)
            # A given-up slot's write completed: nothing more lands in it, it may be granted again.
            confirmed = self._pool.confirm(writer, stale + foreign)
            self.counters.slots_confirmed += len(confirmed)
            unexplained = [s for s in foreign if s not in confirmed]
            if unexplained:
                self._ignore_written_locked(peer, msg, f"slots {unexplained} are not granted to it", unexplained)
            if req is None:
                if not confirmed and not unexplained:
                    logger.debug("write for finished request %s ignored (slots %s)", msg.req_id, msg.slots)
                return
            for slot in granted:
                if slot in stale:
                    continue
                key, shape = req.shapes[slot]
                req.ready.add(key)
                self.counters.bytes_received += shape.nbytes
                self._index.setdefault(key, deque()).append(Chunk(req.req_id, slot, shape))
            self._maybe_ready_locked(req)

    def _ignore_written_locked(self, peer: str, msg: protocol.Written, why: str,
                               slots: list[int] | None = None) -> None:
        if slots is None:
            self.counters.written_ignored += 1
            self._codec.count_rejected(protocol.Rejection.FOREIGN)
        self.counters.written_slots_ignored += len(msg.slots if slots is None else slots)
        self._warn_once("written", peer, "ignored a Written from %s (sender %s, request %s, slots %s): %s",
                        peer, msg.sender_id, msg.req_id, msg.slots, why)

    def _maybe_ready_locked(self, req: _Request) -> None:
        if req.reported or not req.last or len(req.ready) != len(req.keys):
            return
        req.reported = True
        self._announcer.send(protocol.KvReady(req.req_id, self.instance_id, self._tp_rank, len(req.keys), req.nbytes,
                                              chunks_held=len(req.held), bytes_held=req.held_bytes,
                                              bytes_received=req.nbytes))
        # INFO only when the cache saved a transfer (once per request, never per chunk).
        logger.log(logging.INFO if req.held else logging.DEBUG,
                   "request %s: KV ready: %d chunks moved (%d bytes), %d chunks held in the buffer cache (%d bytes)",
                   req.req_id, len(req.keys), req.nbytes, len(req.held), req.held_bytes)
        if not self._pool.slots_of(req.req_id):
            self._requests.pop(req.req_id, None)  # nothing of its own to load (all held): done here
            if req.held:
                self._pinning[req.req_id] = (list(req.held.values()), time.monotonic() + self._cfg.ready_lease_s)

    def _cancel(self, req_id: str, reason: str) -> None:
        """The sender gave up, or the proxy will not decode here: drop the request's KV.

        A cancel may arrive before the request's first Alloc (the proxy cancels as soon as it
        decides); the id is remembered for ``reserve_lease_s`` so a late Alloc is refused.
        """
        with self._lock:
            self._remember_finished_locked(req_id)
            req = self._requests.get(req_id)
            if req is not None:
                self._fail_locked(req, f"cancelled: {reason}", expected=True)
            pinning = self._pinning.pop(req_id, None)
            if pinning is not None:  # KV ready, all of it held: no decode will read it here
                self._pool.unpin_holder(req_id, pinning[0])

    def _remember_finished_locked(self, req_id: str) -> None:
        """Refuse ``req_id``'s later Allocs for ``reserve_lease_s`` (a cancelled or failed request
        is not revived by its next batch: the proxy retries under a fresh id)."""
        now = time.monotonic()
        self._cancelled[req_id] = now + self._cfg.reserve_lease_s
        for old in [r for r, until in self._cancelled.items() if until < now]:
            del self._cancelled[old]

    def _fail_locked(self, req: _Request, reason: str, *, expected: bool = False) -> None:
        """Free every slot of ``req`` that the engine does not hold, and report the failure once.

        Slots whose bytes had not landed are quarantined by the pool, not freed (a write may still land).
        Its later Alloc batches are refused (FINISHED).
        """
        self._remember_finished_locked(req.req_id)
        quarantined = self._pool.quarantined_slots
        self._pool.release_owner(req.req_id)
        self._pool.unpin_holder(req.req_id, req.held.values())
        self.counters.slots_quarantined += max(0, self._pool.quarantined_slots - quarantined)
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
        if self._pinning:
            now = time.monotonic()
            with self._lock:
                for req_id in [r for r, (_, until) in self._pinning.items() if until <= now]:
                    del self._pinning[req_id]  # the pool dropped its pins at the same deadline
        quarantined = self._pool.quarantined_slots
        expired = self._pool.expire()
        self.counters.slots_quarantined += max(0, self._pool.quarantined_slots - quarantined)
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
            fingerprint=self._fingerprint,
        )

    def check_open(self) -> None:
        if self._closed:
            raise ClosedError("receiver is closed")
