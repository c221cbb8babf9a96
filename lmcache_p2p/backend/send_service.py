"""The sender's service: asks receivers for slots and writes chunks into them, pipelined.

The engine thread calls :meth:`SendService.submit` and returns at once. One named thread owns
every socket and drives all requests as a small event loop, never blocking on one of them:

    submit -> per-request FIFO of batches -> Alloc (one round trip per batch, not per chunk)
           -> Grant -> [its store's GPU work done] -> transport.write(chunks -> slots, notification=Written)
           -> poll -> done

A batch may be submitted before its store's GPU work is done (``ready``: a ``StoreReady`` that
``store_ready.StoreWatch`` settles): its Alloc goes out at once, its writes only once it is READY;
its settling wakes the thread (``wake_pipe.WakePipe``, as a new batch or a pairing's result does).

Construction is cheap and opens nothing; :meth:`SendService.start` creates the sockets and
starts the thread. The parts, each in its module:
  * :class:`~lmcache_p2p.backend.send_peers.PeerSessions`: one control socket per receiver, its
    Hello / Welcome and its transport pairing (on a helper thread: NCCL pairing can take seconds,
    so one slow decoder never stalls the others);
  * :class:`~lmcache_p2p.backend.send_pipeline.AllocPipeline`: each request's batches, Allocs,
    Grants, retries, deadlines and endings (KvSent / KvFailed);
  * :class:`~lmcache_p2p.backend.send_writes.WriteTracker`: posted writes, their polling, and
    chunks handed back to LMCache only once nothing reads them.

A receiver that sends nothing at all within ``p2p.connect_timeout_s`` (Hello) /
``alloc_timeout_s`` (an Alloc) is dropped with every request to it, and greeted afresh next
time, so a restarted decoder is found again without restarting the prefiller.

Liveness: the thread never dies of one bad message or request (that request fails, logged with
request id, peer and cause); should the thread stop anyway, ``submit`` refuses with ClosedError.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections import deque
from typing import Any

import zmq

from lmcache_p2p import protocol
from lmcache_p2p.backend.announcer import Announcer
from lmcache_p2p.backend.send_peers import Connected, PeerSessions
from lmcache_p2p.backend.send_pipeline import AllocPipeline
from lmcache_p2p.backend.send_types import Batch, Chunk, SendStats, StoreReady, Target, release
from lmcache_p2p.backend.send_writes import WriteTracker
from lmcache_p2p.backend.wake_pipe import WakePipe
from lmcache_p2p.config import SENDER_IDLE_POLL_S, P2PConfig
from lmcache_p2p.errors import ClosedError, P2PError, QueueFull
from lmcache_p2p.transport import Transport

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = round(SENDER_IDLE_POLL_S * 1000)
# While writes are in flight the thread polls them every p2p.write_poll_interval_s, sleeping in
# between (never spinning): it runs in the engine's process, on the engine's core and under its GIL,
# where a spin slows the prefill's own sampling and answer while the transfer gains nothing.
_RETRY_POLL_MS = 1  # while only refused Allocs wait for their retry
_LOOP_ERROR_PAUSE_S = 0.05  # after an unexpected error in the loop itself (never a hot error loop)
_LOOP_ERRORS_MAX = 100  # consecutive loop errors after which the thread gives up (submit then refuses)


@dataclasses.dataclass(frozen=True)
class Inbound:
    """What the engine's side hands the service thread: a store batch, or a request's ending."""

    key: str  # the pipeline's key: the request's id, or ``wire_id@receiver`` for a share of it
    target: Target | None  # None: the base request needs nothing from us (KvSent), or it failed before routing
    batch: Batch | None
    wire_id: str = ""
    base_id: str = ""
    failure: str = ""  # not "": the request's KV will not come (its store failed before it reached us)


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
        self._inbox: deque[Inbound] = deque()  # at most p2p.send_queue_max_batches
        self._inbox_max = cfg.send_queue_max_batches
        self._connected: deque[Connected] = deque()  # results of pairing threads (under _inbox_lock)
        self._inbox_lock = threading.Lock()
        self._pipe = WakePipe()  # wakes the thread's poll: a batch, a pairing's result, a store's GPU work done
        self._stop = threading.Event()
        self._closed = False
        self._dead = ""  # why the service thread stopped, once it has
        self._ctx: zmq.Context | None = None
        self._poller = zmq.Poller()
        self._announcer: Announcer | None = None
        self._thread: threading.Thread | None = None
        self._peers = PeerSessions(cfg, codec=self._codec, sender_id=self.sender_id, tp_rank=tp_rank,
                                   transport=transport, fingerprint=fingerprint, handoff=self._handoff)
        self._writes = WriteTracker(cfg, transport, self.sender_id)
        self._pipeline = AllocPipeline(cfg, self._peers, self._writes, report=self._report,
                                       instance_id=self.instance_id, tp_rank=tp_rank, tp_size=tp_size)

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> SendService:
        """Open the wake pipe and sockets and start the thread; ClosedError once closed; a second
        start does nothing."""
        if self._closed:
            raise ClosedError("the sender is closed")
        if self._thread is not None:
            return self
        try:
            wake_fd = self._pipe.open()
            self._ctx = zmq.Context()
            self._poller.register(wake_fd, zmq.POLLIN)
            self._peers.open(self._ctx, self._poller)
            self._announcer = Announcer(self._cfg.proxy_url, self._codec, self._cfg.heartbeat_interval_s)
            thread = threading.Thread(target=self._run, name=f"p2p-sender-{self._tp_rank}", daemon=True)
            thread.start()
        except BaseException:
            self._abandon_start()
            raise
        self._thread = thread
        return self

    def _abandon_start(self) -> None:
        """Undo a start that failed half-way: nothing stays open."""
        if self._announcer is not None:
            self._announcer.close()
            self._announcer = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        self._pipe.close()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (it fails what is in flight and says Goodbye); idempotent, safe before
        or after a failed start."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is None:  # never started: nothing runs; close a pipe a failed start left
            self._pipe.close()
            return
        self._pipe.wake()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.error("sender thread did not stop within %.1fs", timeout_s)

    # ---- engine-facing -----------------------------------------------------------------------

    def submit(self, req_id: str, target: Target, chunks: list[Chunk], last: bool, called_s: float = 0.0,
               wire_id: str = "", queued_s: float = 0.0, ready: StoreReady | None = None) -> None:
        """Queue one store batch of a request; returns immediately. ClosedError if the service
        cannot send it (closed, not started, or its thread stopped): the chunks are released then.
        ``called_s``: ``time.perf_counter()`` when the engine's store call began (the proxy's timeline);
        ``queued_s``: when it handed the batch on (default now).
        ``wire_id``: the receiver's id of this share of the request when the TP splits differ
        (``kv_layout.sub_request_id``); one request may then go to several receivers. ``ready``: whether the
        store's GPU work is done (None: it is); the chunks are written only once it is READY, and a FAILED
        one fails the request."""
        called_s = called_s or time.perf_counter()
        submit_s = (queued_s or time.perf_counter()) - called_s
        key = f"{wire_id}@{target.address}" if wire_id else req_id
        with self._inbox_lock:
            refusal, full = self._refusal(), self._full()
            if not refusal and not full:
                self._inbox.append(Inbound(key, target, Batch(chunks, last, called_s, submit_s, ready),
                                           wire_id, req_id if wire_id else ""))
                self._pipe.wake()
                if ready is not None:  # its GPU work seen done wakes the thread to post the writes
                    ready.on_settled(self._pipe.wake)
                return
        release(chunks)
        if refusal:
            raise ClosedError(f"request {req_id}: KV not sent to {target.endpoint}: {refusal}")
        raise QueueFull("p2p.send_queue_max_batches", f"request {req_id}: KV not sent to {target.endpoint}: {full}")

    def nothing_to_send(self, req_id: str) -> None:
        """Another rank feeds every decoder rank this request's KV: report it done (KvSent, no chunks)."""
        self._post(Inbound(req_id, None, Batch([], True)), "its KvSent")

    def fail_request(self, req_id: str, shares: list[tuple[Target, str]], reason: str) -> None:
        """A store of ``req_id`` failed before it reached us (its chunks were released): fail the request on
        every receiver of ``shares`` (target, wire id; empty: it had none), KvFailed to the proxy."""
        for target, wire_id in shares or [(None, "")]:
            key = f"{wire_id}@{target.address}" if wire_id and target else req_id
            self._post(Inbound(key, target, None, wire_id, req_id if wire_id else "", failure=reason), "its KvFailed")

    def _post(self, item: Inbound, what: str) -> None:
        with self._inbox_lock:
            problem = self._refusal() or self._full()
            if not problem:
                self._inbox.append(item)
                self._pipe.wake()
                return
        logger.error("request %s: %s is not reported (the proxy's KV wait ends it): %s", item.base_id or item.key,
                     what, problem)

    def _full(self) -> str:
        if len(self._inbox) < self._inbox_max:
            return ""
        return (f"the sender's queue holds {len(self._inbox)} batches (p2p.send_queue_max_batches "
                f"{self._inbox_max}): raise p2p.send_queue_max_batches, or see why the sender's thread is behind")

    def _refusal(self) -> str:
        if self._closed:
            return "the sender is closed"
        if self._thread is None:
            return "the sender was not started (SendService.start)"
        if self._dead or not self._thread.is_alive():
            return (f"the sender's service thread stopped ({self._dead or 'unknown cause'}); "
                    "restart the prefiller (see its log for the cause)")
        return ""

    def stats(self) -> SendStats:
        p = self._pipeline
        return SendStats(p.done, p.failed, p.bytes, self._codec.rejected, self._writes.leaked, p.skipped)

    def pending_requests(self) -> int:
        return len(self._pipeline.requests) + len(self._inbox)

    def _report(self, msg: protocol.Message) -> None:
        if self._announcer is not None:
            self._announcer.send(msg)

    def _handoff(self, result: Connected) -> None:
        """From a pairing thread: queue its result for the service thread, and wake it."""
        with self._inbox_lock:
            self._connected.append(result)
            self._pipe.wake()

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
        if self._pipe.fd in events:
            self._pipe.drain()
        self._take_connected()
        self._take_inbox()
        for peer in list(self._peers.peers.values()):
            if peer.sock in events:
                self._peers.drain(peer, self._pipeline.on_message_guarded, self._pipeline.receiver_restarted)
        self._pipeline.progress_writes()
        self._writes.progress_unsettled()
        self._pipeline.check_deadlines()
        if self._announcer.heartbeat_due():
            self._announcer.heartbeat(self._announce())

    def _wait(self) -> dict[Any, int]:
        """Sockets with input, waiting at most until the next check of writes in flight or retries.
        Unsettled writes (a failure path) are checked at the idle pace: no spinning for them."""
        requests = self._pipeline.requests.values()
        writing = any(r.writes for r in requests)
        if writing and self._write_poll_s < 0.001:  # zmq's poll counts whole milliseconds
            events = dict(self._poller.poll(0))
            if not events:
                time.sleep(self._write_poll_s)
                events = dict(self._poller.poll(0))
            return events
        if writing:
            return dict(self._poller.poll(self._write_poll_s * 1000))
        retrying = any(r.retry_at is not None for r in requests)
        return dict(self._poller.poll(_RETRY_POLL_MS if retrying else _IDLE_POLL_MS))

    def _shutdown(self) -> None:
        self._pipeline.shutdown()
        with self._inbox_lock:
            pending, self._inbox = list(self._inbox), deque()
        for item in pending:
            if item.batch is not None:
                release(item.batch.chunks)
        self._writes.progress_unsettled(final=True)
        for peer in list(self._peers.peers.values()):
            self._peers.send(peer, protocol.Goodbye(self.sender_id, self._tp_rank))
            self._peers.drop(peer)
        self._announcer.close(protocol.Goodbye(self.instance_id, self._tp_rank))
        self._ctx.term()
        self._pipe.close()

    def _take_inbox(self) -> None:
        with self._inbox_lock:
            items, self._inbox = self._inbox, deque()
        for item in items:
            if item.failure:
                self._fail(item)
            elif item.target is None:
                self._report(protocol.KvSent(item.key, self.instance_id, self._tp_rank, tp_size=self._tp_size))
            else:
                self._pipeline.guarded(item.key, item.target.endpoint, "queueing a store batch",
                                       lambda i=item: self._pipeline.queue_batch(i.key, i.target, i.batch, i.wire_id,
                                                                                 i.base_id))

    def _fail(self, item: Inbound) -> None:
        if item.key in self._pipeline.requests:  # earlier batches went: cancel them on the receiver too
            self._pipeline.fail(item.key, item.failure, cause=protocol.KvFailCause.SENDER)
        else:
            logger.error("request %s: %s", item.base_id or item.key, item.failure)
            self._pipeline.failed += 1
            self._report(protocol.KvFailed(item.base_id or item.key, self.instance_id, self._tp_rank, item.failure,
                                           protocol.KvFailCause.SENDER))

    def _take_connected(self) -> None:
        with self._inbox_lock:
            results, self._connected = self._connected, deque()
        for result in results:
            peer, problem = self._peers.on_connected(result)
            if problem:
                self._pipeline.fail_peer(peer, problem, protocol.KvFailCause.UNREACHABLE)
            elif peer is not None:
                self._pipeline.on_ready(peer)

    def _announce(self) -> protocol.Announce:
        return protocol.Announce(
            version=protocol.PROTOCOL_VERSION, instance_id=self.instance_id, role="sender",
            http_url=self._cfg.http_url or "", tp_rank=self._tp_rank, tp_size=self._tp_size,
            fingerprint=self._fingerprint,
        )


__all__ = ["Chunk", "P2PError", "SendService", "SendStats", "Target"]
