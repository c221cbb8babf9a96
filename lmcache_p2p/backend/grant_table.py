"""The receiver's grant table: which slots each request of each sender holds, and how it ends.

Per request: ``Alloc`` batches arrive in order; each new chunk gets a RESERVED slot (re-sent
chunks get -1), a ``Written`` notification turns slots READY, and once the last batch was
announced and every granted slot is READY the request's KV is ready (KvReady to the proxy).
A refused, cancelled, expired or abandoned request frees its slots and reports KvFailed.

An Alloc key the buffer cache holds is granted -1 (the sender skips it) and pinned for the
request until the decoder's LMCache lookup, the request's failure, or ``p2p.ready_lease_s``.
A slot is granted to one request of one sender (its *writer*: the sender's transport name and
the request id); a Written counts only from the transport peer and sender that own the request,
and only for slots granted to that request; anything else is ignored and counted.

Every public method takes the service's lock (``lock``); methods ending in ``_locked`` expect it held.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from lmcache_p2p import protocol
from lmcache_p2p.backend.chunk_index import ChunkIndex
from lmcache_p2p.backend.piece_merge import PieceMerger, caches_key
from lmcache_p2p.backend.receiver_counters import Counters, WarnOnce
from lmcache_p2p.buffer import SlotPool
from lmcache_p2p.config import P2PConfig
from lmcache_p2p.errors import BufferFull

logger = logging.getLogger(__name__)


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


@dataclasses.dataclass(frozen=True)
class Reporter:
    """Who the grant table reports to: the proxy (KvReady / KvFailed) as this rank of this instance."""

    instance_id: str
    tp_rank: int
    send: Callable[[protocol.Message], object]
    count_foreign: Callable[[], None]  # a Written from a peer that does not own its request


class GrantTable:
    """The requests of one receiver rank: their grants, arrivals, cancellation and expiry."""

    def __init__(self, cfg: P2PConfig, pool: SlotPool, index: ChunkIndex | PieceMerger, counters: Counters, *,
                 slot_bytes: int, dtype: str, reporter: Reporter, warn_once: WarnOnce) -> None:
        self._cfg = cfg
        self._pool = pool
        self._index = index
        self._counters = counters
        self._slot_bytes = slot_bytes
        self._dtype = dtype
        self._reporter = reporter
        self._warn_once = warn_once
        self.lock = threading.Lock()
        self.requests: dict[str, _Request] = {}
        self.cancelled: dict[str, float] = {}  # req_id -> until when a late Alloc is refused
        # Reported requests with nothing of their own left, whose Grant pins a Cancel must still drop.
        self.pinning: dict[str, tuple[list[int], float]] = {}  # req_id -> (held slots, until)
        self.last_activity = 0.0  # monotonic time of the last grant or landed write

    # ---- grants -------------------------------------------------------------------------------

    def alloc(self, sender_id: str, writer: str, msg: protocol.Alloc) -> protocol.Message:
        """Grant slots for one Alloc batch of ``sender_id`` (whose transport peer is ``writer``)."""
        problem = self._shape_problem(msg)
        if problem is not None:
            return problem
        with self.lock:
            req = self._request_for_locked(sender_id, writer, msg)
            if not isinstance(req, _Request):
                return req
            return self._grant_locked(req, msg)

    def _shape_problem(self, msg: protocol.Alloc) -> protocol.Message | None:
        """The reply to an Alloc whose chunks can never be granted here (None: they can)."""
        if len(msg.keys) != len(msg.shapes):
            return protocol.ErrorReply(msg.seq, f"alloc has {len(msg.keys)} keys but {len(msg.shapes)} shapes")
        for shape in msg.shapes:
            if shape.nbytes > self._slot_bytes:
                return self.refuse(msg, protocol.RefusalCode.TOO_LARGE, (
                    f"chunk of {shape.nbytes} bytes exceeds the slot size {self._slot_bytes} "
                    "(sender and receiver must serve the same model and chunk_size)"))
            if shape.dtype != self._dtype:
                return self.refuse(msg, protocol.RefusalCode.TOO_LARGE, (
                    f"chunk dtype {shape.dtype} differs from this decoder's KV dtype {self._dtype}"))
        return None

    def _request_for_locked(self, sender_id: str, writer: str, msg: protocol.Alloc) -> _Request | protocol.Message:
        """The request this Alloc continues (created at its first), or the reply refusing it."""
        if msg.req_id in self.cancelled:
            return self.refuse(msg, protocol.RefusalCode.FINISHED, "request was cancelled or failed here")
        req = self.requests.get(msg.req_id)
        if req is None:
            req = self.requests[msg.req_id] = _Request(msg.req_id, sender_id, writer)
        elif req.sender_id != sender_id:
            return protocol.ErrorReply(msg.seq, f"request {msg.req_id} belongs to another sender")
        elif req.reported:
            return self.refuse(msg, protocol.RefusalCode.FINISHED, "request already completed or failed")
        return req

    def _grant_locked(self, req: _Request, msg: protocol.Alloc) -> protocol.Message:
        held = self._pin_held_locked(req, msg)  # before reserving: never evicted for this very batch
        new = [i for i, key in enumerate(msg.keys) if key not in req.keys and key not in req.held and i not in held]
        total = len(req.keys) + len(new)
        if total > self._pool.num_slots:
            self._unpin_locked(req.req_id, held.values())
            reason = (f"decoder buffer holds {self._pool.num_slots} chunks, request needs at least {total}: "
                      "raise p2p.buffer_size on the decoder")
            refusal = self.refuse(msg, protocol.RefusalCode.TOO_LARGE, reason, needed=total)
            self._fail_locked(req, reason, cause=protocol.KvFailCause.REFUSED)
            return refusal
        try:
            slots = self._pool.reserve(msg.req_id, len(new), self._cfg.reserve_lease_s,
                                       writer=(req.writer, msg.req_id),
                                       keys=[msg.keys[i] for i in new] if caches_key(msg.req_id) else None)
        except BufferFull as exc:
            self._unpin_locked(req.req_id, held.values())
            if not req.keys and not req.held:
                del self.requests[msg.req_id]
            return self.refuse(msg, protocol.RefusalCode.FULL, str(exc), needed=exc.needed_slots)
        self.last_activity = time.monotonic()
        for i, slot in held.items():
            req.held[msg.keys[i]] = slot
            req.held_bytes += msg.shapes[i].nbytes
        self._counters.chunks_held += len(held)
        self._counters.bytes_held += sum(msg.shapes[i].nbytes for i in held)
        granted = [-1] * len(msg.keys)
        for i, slot in zip(new, slots):
            req.keys[msg.keys[i]] = slot
            req.shapes[slot] = (msg.keys[i], msg.shapes[i])
            self._index.granted(slot, msg.keys[i], msg.shapes[i])
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
            if self._index.shape_of(slot) != msg.shapes[i]:
                self._pool.unpin(slot, req.req_id)
                continue
            held[i] = slot
            seen.add(key)
        return held

    def _unpin_locked(self, req_id: str, slots) -> None:
        for slot in slots:
            self._pool.unpin(slot, req_id)

    def refuse(self, msg: protocol.Alloc, code: protocol.RefusalCode, reason: str, needed: int = 0) -> protocol.Refused:
        return protocol.Refused(seq=msg.seq, req_id=msg.req_id, code=code, reason=reason, needed_slots=needed,
                                free_slots=self._pool.free_slots, capacity_slots=self._pool.num_slots)

    # ---- arrivals -----------------------------------------------------------------------------

    def written(self, peer: str, msg: protocol.Written) -> None:
        """Bytes landed. Counted only from the peer and sender owning the request, for its slots."""
        self.last_activity = time.monotonic()
        writer = (peer, msg.req_id)
        with self.lock:
            req = self.requests.get(msg.req_id)
            if req is not None and (req.sender_id, req.writer) != (msg.sender_id, peer):
                self._ignore_written_locked(peer, msg, f"request {msg.req_id} belongs to {req.sender_id} "
                                                       f"via {req.writer}")
                return
            granted = [s for s in msg.slots if req is not None and s in req.shapes]
            foreign = [s for s in msg.slots if s not in granted]
            stale = self._pool.mark_ready(msg.req_id, granted, self._cfg.ready_lease_s, writer=writer)
            # A given-up slot's write completed: nothing more lands in it, it may be granted again.
            confirmed = self._pool.confirm(writer, stale + foreign)
            self._counters.slots_confirmed += len(confirmed)
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
                self._counters.bytes_received += shape.nbytes
                self._index.landed(req.req_id, slot, key, shape)
            self._maybe_ready_locked(req)

    def write_failed(self, peer: str, msg: protocol.Written) -> None:
        """A write that will not land whole, and of which nothing more lands: fail its request now (not at
        its lease) and let its slots be granted again at once."""
        with self.lock:
            req = self.requests.get(msg.req_id)
            if req is not None and (req.sender_id, req.writer) == (msg.sender_id, peer):
                self._fail_locked(req, f"its write of slots {msg.slots} from {peer} did not land",
                                  cause=protocol.KvFailCause.UNREACHABLE)
            self._counters.slots_confirmed += len(self._pool.confirm((peer, msg.req_id), msg.slots))

    def _ignore_written_locked(self, peer: str, msg: protocol.Written, why: str,
                               slots: list[int] | None = None) -> None:
        if slots is None:
            self._counters.written_ignored += 1
            self._reporter.count_foreign()
        self._counters.written_slots_ignored += len(msg.slots if slots is None else slots)
        self._warn_once("written", peer, "ignored a Written from %s (sender %s, request %s, slots %s): %s",
                        peer, msg.sender_id, msg.req_id, msg.slots, why)

    def _maybe_ready_locked(self, req: _Request) -> None:
        if req.reported or not req.last or len(req.ready) != len(req.keys):
            return
        req.reported = True
        self._reporter.send(protocol.KvReady(req.req_id, self._reporter.instance_id, self._reporter.tp_rank,
                                             len(req.keys), req.nbytes, chunks_held=len(req.held),
                                             bytes_held=req.held_bytes, bytes_received=req.nbytes))
        # INFO only when the cache saved a transfer (once per request, never per chunk).
        logger.log(logging.INFO if req.held else logging.DEBUG,
                   "request %s: KV ready: %d chunks moved (%d bytes), %d chunks held in the buffer cache (%d bytes)",
                   req.req_id, len(req.keys), req.nbytes, len(req.held), req.held_bytes)
        if not self._pool.slots_of(req.req_id):
            self.requests.pop(req.req_id, None)  # nothing of its own to load (all held): done here
            if req.held:
                self.pinning[req.req_id] = (list(req.held.values()), time.monotonic() + self._cfg.ready_lease_s)

    def loaded(self, req_id: str) -> None:
        """The engine let one of ``req_id``'s chunks go: forget a reported request with none left."""
        with self.lock:
            self.forget_if_done_locked(req_id)

    def forget_if_done_locked(self, req_id: str) -> None:
        req = self.requests.get(req_id)
        if req is not None and req.reported and not self._pool.slots_of(req.req_id):
            del self.requests[req.req_id]

    # ---- endings ------------------------------------------------------------------------------

    def cancel(self, req_id: str, reason: str, *, owner: str | None = None) -> str | None:
        """The sender gave up, or the proxy will not decode here: drop the request's KV.

        A cancel may arrive before the request's first Alloc (the proxy cancels as soon as it
        decides); the id is remembered for ``reserve_lease_s`` so a late Alloc is refused. Given
        ``owner``, only a request of that sender (or one not known here) is dropped. Returns the
        sender the request belongs to (``owner`` for one not known here).
        """
        with self.lock:
            req = self.requests.get(req_id)
            if owner is not None and req is not None and req.sender_id != owner:
                return req.sender_id
            self._remember_finished_locked(req_id)
            if req is not None:
                self._fail_locked(req, f"cancelled: {reason}", expected=True)
            pinning = self.pinning.pop(req_id, None)
            if pinning is not None:  # KV ready, all of it held: no decode will read it here
                self._pool.unpin_holder(req_id, pinning[0])
            return req.sender_id if req is not None else owner

    def fail_sender(self, sender_id: str, why: str) -> None:
        """Fail every unfinished request of a sender that left."""
        with self.lock:
            pending = [r for r in self.requests.values() if r.sender_id == sender_id and not r.reported]
            for req in pending:
                self._fail_locked(req, f"sender {sender_id} left before finishing ({why})")

    def _remember_finished_locked(self, req_id: str) -> None:
        """Refuse ``req_id``'s later Allocs for ``reserve_lease_s`` (a cancelled or failed request
        is not revived by its next batch: the proxy retries under a fresh id)."""
        now = time.monotonic()
        self.cancelled[req_id] = now + self._cfg.reserve_lease_s
        for old in [r for r, until in self.cancelled.items() if until < now]:
            del self.cancelled[old]

    def _fail_locked(self, req: _Request, reason: str, *, expected: bool = False,
                     cause: protocol.KvFailCause = protocol.KvFailCause.LOST) -> None:
        """Free every slot of ``req`` that the engine does not hold, and report the failure once.

        Slots whose bytes had not landed are quarantined by the pool, not freed (a write may still land).
        Its later Alloc batches are refused (FINISHED).
        """
        self._remember_finished_locked(req.req_id)
        quarantined = self._pool.quarantined_slots
        self._pool.release_owner(req.req_id)
        self._pool.unpin_holder(req.req_id, req.held.values())
        self._counters.slots_quarantined += max(0, self._pool.quarantined_slots - quarantined)
        self._unindex_locked(req, set(req.shapes))
        if not req.reported:
            req.reported = True
            logger.log(logging.INFO if expected else logging.ERROR, "request %s from %s dropped: %s",
                       req.req_id, req.sender_id, reason)
            self._reporter.send(protocol.KvFailed(req.req_id, self._reporter.instance_id, self._reporter.tp_rank,
                                                  reason, cause))
        if not self._pool.slots_of(req.req_id):
            self.requests.pop(req.req_id, None)

    def _unindex_locked(self, req: _Request, slots: set[int]) -> None:
        for slot in slots:
            self._index.drop(req.req_id, slot, req.shapes[slot][0])

    def expire(self) -> None:
        """Give up the leases past their deadline (the pool's), and the requests that held them."""
        if self.pinning:
            now = time.monotonic()
            with self.lock:
                for req_id in [r for r, (_, until) in self.pinning.items() if until <= now]:
                    del self.pinning[req_id]  # the pool dropped its pins at the same deadline
        quarantined = self._pool.quarantined_slots
        expired = self._pool.expire()
        self._counters.slots_quarantined += max(0, self._pool.quarantined_slots - quarantined)
        if not expired:
            return
        with self.lock:
            for req_id, slots in expired.items():
                req = self.requests.get(req_id)
                if req is None:
                    continue
                if req.reported:  # KvReady went out; no decode loaded it, no Cancel came
                    logger.warning("request %s from %s: %d slot(s) of ready KV freed at lease expiry "
                                   "(p2p.ready_lease_s): no decode loaded them and no Cancel arrived",
                                   req_id, req.sender_id, len(slots))
                self._unindex_locked(req, set(slots))
                self._fail_locked(req, f"lease expired on {len(slots)} slot(s) (p2p.reserve_lease_s / ready_lease_s)")
