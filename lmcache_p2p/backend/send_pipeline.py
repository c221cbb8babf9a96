"""The sender's alloc pipeline: each request's store batches, one Alloc at a time, to Grant and write.

    batch queued -> Alloc (one round trip per batch) -> Grant -> [held until ready] -> write (WriteTracker)
                 -> next batch

Within a request at most one Alloc is outstanding, so the receiver sees batches in order and the
``last`` flag only after every earlier batch was granted. A batch may arrive before its store's GPU
work is done (``Batch.ready``, settled by ``store_ready.StoreWatch``): its Alloc goes out at once, so
the round trip overlaps the GPU's work, but its writes are posted only once it is READY (before, the
bytes are not there yet). A granted batch that is not ready is held (``Request.held``), and the
request's next Alloc waits until it is written, so batches stay in order. A store that FAILED (a
CUDA error, or ``p2p.store_ready_timeout_s``) fails its request, whichever step its batch is at:
KvFailed, its granted slots cancelled, its chunks handed back. A refused Alloc (buffer full) is
retried with backoff until ``p2p.alloc_timeout_s``; then THAT request fails and its slots are
cancelled on the receiver. A receiver that sends nothing within ``alloc_timeout_s`` after an
Alloc is dropped with every request to it; a request whose last batch never comes fails after
``p2p.request_timeout_s``. An unexpected error while handling one message or request fails that
request only. Owned by the send service's thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from lmcache_p2p import protocol
from lmcache_p2p.backend.send_peers import Peer, PeerSessions, PeerState
from lmcache_p2p.backend.send_types import RETRY_FIRST_S, RETRY_MAX_S, Batch, Chunk, Request, Target
from lmcache_p2p.backend.send_writes import WriteTracker
from lmcache_p2p.config import P2PConfig
from lmcache_p2p.errors import RequestFailed

logger = logging.getLogger(__name__)


def _grant_problem(slots: Sequence[int], chunks: Sequence[Chunk], peer: Peer) -> str:
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


def _cancel_of_outlived_grant(peer: Peer, msg: protocol.Grant, requests: Iterable[Request],
                              seq: Iterator[int]) -> protocol.Cancel | None:
    """The Cancel for a Grant of an Alloc we no longer wait for (its request failed first: an Alloc held up
    on its way reaches the receiver late), None when there is nothing to free or the id is alive again.
    Nothing will write those slots: the receiver frees them now rather than at its lease's expiry."""
    if not any(s >= 0 for s in msg.slots) or peer.state is not PeerState.READY:
        return None
    if any(r.wire == msg.req_id and r.target == peer.target for r in requests):
        return None
    logger.info("receiver %s granted %d slot(s) to request %s after it ended here: cancelling them",
                peer.target.endpoint, sum(s >= 0 for s in msg.slots), msg.req_id)
    return protocol.Cancel(next(seq), msg.req_id, "granted after the sender gave the request up")


def _sent_report(req: Request, instance_id: str, tp_rank: int, tp_size: int) -> protocol.KvSent:
    """The request's times for the proxy's timeline (its last write was just seen complete)."""
    now = time.perf_counter()

    def span(start: float, end: float) -> float:
        return max(0.0, end - start) if start and end else 0.0

    return protocol.KvSent(req.base, instance_id, tp_rank,
                           store_s=req.last_stored_s - req.first_called_s, submit_s=req.submit_s,
                           transfer_s=now - req.first_called_s, chunks=req.chunks_sent, nbytes=req.nbytes,
                           pickup_s=span(req.first_called_s, req.picked_s),
                           grant_s=span(req.alloc_s, req.granted_s), write_s=span(req.posted_s, now),
                           tp_size=tp_size)


class AllocPipeline:
    """Every in-flight request of one sender rank, from its first batch to KvSent or KvFailed."""

    def __init__(self, cfg: P2PConfig, peers: PeerSessions, writes: WriteTracker, *,
                 report: Callable[[protocol.Message], object], instance_id: str, tp_rank: int,
                 tp_size: int = 1) -> None:
        self._cfg = cfg
        self._peers = peers
        self._writes = writes
        self._report = report
        self._instance_id = instance_id
        self._tp_rank = tp_rank
        self._tp_size = tp_size
        self._seq = itertools.count(1)
        self.requests: dict[str, Request] = {}
        self._by_seq: dict[int, str] = {}
        self.done = self.failed = self.bytes = self.skipped = 0

    def guarded(self, req_id: str, peer: str, what: str, step: Callable[[], None]) -> None:
        """Run one request's step; an unexpected error fails that request only."""
        try:
            step()
        except Exception as exc:
            logger.exception("request %s (receiver %s): unexpected error while %s", req_id, peer, what)
            self.fail(req_id, f"internal error while {what}: {type(exc).__name__}: {exc}")

    def queue_batch(self, req_id: str, target: Target, batch: Batch, wire_id: str = "", base_id: str = "") -> None:
        """Queue a store batch of ``req_id`` (the pipeline's key; ``wire_id`` / ``base_id``: see Request)."""
        req = self.requests.get(req_id)
        if req is None:
            req = self.requests[req_id] = Request(req_id, target, wire_id, base_id)
        elif req.target != target:
            logger.error("request %s changed receiver mid-way (%s -> %s); ignoring batch",
                         req_id, req.target.endpoint, target.endpoint)
            for c in batch.chunks:
                c.done()
            return
        batch.taken_s = time.perf_counter()
        req.queue.append(batch)
        req.last_received = req.last_received or batch.last
        req.first_called_s = req.first_called_s or batch.called_s
        req.last_stored_s = batch.called_s + batch.submit_s
        req.submit_s += batch.submit_s
        self.advance(req)

    def advance(self, req: Request) -> None:
        """Send the next Alloc of ``req`` if none is outstanding and no granted batch waits for its GPU work;
        finish it when all is written."""
        if req.alloc_seq is not None or req.retry_at is not None or req.held is not None:
            return
        if not req.queue:
            if req.last_granted and not req.writes:
                self._finish(req)
            return
        peer = self._peers.greet(req.target)
        if peer.state is not PeerState.READY:
            if req.req_id not in peer.waiting:
                peer.waiting.append(req.req_id)
            return
        batch = req.queue.popleft()
        self._send_alloc(peer, req, batch)

    def _send_alloc(self, peer: Peer, req: Request, batch: Batch) -> None:
        seq = next(self._seq)
        req.alloc_seq, req.alloc_batch = seq, batch
        req.alloc_sent_at = time.monotonic()
        req.alloc_s = req.alloc_s or time.perf_counter()
        if not req.alloc_deadline:
            req.alloc_deadline = req.alloc_sent_at + self._cfg.alloc_timeout_s
        self._by_seq[seq] = req.req_id
        self._peers.send(peer, protocol.Alloc(seq, req.wire, [c.key for c in batch.chunks],
                                              [c.shape for c in batch.chunks], batch.last))

    # ---- replies -------------------------------------------------------------------------------

    def on_message_guarded(self, peer: Peer, msg: protocol.Message) -> None:
        """Handle one message; an unexpected error fails the request it concerns, or the peer."""
        try:
            self._on_message(peer, msg)
        except Exception as exc:
            req_id = self._by_seq.get(getattr(msg, "seq", -1)) or getattr(msg, "req_id", "")
            logger.exception("unexpected error handling %s from receiver %s (request %s)",
                             type(msg).__name__, peer.target.endpoint, req_id or "-")
            reason = f"internal error handling {type(msg).__name__}: {type(exc).__name__}: {exc}"
            if req_id in self.requests:
                self.fail(req_id, reason)
            elif self._peers.get(peer.target) is peer and peer.state is not PeerState.READY:
                self.fail_peer(peer, reason)

    def _on_message(self, peer: Peer, msg: protocol.Message) -> None:
        if isinstance(msg, protocol.Welcome):
            problem = self._peers.on_welcome(peer, msg)
            if problem:
                self.fail_peer(peer, problem, protocol.KvFailCause.REFUSED)
        elif isinstance(msg, protocol.Grant):
            self._on_grant(peer, msg)
        elif isinstance(msg, protocol.Refused):
            self._on_refused(peer, msg)
        elif isinstance(msg, protocol.ErrorReply):
            if msg.seq in self._by_seq:
                self.fail(self._by_seq[msg.seq], f"receiver error: {msg.message}", cause=protocol.KvFailCause.REFUSED)
            else:
                self.fail_peer(peer, f"receiver {peer.target.endpoint} refused us: {msg.message}",
                               protocol.KvFailCause.REFUSED)
        # Ack needs nothing.

    def on_ready(self, peer: Peer) -> None:
        """The handshake with ``peer`` completed: start the requests that waited for it."""
        waiting, peer.waiting = peer.waiting, []
        for req_id in waiting:
            if req_id in self.requests:
                self.guarded(req_id, peer.target.endpoint, "starting after the handshake",
                             lambda r=self.requests[req_id]: self.advance(r))

    def _on_grant(self, peer: Peer, msg: protocol.Grant) -> None:
        req = self._pop_alloc(msg.seq)
        if req is None:
            if (cancel := _cancel_of_outlived_grant(peer, msg, self.requests.values(), self._seq)) is not None:
                self._peers.send(peer, cancel)
            return
        batch, req.alloc_batch = req.alloc_batch, None
        asked_at = req.alloc_sent_at  # this Grant's Alloc (one is outstanding per request)
        req.granted_s = req.granted_s or time.perf_counter()
        req.alloc_deadline = 0.0
        req.retry_delay_s = RETRY_FIRST_S
        problem = _grant_problem(msg.slots, batch.chunks, peer)
        if problem:
            for c in batch.chunks:
                c.done()  # nothing of this batch was written
            self.fail(req.req_id, f"bad grant from {peer.target.endpoint}: {problem}", cause=protocol.KvFailCause.REFUSED)
            return
        to_write = [(c, s) for c, s in zip(batch.chunks, msg.slots) if s >= 0]
        for c, s in zip(batch.chunks, msg.slots):
            if s < 0:
                c.done()  # the receiver already holds this chunk (its cache, or re-sent by a later store)
                self.skipped += 1
        req.last_granted = req.last_granted or batch.last
        req.granted_any = req.granted_any or any(s >= 0 for s in msg.slots)
        if to_write:  # posted now, or held until its store's GPU work is done (the write stamps picked_s)
            failed = self._writes.write(self._peers.get(req.target), req, batch, to_write, asked_at)
            if failed:
                self.fail(req.req_id, failed, cause=protocol.KvFailCause.UNREACHABLE)
        else:  # nothing to write: the receiver holds it all
            req.picked_s = req.picked_s or batch.sendable_s
        if req.req_id in self.requests:  # the write may have failed the request
            self.advance(req)

    def progress_writes(self) -> None:
        """Post the writes of held batches whose store became ready; poll those in flight."""
        for req in list(self.requests.values()):
            if req.writes or req.held is not None:
                self.guarded(req.req_id, req.target.endpoint, "polling its writes",
                             lambda r=req: self._progress_request_writes(r))

    def _progress_request_writes(self, req: Request) -> None:
        failed = self._writes.post_held(self._peers.get(req.target), req) or self._writes.poll(req)
        if failed:
            self.fail(req.req_id, failed, cause=protocol.KvFailCause.UNREACHABLE)
        elif req.held is None:
            self.advance(req)

    def _on_refused(self, peer: Peer, msg: protocol.Refused) -> None:
        req = self.requests.get(self._by_seq.get(msg.seq, ""))
        if req is None:
            return
        if msg.code is protocol.RefusalCode.FULL:
            req.refusal = f"{msg.free_slots} of {msg.capacity_slots} slots free, {msg.needed_slots} needed"
        if msg.code is protocol.RefusalCode.FULL and time.monotonic() < req.alloc_deadline:
            self._pop_alloc(msg.seq)
            req.retry_at = time.monotonic() + req.retry_delay_s  # alloc_batch stays for the retry
            req.retry_delay_s = min(req.retry_delay_s * 2, RETRY_MAX_S)
            return
        if msg.code is protocol.RefusalCode.UNKNOWN_PEER:
            self.receiver_restarted(peer, f"receiver {peer.target.endpoint} restarted")
            return
        if msg.code is protocol.RefusalCode.FULL:
            reason = (f"decoder buffer stayed full for {self._cfg.alloc_timeout_s:.1f}s (p2p.alloc_timeout_s): "
                      f"{msg.free_slots} of {msg.capacity_slots} slots free, {msg.needed_slots} needed")
        else:
            reason = f"refused by receiver ({msg.code.value}): {msg.reason}"
        cause = protocol.KvFailCause.LOST if msg.code is protocol.RefusalCode.FINISHED else protocol.KvFailCause.REFUSED
        self.fail(req.req_id, reason, expected=msg.code is protocol.RefusalCode.FINISHED, cause=cause)

    def receiver_restarted(self, peer: Peer, why: str) -> None:
        """The receiver forgot us (it restarted): greet it afresh; requests that lost chunks fail."""
        logger.warning("%s; greeting it again", why)
        resumable = []
        for req in [r for r in self.requests.values() if r.target == peer.target]:
            if req.granted_any or req.writes:
                self.fail(req.req_id, f"receiver {peer.target.endpoint} restarted and lost this request's KV",
                          cancel=False, cause=protocol.KvFailCause.LOST)
                continue
            if req.alloc_seq is not None:
                self._by_seq.pop(req.alloc_seq, None)
                req.alloc_seq = None
            if req.alloc_batch is not None:
                req.queue.appendleft(req.alloc_batch)
                req.alloc_batch = None
            req.retry_at = None
            resumable.append(req)
        self._peers.drop(peer)
        for req in resumable:
            self.guarded(req.req_id, peer.target.endpoint, "greeting a restarted receiver",
                         lambda r=req: self.advance(r))

    def _pop_alloc(self, seq: int) -> Request | None:
        req_id = self._by_seq.pop(seq, None)
        req = self.requests.get(req_id) if req_id else None
        if req is None or req.alloc_seq != seq:
            return None
        req.alloc_seq = None
        return req

    # ---- deadlines -----------------------------------------------------------------------------

    def check_deadlines(self) -> None:
        now = time.monotonic()
        for peer, reason in self._peers.overdue(now):
            self.fail_peer(peer, reason, protocol.KvFailCause.UNREACHABLE)
        for req in list(self.requests.values()):
            if req.req_id in self.requests:  # an earlier one may have failed its whole peer
                self.guarded(req.req_id, req.target.endpoint, "checking its deadlines",
                             lambda r=req, t=now: self._check_request(r, t))

    def _check_request(self, req: Request, now: float) -> None:
        peer = self._peers.get(req.target)
        if (failed_store := req.failed_store()) is not None:  # its bytes never come, whichever step it is at
            self.fail(req.req_id, failed_store.problem, cause=protocol.KvFailCause.SENDER)
        elif req.alloc_seq is not None and peer is not None and self._silent(peer, req, now):
            # No reply to this Alloc and nothing else from the receiver since it left: it is gone.
            self.fail_peer(peer, f"receiver {req.target.endpoint} sent nothing for "
                                 f"{now - req.alloc_sent_at:.1f}s after an allocation (p2p.alloc_timeout_s)",
                           protocol.KvFailCause.UNREACHABLE)
        elif req.alloc_deadline and now > req.alloc_deadline and (req.alloc_seq is not None or req.retry_at):
            # The receiver is alive but had no buffer credit for this request in time: it alone fails.
            self.fail(req.req_id, f"no buffer credit on {req.target.endpoint} within "
                                  f"{self._cfg.alloc_timeout_s:.1f}s (p2p.alloc_timeout_s)"
                                  + (f"; last refusal: {req.refusal}" if req.refusal else ""),
                      cause=protocol.KvFailCause.REFUSED)
        elif req.retry_at is not None and now >= req.retry_at:
            self._retry_alloc(req, peer)
        elif not req.last_received and now > req.started + self._cfg.request_timeout_s:
            self.fail(req.req_id, f"its last store batch did not arrive within {self._cfg.request_timeout_s:.1f}s "
                                  "of its first (p2p.request_timeout_s): the client left mid-prefill?",
                      cause=protocol.KvFailCause.SENDER)

    def _silent(self, peer: Peer, req: Request, now: float) -> bool:
        return now > req.alloc_sent_at + self._cfg.alloc_timeout_s and peer.last_heard < req.alloc_sent_at

    def _retry_alloc(self, req: Request, peer: Peer | None) -> None:
        req.retry_at = None
        batch, req.alloc_batch = req.alloc_batch, None
        if peer is None or peer.state is not PeerState.READY:
            req.queue.appendleft(batch)
            self.advance(req)
        else:
            self._send_alloc(peer, req, batch)

    # ---- endings -------------------------------------------------------------------------------

    def _finish(self, req: Request) -> None:
        del self.requests[req.req_id]
        self.done += 1
        self.bytes += req.nbytes
        logger.debug("request %s: %d bytes sent in %.1f ms", req.req_id, req.nbytes,
                     (time.monotonic() - req.started) * 1000)
        self._report(_sent_report(req, self._instance_id, self._tp_rank, self._tp_size))

    def fail(self, req_id: str, reason: str, *, cancel: bool = True, expected: bool = False,
             cause: protocol.KvFailCause = protocol.KvFailCause.UNKNOWN) -> None:
        req = self.requests.pop(req_id, None)
        if req is None:
            return
        self.failed += 1
        if req.alloc_seq is not None:
            self._by_seq.pop(req.alloc_seq, None)
        for batch in [req.alloc_batch, *req.queue]:
            for c in batch.chunks if batch else ():
                c.done()
        self._writes.abort(req)  # its chunks go back only once nothing reads them (a held batch's at once)
        err = RequestFailed(f"request {req_id} to {req.target.endpoint}: {reason}")
        logger.log(logging.INFO if expected else logging.ERROR, "%s", err)
        peer = self._peers.get(req.target)
        if cancel and peer is not None and peer.state is PeerState.READY:
            self._peers.send(peer, protocol.Cancel(next(self._seq), req.wire, reason))
        self._report(protocol.KvFailed(req.base, self._instance_id, self._tp_rank, reason, cause))

    def fail_peer(self, peer: Peer, reason: str, cause: protocol.KvFailCause = protocol.KvFailCause.UNKNOWN) -> None:
        for req_id in [r.req_id for r in self.requests.values() if r.target == peer.target]:
            self.fail(req_id, reason, cancel=False, cause=cause)
        self._peers.drop(peer)

    def shutdown(self) -> None:
        """Fail every request: the prefiller is going away."""
        for req_id in list(self.requests):
            self.fail(req_id, "prefiller is shutting down", cause=protocol.KvFailCause.SENDER)
