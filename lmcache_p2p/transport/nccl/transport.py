"""The NCCL transport: one 2-rank torch.distributed group per sender<->receiver pair, no world.

Owns: the TCPStore this instance hosts (on ``host:port``; senders find it in our TransportInfo),
one group per pair with the threads serving it, the receive regions it registered and the
notifications of completed writes. Device "cpu" runs the same code on Gloo (tests, CPU serving);
"cuda[:N]" uses ProcessGroupNCCL. It never sets environment variables and never touches the
default process group.

Shape: :class:`NcclTransport` owns one :class:`~lmcache_p2p.transport.nccl.state.NcclState`
(settings, lifecycle, lock, store, regions, pairing reports) and composes two sides that share
it: a :class:`~lmcache_p2p.transport.nccl.sending.Sender` (the sender pairs) and a
:class:`~lmcache_p2p.transport.nccl.receiving.Receiver` (the receiver pairs, the write guard,
the notifications). It implements the two-sided hooks (``transport/two_sided.py``). Building it
opens nothing; ``start()`` resolves the device and opens the TCPStore (every thread is a pair's,
started by ``accept`` / ``connect``).

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

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Self

from lmcache_p2p.config import P2PConfig
from lmcache_p2p.protocol import Region, TransportInfo
from lmcache_p2p.transport.base import Notification, Transport, WriteHandle, region_of
from lmcache_p2p.transport.lifecycle import Lifecycle
from lmcache_p2p.transport.nccl import group as group_ops
from lmcache_p2p.transport.nccl.pairs import PairingReport, RecvPair, SendPair, flat_bytes
from lmcache_p2p.transport.nccl.receiving import Receiver
from lmcache_p2p.transport.nccl.sending import Sender, contains
from lmcache_p2p.transport.nccl.state import NcclOptions, NcclState, resolve_device

if TYPE_CHECKING:
    import torch

    from lmcache_p2p.transport.two_sided import WriteGuard

logger = logging.getLogger(__name__)

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
        max_queued_writes: int = P2PConfig.nccl_max_queued_writes,
    ) -> None:
        """Records the settings (ValueError for one out of range); ``start()`` opens the store."""
        options = NcclOptions(host, port, advertise_host, device, timeout_s, close_timeout_s, stage_slot_bytes,
                              stage_slots, max_inflight_writes, max_queued_writes)
        self._state = NcclState(name, options, Lifecycle(f"NCCL transport {name!r}"))
        self._sender = Sender(self._state, self.kind)
        self._receiver = Receiver(self._state, self.kind)

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> Self:
        """Resolve the device and open our TCPStore on ``host:port``; closes and raises if that fails."""
        st, opts = self._state, self._state.options
        with st.lock:
            if not st.lifecycle.begin_start():
                return self
            try:
                device = resolve_device(opts.device)
                st.store = group_ops.host_store(opts.host, opts.port, opts.timeout_s)
                settings = st.settings = opts.pair_settings(st.name, device, st.store.port)
            except BaseException:
                self.close()
                raise
            st.lifecycle.opened()
        logger.info("NCCL transport %s ready on %s (store %s:%d)", st.name, device, opts.host, settings.port)
        return self

    def close(self) -> None:
        """Stop every pair, join their threads (close_timeout_s in all), stop the store. Idempotent."""
        st = self._state
        with st.lock:
            if not st.lifecycle.begin_close():
                return
            stopped, st.stopped = st.stopped, []
        pairs = [*self._sender.stop_all(), *self._receiver.stop_all(), *stopped]
        self._join_all(pairs)
        with st.lock:
            store, st.store = st.store, None  # dropping it stops the server; stragglers' waits fail
            self._receiver.clear()
        del store
        logger.debug("NCCL transport %s closed", st.name)

    def _join_all(self, pairs: Sequence[SendPair | RecvPair]) -> None:
        timeout_s = self._state.options.close_timeout_s
        deadline = time.monotonic() + timeout_s
        for pair in pairs:
            if not pair.join(max(0.0, deadline - time.monotonic())):
                logger.warning("%s: a pair thread did not stop within %.1fs; it ends at its own deadline",
                               self._state.name, timeout_s)

    def pairings(self) -> list[PairingReport]:
        """The latest pairings' timings, oldest first, both roles (at most PAIRING_REPORTS_KEPT)."""
        return list(self._state.pairings)

    # ---- memory and peers ---------------------------------------------------------------------

    def register(self, tensor: torch.Tensor) -> Region:
        """Record a contiguous tensor (host or device) as a region; a tensor inside a known one is not added."""
        region = region_of(tensor)
        st = self._state
        with st.lock:
            st.check_device(tensor, "register")
            for known in st.regions:
                if (known.device, known.device_id) == (region.device, region.device_id) and contains(
                    known, region.addr, region.length
                ):
                    return known
            st.regions.append(region)
            st.views.append(flat_bytes(tensor))
        logger.debug("%s registered %d bytes at 0x%x (%s)", st.name, region.length, region.addr, region.device)
        return region

    def info(self) -> TransportInfo:
        st = self._state
        with st.lock:
            settings = st.check_open()
            return TransportInfo(kind=self.kind, name=st.name, host=st.options.advertise_host or settings.host,
                                 port=settings.port, regions=list(st.regions))

    def disconnect(self, peer: str) -> None:
        """Stop our pair(s) with ``peer`` (as sender and/or receiver) and return at once; their
        threads finish posted writes (or fail them at their deadline), abort the group and end
        alone (``close`` joins them). Unknown peers are ignored."""
        self._state.check_open()
        sender = self._sender.disconnect(peer)
        receivers = self._receiver.disconnect(peer)
        self._state.park([p for p in (sender, *receivers) if p is not None])

    # ---- the sending side ---------------------------------------------------------------------

    def connect(self, peer: TransportInfo, timeout_s: float) -> str:
        return self._sender.connect(peer, timeout_s)

    def write(self, peer: str, srcs: Sequence[torch.Tensor], dst_addrs: Sequence[int], notif: bytes) -> WriteHandle:
        return self._sender.write(peer, srcs, dst_addrs, notif)

    def poll(self, handle: WriteHandle) -> bool:
        return self._sender.poll(handle)

    def wait(self, handle: WriteHandle, timeout_s: float) -> None:
        self._sender.wait(handle, timeout_s)

    def abort(self, handle: WriteHandle) -> None:
        self._sender.abort(handle)

    def settled(self, handle: WriteHandle) -> bool:
        return self._sender.settled(handle)

    # ---- the receiving side (with the two-sided hooks) ---------------------------------------

    def accept(self, peer: TransportInfo) -> None:
        self._receiver.accept(peer)

    def set_write_guard(self, guard: WriteGuard | None) -> None:
        self._receiver.set_write_guard(guard)

    def get_notifications(self) -> list[Notification]:
        return self._receiver.get_notifications()

    def wait_notifications(self, timeout_s: float) -> list[Notification]:
        return self._receiver.wait_notifications(timeout_s)

    def get_failed_writes(self) -> list[Notification]:
        return self._receiver.get_failed_writes()
