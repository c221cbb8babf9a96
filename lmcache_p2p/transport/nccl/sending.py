"""The sending side of an NcclTransport: pairing with receivers and queueing writes on the pairs.

:class:`Sender` is composed into :class:`~lmcache_p2p.transport.nccl.transport.NcclTransport`
and shares its :class:`~lmcache_p2p.transport.nccl.state.NcclState`; it owns the sender pairs.
``connect`` claims the receiver's offer and builds our side of the pair's group; writes go to
the pair's thread (``send_pair.py``). See transport.py for the whole design.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lmcache_p2p.errors import ClosedError, PeerUnreachable, TransportError, TransportTimeout
from lmcache_p2p.protocol import Region, TransportInfo
from lmcache_p2p.transport.base import WriteHandle, region_of
from lmcache_p2p.transport.nccl import group as group_ops
from lmcache_p2p.transport.nccl import wire
from lmcache_p2p.transport.nccl.pairs import (
    PairingReport,
    PairSettings,
    PendingWrite,
    SendPair,
    Stopwatch,
    flat_bytes,
    new_send_ring,
)
from lmcache_p2p.transport.nccl.state import NcclState

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

OFFER_POLL_S = 0.01  # a sender that found an already-claimed offer looks again this often


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


class Sender:
    """An NcclTransport's sending side: one SendPair (rank 1, with its thread) per receiver."""

    def __init__(self, state: NcclState, kind: str) -> None:
        self._st = state
        self._kind = kind
        self._name = state.name
        self._connect_lock = threading.Lock()  # one pairing at a time
        self._pairs: dict[str, SendPair] = {}  # receiver name -> its pair; under the state's lock

    def pair(self, peer: str) -> SendPair | None:
        with self._st.lock:
            return self._pairs.get(peer)

    def connect(self, peer: TransportInfo, timeout_s: float) -> str:
        """Join the pair the receiver offers us (it must accept() us); PeerUnreachable after ``timeout_s``.

        Idempotent while the pair is up; a pair that went down is replaced by a new one.
        """
        if peer.kind != self._kind:
            raise PeerUnreachable(f"peer {peer.name!r} speaks transport {peer.kind!r}, we speak {self._kind!r}")
        if not peer.host or peer.port <= 0:
            raise PeerUnreachable(f"peer {peer.name!r} announced no NCCL store address ({peer.host}:{peer.port})")
        with self._connect_lock:
            with self._st.lock:
                self._st.check_open()
                old = self._pairs.get(peer.name)
            if old is not None and not old.down:
                old.regions = list(peer.regions)
                return peer.name
            if old is not None:
                old.stop()  # it went down; its thread ends alone (close joins it)
                self._st.park([old])
            pair = self._join(peer, timeout_s)
            with self._st.lock:
                closed = self._st.lifecycle.closed
                if not closed:
                    self._pairs[peer.name] = pair
            pair.start()
            if closed:
                pair.stop()  # its thread says BYE and drops the group
                raise ClosedError(f"NCCL transport {self._name!r} closed while connecting")
        logger.info("%s: connected to %s (pair %s)", self._name, peer.name, pair.pair_id)
        return peer.name

    def disconnect(self, peer: str) -> SendPair | None:
        """Stop our pair to ``peer`` (returns at once; its thread ends alone); the stopped pair, if any."""
        with self._st.lock:
            pair = self._pairs.pop(peer, None)
        if pair is not None:
            pair.stop()
        return pair

    def stop_all(self) -> list[SendPair]:
        """Stop every pair (close): their threads finish posted writes and end; the caller joins them."""
        with self._st.lock:
            pairs = list(self._pairs.values())
            self._pairs.clear()
        for pair in pairs:
            pair.stop()
        return pairs

    def _join(self, peer: TransportInfo, timeout_s: float) -> SendPair:
        """Pair with ``peer`` completely before returning (eager: nothing is left for the first write):
        group and communicator, a warm-up piece, the staging ring (GPU), and the receiver's "serving"."""
        settings = self._st.check_open()
        deadline = time.monotonic() + timeout_s
        store = group_ops.store_client(peer.host, peer.port, timeout_s)
        group = ring = None
        try:
            pair_id = _claim_offer(store, self._name, peer.name, deadline)
            local = group_ops.local_address_towards(settings.host, peer.host)
            group, ring, report = self._join_group(settings, store, pair_id, peer.name, deadline, local)
            store.set_timeout(group_ops.timedelta_s(settings.timeout_s))
        except (*group_ops.dist_errors(), TransportError) as exc:
            group_ops.drop_group(group)
            if isinstance(exc, PeerUnreachable):
                raise
            raise PeerUnreachable(f"cannot pair with {peer.name} within {timeout_s:.1f}s: {exc}") from exc
        report.log(self._name)
        self._st.pairings.append(report)
        return SendPair(settings, peer, pair_id, store, group, ring)

    @staticmethod
    def _join_group(s: PairSettings, store: Any, pair_id: str, peer: str, deadline: float, local: str
                    ) -> tuple[Any, Any, PairingReport]:
        """Build our side (rank 1) of the pair's group on our device: handshake, warm-up, the staging
        ring (GPU only), then wait until the receiver serves the pair."""
        import torch

        on_device = torch.cuda.device(s.device) if s.cuda else contextlib.nullcontext()
        watch = Stopwatch()
        with on_device:
            join_s = max(group_ops.remaining_s(deadline), 0.001)
            group = group_ops.new_group(store, pair_id, 1, s.device, local, join_s, s.watchdog_s)
            laps = [watch.lap()]
            try:
                group_ops.handshake(group, 1, s.device, deadline)
                laps.append(watch.lap())
                warmed = group_ops.warm_up(group, 1, s.device, deadline)
                ring = new_send_ring(s) if s.cuda else None
                laps.append(watch.lap())
                group_ops.ready(group, 1, s.device, deadline)
                laps.append(watch.lap())
            except BaseException:
                group_ops.drop_group(group)
                raise
        return group, ring, PairingReport("sender", peer, pair_id, *laps, warmed)

    # ---- writes -------------------------------------------------------------------------------

    def write(self, peer: str, srcs: Sequence[torch.Tensor], dst_addrs: Sequence[int], notif: bytes) -> WriteHandle:
        """Queue a write on the pair's sender thread; returns at once. Empty ``notif``: no notification."""
        if len(srcs) != len(dst_addrs) or not srcs:
            raise ValueError(f"write needs one destination per source, got {len(srcs)} and {len(dst_addrs)}")
        with self._st.lock:
            s = self._st.check_open()
            pair = self._pairs.get(peer)
        if pair is None:
            raise PeerUnreachable(f"not connected to peer {peer!r}: connect() it first")
        for src in srcs:
            self._st.check_device(src, "write")
        chunks = tuple(chunk_dest(pair, src, addr) for src, addr in zip(srcs, dst_addrs))
        staged = s.cuda and any(src.device.type == "cpu" for src in srcs)
        header = wire.Header(wire.HeaderKind.WRITE, chunks, s.stage_slot_bytes if staged else 0, bytes(notif))
        write = PendingWrite(peer, header, [flat_bytes(src) for src in srcs], time.monotonic() + s.timeout_s)
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
        self._st.check_open()
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


def contains(region: Region, addr: int, nbytes: int) -> bool:
    return region.addr <= addr and addr + nbytes <= region.addr + region.length


def chunk_dest(pair: SendPair, src: torch.Tensor, addr: int) -> wire.ChunkDest:
    """Where ``src`` lands, as (receiver region index, offset, length); ValueError outside every region."""
    nbytes = region_of(src).length
    if nbytes <= 0:
        raise ValueError("cannot write an empty tensor")
    for index, region in enumerate(pair.regions):
        if contains(region, addr, nbytes):
            return wire.ChunkDest(index, addr - region.addr, nbytes)
    raise ValueError(f"destination 0x{addr:x} (+{nbytes} bytes) is outside every region of {pair.peer}")
