"""The receiver's service: grants slots to senders, tracks what landed, reports to the proxy.

Construction is cheap and opens nothing; :meth:`ReceiveService.start` binds the control socket
(ZMQ ROUTER on ``p2p.host:control_port``), connects the announcer, installs the transport's
write guard and starts one named thread, which owns the socket, drains the transport's
notifications, expires leases and heartbeats. The engine's threads only call ``count_ready`` /
``take`` / ``release`` / ``unpin`` (under a lock); they never touch a socket.

The parts, each in its module:
  * :class:`~lmcache_p2p.backend.control_port.ControlPort`: the socket, the senders that said
    Hello (fingerprint, version, transport checked), their frames and their departure;
  * :class:`~lmcache_p2p.backend.grant_table.GrantTable`: requests, their slots, arrivals
    (``Written``), cancellation, expiry, KvReady / KvFailed;
  * :class:`~lmcache_p2p.backend.chunk_index.ChunkIndex`: READY chunks by key and the pins of
    LMCache's lookups on cached ones;
  * :class:`~lmcache_p2p.backend.write_guard.WriteGuard`: what a two-sided transport may receive.

The buffer cache (``p2p.buffer_cache``, on by default): a chunk the engine loaded stays in its
slot as CACHED (see ``buffer/pool.py``); Allocs for it are granted -1 and lookups serve it.

Integrity (a wrong answer is worse than a slow one):
  * a sender whose KV :class:`~lmcache_p2p.protocol.Fingerprint` differs from ours is refused at
    Hello (nothing is reserved for it); so a chunk key (the chunk hash) names the same KV on both
    sides, and the wire keeps the bare hash;
  * a slot is granted to one request of one sender; a slot given up before its bytes landed is
    QUARANTINED by the pool until that writer's Written arrives or the write window
    (``p2p.transfer_timeout_s`` + ``p2p.quarantine_margin_s`` after the grant) passes;
  * a Written counts only from the transport peer and sender that own the request;
  * two-sided transports (NCCL) ask :meth:`ReceiveService.admit_write` before receiving.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from typing import Any

import zmq

from lmcache_p2p import protocol
from lmcache_p2p.backend.announcer import Announcer
from lmcache_p2p.backend.chunk_index import Chunk, ChunkIndex
from lmcache_p2p.backend.control_port import ControlPort
from lmcache_p2p.backend.grant_table import GrantTable, Reporter
from lmcache_p2p.backend.piece_merge import PieceMerger
from lmcache_p2p.backend.receiver_counters import Counters, WarnOnce
from lmcache_p2p.backend.write_guard import WriteGuard
from lmcache_p2p.buffer import SlotPool
from lmcache_p2p.config import P2PConfig
from lmcache_p2p.errors import ClosedError, ProtocolError
from lmcache_p2p.transport import Transport, two_sided

logger = logging.getLogger(__name__)

_POLL_MS = 5
_EXPIRE_EVERY_S = 0.05
_SPIN_AFTER_ACTIVITY_S = 1.0  # spin-poll this long after a grant or a landed write, not for a dead sender
_IDLE_CHECK_EVERY_S = 1.0
_FREED_ANNOUNCE_GAP_S = 0.025  # freed slots are announced at once, at most once per this gap (40/s per rank)


class ReceiveService:
    """Slot grants, arrival tracking and reporting for one TP rank of a decoder."""

    def __init__(self, cfg: P2PConfig, *, tp_rank: int, tp_size: int, transport: Transport, pool: SlotPool,
                 slot_bytes: int, region_addr: int, chunk_tokens: int, dtype: str,
                 fingerprint: protocol.Fingerprint | None = None, buffer: Any = None) -> None:
        self._cfg = cfg
        self._tp_rank = tp_rank
        self._tp_size = tp_size
        self._transport = transport
        self._two_sided = two_sided(transport)  # None: a one-sided transport (no guard, no failed writes)
        self._pool = pool
        self._slot_bytes = slot_bytes
        self._region_addr = region_addr
        self._chunk_tokens = chunk_tokens
        self.fingerprint = fingerprint  # None: accept any sender (tests that move raw bytes)
        # Quarantine and cache policy are ours: a pool built without them (tests) gets them before any grant.
        pool.write_window_s = max(pool.write_window_s, cfg.write_window_s)
        pool.cache = cfg.buffer_cache
        self.counters = Counters()
        self.instance_id = cfg.default_instance_id()
        self.receiver_id = f"{self.instance_id}/r{tp_rank}/{uuid.uuid4().hex[:8]}"
        port = cfg.control_port(tp_rank)
        self.control_endpoint = f"tcp://{cfg.host}:{port}"
        # The names a Hello or the proxy's Cancel may address us by: the control address peers dial.
        addresses = frozenset({f"{cfg.advertised_host()}:{port}", f"{cfg.host}:{port}"})
        self._codec = protocol.Codec(cfg.shared_secret, identity=self.receiver_id, window_s=cfg.auth_window_s,
                                     names=[self.receiver_id, *addresses])
        self._stop = threading.Event()
        self._closed = False
        self._announcer: Announcer | None = None
        self._ctx: zmq.Context | None = None
        self._thread: threading.Thread | None = None
        warn_once = WarnOnce(logger)
        self.index = ChunkIndex(pool, cfg.ready_lease_s, self.counters)
        reporter = Reporter(self.instance_id, tp_rank, self._report,
                            lambda: self._codec.count_rejected(protocol.Rejection.FOREIGN))
        # Requests fed by several sender ranks (a larger prefiller TP) are merged; see piece_merge.py.
        self.merger = PieceMerger(self.index, pool, buffer=buffer, slot_bytes=slot_bytes, report=self._report)
        reporter = dataclasses.replace(reporter, send=self.merger.report)
        self.grants = GrantTable(cfg, pool, self.merger, self.counters, slot_bytes=slot_bytes, dtype=dtype,
                                 reporter=reporter, warn_once=warn_once)
        self.merger.attach(self.grants.forget_if_done_locked)
        self._lock = self.grants.lock  # one lock for the grant table and the chunk index
        self.guard = WriteGuard(pool, region_addr=region_addr, slot_bytes=slot_bytes,
                                write_window_s=cfg.write_window_s, counters=self.counters, lock=self._lock)
        self.control = ControlPort(codec=self._codec, control_addresses=addresses, receiver_id=self.receiver_id,
                                   transport=transport, grants=self.grants, counters=self.counters,
                                   warn_once=warn_once, fingerprint=fingerprint, welcome=self._welcome,
                                   closing=self._stop, tp_rank=tp_rank,
                                   proxy_name=protocol.dialled_name(cfg.proxy_url) if cfg.proxy_url else "")

    @property
    def control_addresses(self) -> frozenset[str]:
        return self.control.control_addresses

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> ReceiveService:
        """Listen, announce and serve. ProtocolError if the control port cannot be bound (then
        nothing is left open); ClosedError once closed; a second start does nothing."""
        if self._closed:
            raise ClosedError("receiver is closed")
        if self._thread is not None:
            return self
        self._ctx = zmq.Context()
        try:
            sock = self.control.bind(self._ctx, self.control_endpoint)
        except ProtocolError:
            self._ctx.term()
            self._ctx = None
            raise
        try:
            self._announcer = Announcer(self._cfg.proxy_url, self._codec, self._cfg.heartbeat_interval_s)
            if self._two_sided is not None:
                self._two_sided.set_write_guard(self.admit_write)
            thread = threading.Thread(target=self._run, args=(sock,), name=f"p2p-receiver-{self._tp_rank}",
                                      daemon=True)
            thread.start()
        except BaseException:  # nothing stays open after a failed start
            if self._announcer is not None:
                self._announcer.close()
                self._announcer = None
            self.control.close()
            self._ctx.term()
            self._ctx = None
            raise
        self._thread = thread
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (it says Goodbye and closes the socket); idempotent, safe before or
        after a failed start."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        thread = self._thread
        if thread is None:  # never started, or its start failed: nothing runs, nothing is open
            return
        if thread.is_alive() and threading.current_thread() is not thread:
            thread.join(timeout_s)
            if thread.is_alive():
                logger.error("receiver thread did not stop within %.1fs", timeout_s)
        self.control.join_teardowns(deadline)

    def check_open(self) -> None:
        if self._closed:
            raise ClosedError("receiver is closed")

    def _run(self, sock: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        next_expire = next_idle_check = 0.0
        lowest_free = -1  # the fewest free slots since the last announcement
        try:
            while not self._stop.is_set():
                # While granted slots await their bytes, poll without sleeping: with NIXL's progress
                # thread off, UCX tcp moves a receiver's bytes only while it polls notifications.
                expecting = (self._pool.reserved_slots > 0
                             and time.monotonic() - self.grants.last_activity < _SPIN_AFTER_ACTIVITY_S)
                events = dict(poller.poll(0 if expecting else _POLL_MS))
                if expecting and not events:
                    time.sleep(0)
                if sock in events:
                    self.control.drain()
                self._drain_notifications()
                self.merger.flush(self.grants.cancel)
                now = time.monotonic()
                if now >= next_expire:
                    self.grants.expire()
                    next_expire = now + _EXPIRE_EVERY_S
                if now >= next_idle_check:
                    self.control.forget_idle(now, self._cfg.sender_idle_timeout_s)
                    next_idle_check = now + _IDLE_CHECK_EVERY_S
                free = self._pool.free_slots
                if free > lowest_free >= 0:  # slots freed: the proxy's admission may be waiting for them
                    self._announcer.expedite(_FREED_ANNOUNCE_GAP_S)
                lowest_free = free if lowest_free < 0 else min(lowest_free, free)
                if self._announcer.heartbeat_due():
                    self._announcer.heartbeat(self._announce())
                    lowest_free = -1
        except Exception:
            logger.exception("receiver service thread crashed; the decoder will recompute from now on")
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        self._announcer.close(protocol.Goodbye(self.instance_id, self._tp_rank))
        self.control.close()
        self._ctx.term()

    # ---- engine-facing (any thread) ----------------------------------------------------------

    def count_ready(self, keys: list[str], refresh_lease: bool = False, pin: bool = False) -> int:
        """How many of ``keys``, as a prefix, have a READY chunk (see ChunkIndex.count_ready)."""
        with self._lock:
            return self.index.count_ready(keys, pin)

    def unpin(self, key: str) -> None:
        """LMCache released one lookup's claim on ``key`` (after its retrieve)."""
        with self._lock:
            self.index.unpin(key)

    def take(self, key: str) -> Chunk | None:
        """Hand one READY chunk of ``key`` to the engine (a request's own first, else the cached one)."""
        with self._lock:
            return self.index.take(key)

    def release(self, chunk: Chunk) -> None:
        """The engine dropped its reference: the slot is cached (or FREE) again."""
        if chunk.cached:
            self._pool.unread(chunk.slot)
            return
        self._pool.release([chunk.slot])
        self.grants.loaded(chunk.req_id)

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
        """Control frames refused so far, by reason (auth, replay, stale, oversized, malformed, ...)."""
        return self._codec.rejected

    def admit_write(self, peer: str, dests: list[tuple[int, int]], notif: bytes) -> str:
        """The transport's write guard (transport threads): "" if ``peer`` may write ``dests``."""
        return self.guard.admit(peer, dests, notif)

    # ---- the service thread ------------------------------------------------------------------

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
            self.on_written(notif.peer, msg)
        if self._two_sided is not None:
            for notif in self._two_sided.get_failed_writes():
                self._on_write_failed(notif.peer, notif.payload)

    def _on_write_failed(self, peer: str, payload: bytes) -> None:
        """The transport says this Written's write will not land whole, and nothing more of it lands."""
        try:
            msg = protocol.decode(payload)
        except ProtocolError:
            return
        if isinstance(msg, protocol.Written):
            self.grants.write_failed(peer, msg)

    def on_written(self, peer: str, msg: protocol.Written) -> None:
        """Bytes landed (see GrantTable.written); the senders behind ``peer`` are alive."""
        self.control.heard_from_writer(peer, time.monotonic())
        self.grants.written(peer, msg)

    def _report(self, msg: protocol.Message) -> None:
        if self._announcer is not None:
            self._announcer.send(msg)

    def _welcome(self) -> protocol.Welcome:
        return protocol.Welcome(
            version=protocol.PROTOCOL_VERSION, receiver_id=self.receiver_id, buffer_addr=self._region_addr,
            slot_bytes=self._slot_bytes, num_slots=self._pool.num_slots, transport=self._transport.info(),
            transfer_timeout_s=self._cfg.transfer_timeout_s, fingerprint=self.fingerprint,
        )

    def _announce(self) -> protocol.Announce:
        return protocol.Announce(
            version=protocol.PROTOCOL_VERSION, instance_id=self.instance_id, role="receiver",
            http_url=self._cfg.http_url or "", tp_rank=self._tp_rank, tp_size=self._tp_size,
            control_host=self._cfg.advertised_host(), control_port=self._cfg.control_port(self._tp_rank),
            transport_port=self._cfg.transport_port(self._tp_rank), capacity_slots=self._pool.num_slots,
            free_slots=self._pool.free_slots, slot_bytes=self._slot_bytes, chunk_tokens=self._chunk_tokens,
            fingerprint=self.fingerprint,
        )


__all__ = ["Chunk", "Counters", "ReceiveService"]
