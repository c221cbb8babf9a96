"""The NCCL transport: one 2-rank torch.distributed group per sender<->receiver pair, no world.

Owns: the TCPStore this instance hosts (on ``host:port``; senders find it in our TransportInfo),
one group per pair with the threads serving it, the receive regions it registered and the
notifications of completed writes. Device "cpu" runs the same code on Gloo (tests, CPU serving);
"cuda[:N]" uses ProcessGroupNCCL. It never sets environment variables and never touches the
default process group.

Emulating a one-sided write on a two-sided library:
  * pairing - ``accept(sender)`` (receiver, control thread, returns at once) starts a thread that
    offers a fresh pair id in the store (``offer/<sender>``) and waits for its claim key;
    ``connect(receiver)`` (sender) claims the offer (``add(claim/<id>) == 1``: a stale offer is
    never joined twice, and one the receiver retracted - at ``timeout_s``, or when stopped - is
    never joined at all), then both build the group (receiver rank 0, sender rank 1) within the
    connect timeout. A handshake message checks the wire version (and creates NCCL's
    communicator); a warm-up piece (``wire.WARMUP_BYTES``) then pays NCCL's first real-size
    message, the sender makes its staging ring (GPU), and the receiver, once it registered the
    pair, sends "ready": ``connect`` returns only then, so a pairing is complete on both sides
    before the first write and that write never waits on pair set-up (timings: ``pairings()``,
    logged per pair). Every accept/connect makes a NEW pair; a new pair from a known sender
    replaces its old one (a reconnect is a new Hello, so the receiver accepts again).
  * writes - the sender puts the write's header (destinations as region/offset/length, and the
    notification) into a doorbell key of the store, then sends the chunks. The receiver's pair
    thread waits on the doorbell, checks the header against its regions and asks the write guard
    (``set_write_guard``: the receive service admits only slots granted to that sender; a refused
    write ends the pair, nothing of it is received), posts one recv per
    chunk straight into the destination slot view, waits for them (deadline ``timeout_s``) and
    queues the notification. The header travels in the store rather than as a tensor so that a
    receiver never has a recv posted while idle: a Gloo recv that times out closes the pair, and
    an idle NCCL recv would trip the NCCL watchdog and hold a GPU kernel spinning.
  * ordering - one sender thread per pair posts writes in submission order (doorbell N, then its
    chunks), keeps at most ``max_inflight_writes`` posted and completes them oldest first; the
    receiver handles doorbells 0, 1, 2, ... in order. Writes are never interleaved on a pair.
  * completion - ``poll`` reads state that the sender thread sets after ``Work.wait`` (Gloo's
    ``is_completed`` stays False until someone waits). A failed or timed-out op leaves the group
    unusable: the pair is marked down, every write on it fails, ``write`` raises
    PeerUnreachable until the caller reconnects (Hello -> accept -> connect). ``abort`` (after a
    caller's own timeout) only fails the handle: a write already on the wire still completes in
    order, so its bytes and notification may arrive later; the receiver's buffer layer ignores
    notifications of cancelled requests.
  * settling - a posted send cannot be cancelled: its sources are read until it completes or
    its pair's group is aborted. ``settled(handle)`` is True once the write was never posted,
    completed, or failed AND the pair thread aborted the group (and drained its staging
    stream); every posted write settles by its deadline (``timeout_s``) plus the abort.
  * teardown - ``disconnect`` returns at once (the service thread calls it): it stops the
    pair and its thread finishes alone; ``close`` joins every thread. Writes not yet posted
    fail; posted ones finish or fail at their own deadline (their memory stays referenced
    until then). A pair ends with ``abort`` of its group, never a collective (the peer may be
    dead). The sender rings a BYE doorbell so the receiver's thread ends at once; a stopped
    receiver thread is woken through its doorbell (serving) or its claim key (pairing), and
    still receives the writes announced before (each by its deadline). A write the receiver
    admitted but could not receive whole is reported by ``get_failed_writes`` once its pair
    was torn down (group aborted, staging copies drained): nothing more of it lands. Threads
    are joined with ``close_timeout_s``; one stuck in a Gloo/NCCL wait (which cannot be
    interrupted) ends by itself at that wait's deadline.

NCCL failures stay inside one pair: before building its first NCCL group the transport makes
sure ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is 2 ("CleanUpOnly": on an async error or watchdog
timeout torch aborts the failed communicator and does not end the process; torch's default 3
ends it) and, unless set, ``TORCH_NCCL_ENABLE_MONITORING=0`` (the heartbeat monitor would
otherwise end the process if a watchdog hangs in a dead pair's abort). Both are read by each
ProcessGroupNCCL when it is constructed, so groups created earlier (vLLM's own) keep theirs;
see group.py ``nccl_env_for_pairs``.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lmcache_p2p.errors import ClosedError, PeerUnreachable, ProtocolError, TransportError, TransportTimeout
from lmcache_p2p.protocol import Region, TransportInfo
from lmcache_p2p.transport.nccl import group as group_ops
from lmcache_p2p.transport.nccl import wire
from lmcache_p2p.transport.base import Notification, Transport, WriteGuard, WriteHandle, region_of
from lmcache_p2p.transport.nccl.pairs import (
    PairingReport,
    PairSettings,
    PendingWrite,
    RecvHooks,
    RecvPair,
    SendPair,
    Stopwatch,
    flat_bytes,
    new_send_ring,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

OFFER_POLL_S = 0.01  # a sender that found an already-claimed offer looks again this often
PAIRING_REPORTS_KEPT = 64  # the latest pairings' timings that ``pairings()`` returns
FAILED_WRITES_KEPT = 4096  # failed writes kept for get_failed_writes() when nobody drains them


def _parse_device(device: str) -> Any:
    import torch

    dev = torch.device(device)
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"NCCL transport device must be 'cpu' or 'cuda[:N]', got {device!r}")
    if not torch.cuda.is_available():
        raise TransportError(f"device {device!r} asked for, but CUDA is not available (p2p.buffer_device)")
    return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())


def _claim_offer(store: Any, me: str, peer: str, deadline: float) -> str:
    """Wait for the receiver's offer to us and win it; stale (claimed) offers are skipped."""
    key = wire.offer_key(me)
    while True:
        left = group_ops.remaining_s(deadline)
        if left <= 0:
            raise PeerUnreachable(
                f"{peer} offered no pair to {me} in time: the receiver must accept() this sender for every connect()"
            )
        try:
            store.wait([key], group_ops.timedelta_s(left))
        except group_ops.dist_errors() as exc:
            if group_ops.is_store_timeout(exc):
                continue
            raise PeerUnreachable(f"lost the store of {peer} while pairing: {exc}") from exc
        pair_id = store.get(key).decode()
        if store.add(wire.claim_key(pair_id), 1) == 1:
            return pair_id
        time.sleep(OFFER_POLL_S)


# ---- the transport ---------------------------------------------------------------------------


class NcclTransport(Transport):
    """Pair groups over torch.distributed (Gloo on "cpu", NCCL on "cuda"); see the module docstring."""

    kind = "nccl"

    def __init__(
        self,
        name: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        device: str = "cpu",
        timeout_s: float = 30.0,
        close_timeout_s: float = 5.0,
        stage_slot_bytes: int = 16 << 20,
        stage_slots: int = 4,
        max_inflight_writes: int = 8,
    ) -> None:
        # Every attribute close() touches is set before anything that can fail.
        self._name = name
        self._advertise_host = advertise_host  # what peers dial (TransportInfo.host); default: host
        self._lock = threading.RLock()
        self._connect_lock = threading.Lock()
        self._closed = False
        self._store: Any = None
        self._close_timeout_s = close_timeout_s
        self._regions: list[Region] = []
        self._views: list[Any] = []  # flat uint8 view of each registered tensor (keeps it alive)
        self._notified = threading.Condition(self._lock)
        self._senders: dict[str, SendPair] = {}
        self._receivers: dict[str, RecvPair] = {}  # the serving pair of each sender
        self._recv_threads: set[RecvPair] = set()  # every live receiver pair, pairing ones included
        self._stopped: list[SendPair | RecvPair] = []  # disconnected pairs whose threads close() joins
        self._notifs: collections.deque[Notification] = collections.deque()
        self._failed: collections.deque[Notification] = collections.deque(maxlen=FAILED_WRITES_KEPT)
        self._pairings: collections.deque[PairingReport] = collections.deque(maxlen=PAIRING_REPORTS_KEPT)
        self._guard: WriteGuard | None = None
        if timeout_s <= 0 or close_timeout_s <= 0 or stage_slot_bytes <= 0 or stage_slots <= 0:
            raise ValueError("timeout_s, close_timeout_s, stage_slot_bytes and stage_slots must be positive")
        if max_inflight_writes <= 0:
            raise ValueError("max_inflight_writes must be positive")
        try:
            dev = _parse_device(device)
            self._store = group_ops.host_store(host, port, timeout_s)
            self._s = PairSettings(
                name, host, self._store.port, dev, timeout_s, stage_slot_bytes, stage_slots, max_inflight_writes
            )
            self._hooks = RecvHooks(
                self._on_paired, self._on_pair_ended, self._notify, self._slot_view, self._region_bytes, self._admit,
                self._pairings.append, self._write_failed,
            )
        except BaseException:
            self.close()
            raise
        logger.info("NCCL transport %s ready on %s (store %s:%d)", name, dev, host, self._s.port)

    # ---- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every pair, join their threads (close_timeout_s in all), stop the store. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._notified.notify_all()  # wait_notifications callers return now
            senders = list(self._senders.values())
            receivers = list(self._recv_threads)
            stopped, self._stopped = self._stopped, []
            self._senders.clear()
            self._receivers.clear()
            self._recv_threads.clear()
        for pair in senders:
            pair.stop()
        for rpair in receivers:
            self._stop_receiver(rpair)
        self._join_all([*senders, *receivers, *stopped])
        with self._lock:
            store, self._store = self._store, None  # dropping it stops the server; stragglers' waits fail
            self._notifs.clear()
            self._failed.clear()
        del store
        logger.debug("NCCL transport %s closed", self._name)

    def _join_all(self, pairs: Sequence[SendPair | RecvPair]) -> None:
        deadline = time.monotonic() + self._close_timeout_s
        for pair in pairs:
            if not pair.join(max(0.0, deadline - time.monotonic())):
                logger.warning(
                    "%s: a pair thread did not stop within %.1fs; it ends at its own deadline",
                    self._name,
                    self._close_timeout_s,
                )

    def pairings(self) -> list[PairingReport]:
        """The latest pairings' timings, oldest first, both roles (at most PAIRING_REPORTS_KEPT)."""
        return list(self._pairings)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"NCCL transport {self._name!r} is closed")

    # ---- memory -------------------------------------------------------------------------------

    def register(self, tensor: torch.Tensor) -> Region:
        """Record a contiguous tensor (host or device) as a region; a tensor inside a known one is not added."""
        region = region_of(tensor)
        with self._lock:
            self._check_open()
            self._check_device(tensor, "register")
            for known in self._regions:
                if (known.device, known.device_id) == (region.device, region.device_id) and _contains(
                    known, region.addr, region.length
                ):
                    return known
            self._regions.append(region)
            self._views.append(flat_bytes(tensor))
        logger.debug("%s registered %d bytes at 0x%x (%s)", self._name, region.length, region.addr, region.device)
        return region

    def _check_device(self, tensor: torch.Tensor, what: str) -> None:
        """NCCL moves memory of its own GPU only (host memory is staged); Gloo takes any."""
        dev = tensor.device
        if self._s.cuda and dev.type == "cuda" and dev.index != self._s.device.index:
            raise ValueError(f"cannot {what} memory on {dev}: this NCCL transport runs on {self._s.device}")

    def info(self) -> TransportInfo:
        with self._lock:
            self._check_open()
            return TransportInfo(
                kind=self.kind, name=self._name, host=self._advertise_host or self._s.host, port=self._s.port,
                regions=list(self._regions),
            )

    def _region_bytes(self) -> list[int]:
        return [r.length for r in self._regions]

    def _slot_view(self, chunk: wire.ChunkDest) -> torch.Tensor:
        return self._views[chunk.region][chunk.offset : chunk.offset + chunk.nbytes]

    # ---- receiver side --------------------------------------------------------------------------

    def set_write_guard(self, guard: WriteGuard | None) -> None:
        self._guard = guard

    def _admit(self, sender: str, header: wire.Header) -> None:
        """ProtocolError if the write guard refuses ``sender``'s write (the pair thread then ends)."""
        guard = self._guard
        if guard is None:
            return
        with self._lock:
            dests = [(self._regions[c.region].addr + c.offset, c.nbytes) for c in header.chunks]
        reason = guard(sender, dests, header.notif)
        if reason:
            raise ProtocolError(f"refused a write of {header.nbytes} bytes from {sender}: {reason}")

    def accept(self, peer: TransportInfo) -> None:
        """Start pairing with sender ``peer`` in a background thread; returns at once."""
        if peer.kind != self.kind:
            raise PeerUnreachable(f"peer {peer.name!r} speaks transport {peer.kind!r}, we speak {self.kind!r}")
        with self._lock:
            self._check_open()
            pair = RecvPair(self._hooks, self._s, peer.name)
            self._recv_threads.add(pair)
        pair.start()

    def _on_paired(self, pair: RecvPair) -> bool:
        """A receiver pair is up: it becomes its sender's pair (an older one is stopped)."""
        with self._lock:
            if self._closed or pair.stopping:
                return False
            old = self._receivers.get(pair.sender)
            self._receivers[pair.sender] = pair
        if old is not None:
            self._stop_receiver(old)
        return True

    def _on_pair_ended(self, pair: RecvPair) -> None:
        with self._lock:
            self._recv_threads.discard(pair)
            if self._receivers.get(pair.sender) is pair:
                del self._receivers[pair.sender]

    def _stop_receiver(self, pair: RecvPair) -> None:
        """Stop a receiver pair, waking its store wait through our own store client."""
        with self._lock:
            store = self._store
        pair.stop(store)

    def _notify(self, sender: str, payload: bytes) -> None:
        with self._notified:
            self._notifs.append(Notification(peer=sender, payload=payload))
            self._notified.notify_all()

    def _write_failed(self, sender: str, payload: bytes, why: str) -> None:
        with self._notified:
            self._failed.append(Notification(peer=sender, payload=payload))
            self._notified.notify_all()
        logger.debug("%s: a write from %s failed: %s", self._name, sender, why)

    def get_failed_writes(self) -> list[Notification]:
        """Writes whose receives failed or never completed, reported once their pair was torn down."""
        with self._lock:
            self._check_open()
            out = list(self._failed)
            self._failed.clear()
        return out

    def get_notifications(self) -> list[Notification]:
        with self._lock:
            self._check_open()
            out = list(self._notifs)
            self._notifs.clear()
        return out

    def wait_notifications(self, timeout_s: float) -> list[Notification]:
        """Block until a notification arrives (woken by the pair threads), or [] after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._notified:
            while not self._notifs and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._notified.wait(left)
        return self.get_notifications()

    # ---- sender side ----------------------------------------------------------------------------

    def connect(self, peer: TransportInfo, timeout_s: float) -> str:
        """Join the pair the receiver offers us (it must accept() us); PeerUnreachable after ``timeout_s``.

        Idempotent while the pair is up; a pair that went down is replaced by a new one.
        """
        if peer.kind != self.kind:
            raise PeerUnreachable(f"peer {peer.name!r} speaks transport {peer.kind!r}, we speak {self.kind!r}")
        if not peer.host or peer.port <= 0:
            raise PeerUnreachable(f"peer {peer.name!r} announced no NCCL store address ({peer.host}:{peer.port})")
        with self._connect_lock:
            with self._lock:
                self._check_open()
                old = self._senders.get(peer.name)
            if old is not None and not old.down:
                old.regions = list(peer.regions)
                return peer.name
            if old is not None:
                self._drop_sender(old)
            pair = self._join(peer, timeout_s)
            with self._lock:
                closed = self._closed
                if not closed:
                    self._senders[peer.name] = pair
            pair.start()
            if closed:
                pair.stop()  # its thread says BYE and drops the group
                raise ClosedError(f"NCCL transport {self._name!r} closed while connecting")
        logger.info("%s: connected to %s (pair %s)", self._name, peer.name, pair.pair_id)
        return peer.name

    def _join(self, peer: TransportInfo, timeout_s: float) -> SendPair:
        """Pair with ``peer`` completely before returning (eager: nothing is left for the first write):
        group and communicator, a warm-up piece, the staging ring (GPU), and the receiver's "serving"."""
        deadline = time.monotonic() + timeout_s
        store = group_ops.store_client(peer.host, peer.port, timeout_s)
        group = ring = None
        try:
            pair_id = _claim_offer(store, self._name, peer.name, deadline)
            group, ring, report = self._join_group(store, pair_id, peer.name, deadline)
            store.set_timeout(group_ops.timedelta_s(self._s.timeout_s))
        except (*group_ops.dist_errors(), TransportError) as exc:
            group_ops.drop_group(group)
            if isinstance(exc, PeerUnreachable):
                raise
            raise PeerUnreachable(f"cannot pair with {peer.name} within {timeout_s:.1f}s: {exc}") from exc
        report.log(self._name)
        self._pairings.append(report)
        return SendPair(self._s, peer, pair_id, store, group, ring)

    def _join_group(self, store: Any, pair_id: str, peer: str, deadline: float) -> tuple[Any, Any, PairingReport]:
        """Build our side (rank 1) of the pair's group on our device: handshake, warm-up, the staging
        ring (GPU only), then wait until the receiver serves the pair."""
        import torch

        on_device = torch.cuda.device(self._s.device) if self._s.cuda else contextlib.nullcontext()
        watch = Stopwatch()
        with on_device:
            join_s = max(group_ops.remaining_s(deadline), 0.001)
            group = group_ops.new_group(store, pair_id, 1, self._s.device, self._s.host, join_s, self._s.watchdog_s)
            laps = [watch.lap()]
            try:
                group_ops.handshake(group, 1, self._s.device, deadline)
                laps.append(watch.lap())
                warmed = group_ops.warm_up(group, 1, self._s.device, deadline)
                ring = new_send_ring(self._s) if self._s.cuda else None
                laps.append(watch.lap())
                group_ops.ready(group, 1, self._s.device, deadline)
                laps.append(watch.lap())
            except BaseException:
                group_ops.drop_group(group)
                raise
        return group, ring, PairingReport("sender", peer, pair_id, *laps, warmed)

    def _drop_sender(self, pair: SendPair) -> None:
        """Stop a pair that went down; its thread ends alone (close joins it)."""
        pair.stop()
        with self._lock:
            self._stopped.append(pair)

    def disconnect(self, peer: str) -> None:
        """Stop our pair(s) with ``peer`` (as sender and/or receiver) and return at once; their
        threads finish posted writes (or fail them at their deadline), abort the group and end
        alone (``close`` joins them). Unknown peers are ignored. As receiver, every pair of
        ``peer`` stops, the serving one and any still pairing (a sender that said Goodbye right
        after its Hello must not leave a pair behind)."""
        with self._lock:
            self._check_open()
            sender = self._senders.pop(peer, None)
            self._receivers.pop(peer, None)
            receivers = [p for p in self._recv_threads if p.sender == peer]
            self._stopped = [p for p in self._stopped if not p.join(0)]
            self._stopped += [p for p in (sender, *receivers) if p is not None]
        if sender is not None:
            sender.stop()
        for receiver in receivers:
            self._stop_receiver(receiver)

    # ---- writes -------------------------------------------------------------------------------

    def write(self, peer: str, srcs: Sequence[torch.Tensor], dst_addrs: Sequence[int], notif: bytes) -> WriteHandle:
        """Queue a write on the pair's sender thread; returns at once. Empty ``notif``: no notification."""
        if len(srcs) != len(dst_addrs) or not srcs:
            raise ValueError(f"write needs one destination per source, got {len(srcs)} and {len(dst_addrs)}")
        with self._lock:
            self._check_open()
            pair = self._senders.get(peer)
        if pair is None:
            raise PeerUnreachable(f"not connected to peer {peer!r}: connect() it first")
        for src in srcs:
            self._check_device(src, "write")
        chunks = tuple(_chunk_dest(pair, src, addr) for src, addr in zip(srcs, dst_addrs))
        staged = self._s.cuda and any(src.device.type == "cpu" for src in srcs)
        header = wire.Header(wire.HeaderKind.WRITE, chunks, self._s.stage_slot_bytes if staged else 0, bytes(notif))
        write = PendingWrite(peer, header, [flat_bytes(src) for src in srcs], time.monotonic() + self._s.timeout_s)
        pair.submit(write)
        return WriteHandle(peer=peer, nbytes=header.nbytes, token=(pair, write))

    def poll(self, handle: WriteHandle) -> bool:
        """True once every byte was sent and received; TransportError / TransportTimeout if it failed."""
        _, write = handle.token
        if write.error:
            cls = TransportTimeout if write.timed_out else TransportError
            raise cls(f"write of {handle.nbytes} bytes to {handle.peer} failed: {write.error}")
        if write.done:
            return True
        with self._lock:
            self._check_open()
        return False

    def wait(self, handle: WriteHandle, timeout_s: float) -> None:
        """Block (on an event the sender thread sets, no spinning) until the write finished."""
        _, write = handle.token
        if not write.finished.wait(max(timeout_s, 0.0)):
            self.abort(handle)
            raise TransportTimeout(
                f"write of {handle.nbytes} bytes to {handle.peer} not complete after {timeout_s:.1f}s "
                "(p2p.transfer_timeout_s)"
            )
        self.poll(handle)

    def abort(self, handle: WriteHandle) -> None:
        """Fail an unfinished write for its caller (see SendPair.abort); the pair stays up."""
        pair, write = handle.token
        pair.abort(write)

    def settled(self, handle: WriteHandle) -> bool:
        """True once no op reads the write's sources (see "settling" in the module docstring)."""
        _, write = handle.token
        return write.settled.is_set()


def _contains(region: Region, addr: int, nbytes: int) -> bool:
    return region.addr <= addr and addr + nbytes <= region.addr + region.length


def _chunk_dest(pair: SendPair, src: torch.Tensor, addr: int) -> wire.ChunkDest:
    """Where ``src`` lands, as (receiver region index, offset, length); ValueError outside every region."""
    nbytes = region_of(src).length
    if nbytes <= 0:
        raise ValueError("cannot write an empty tensor")
    for index, region in enumerate(pair.regions):
        if _contains(region, addr, nbytes):
            return wire.ChunkDest(index, addr - region.addr, nbytes)
    raise ValueError(f"destination 0x{addr:x} (+{nbytes} bytes) is outside every region of {pair.peer}")
