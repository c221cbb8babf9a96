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
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lmcache_p2p.errors import ClosedError, TransportError
from lmcache_p2p.protocol import Region, TransportInfo
from lmcache_p2p.transport.base import Notification, Transport, WriteGuard, region_of
from lmcache_p2p.transport.nccl import group as group_ops
from lmcache_p2p.transport.nccl.pairs import PairingReport, PairSettings, RecvHooks, RecvPair, SendPair, flat_bytes
from lmcache_p2p.transport.nccl.receiving import ReceiveSide
from lmcache_p2p.transport.nccl.sending import SendSide, contains

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

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


# ---- the transport ---------------------------------------------------------------------------


class NcclTransport(SendSide, ReceiveSide, Transport):
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
                if (known.device, known.device_id) == (region.device, region.device_id) and contains(
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
