"""Write submission for the NIXL transport: checking sources and destinations, building descriptors, posting.

:class:`Submitter` is composed into :class:`~lmcache_p2p.transport.nixl.transport.NixlTransport`
and shares its :class:`~lmcache_p2p.transport.nixl.state.NixlState` (see transport.py's module
docstring for the NIXL behaviour relied on). A write that raises was never posted; once NIXL's
``transfer`` was called it returns a handle (settle.py's :class:`Settler` takes it from there).
It is also the staging ring's port (``staging.XferPort``): the ring posts its slots through it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lmcache_p2p.errors import PeerUnreachable, TransportError
from lmcache_p2p.transport.base import WriteHandle, region_of
from lmcache_p2p.transport.nixl.records import NO_SPAN, Peer, Status, Xfer, spans_of
from lmcache_p2p.transport.nixl.settle import Settler
from lmcache_p2p.transport.nixl.staging import Row
from lmcache_p2p.transport.nixl.state import NixlState

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class Submitter:
    """A NixlTransport's write path, over the transport's shared state; posts, then hands each
    write to the Settler."""

    def __init__(self, state: NixlState, settle: Settler) -> None:
        self._st = state
        self._settle = settle

    def write(self, peer: str, srcs: Sequence[torch.Tensor], dst_addrs: Sequence[int], notif: bytes) -> WriteHandle:
        """Post ONE NIXL transfer with one descriptor per source tensor.

        A source outside every registered region is registered for this write only and
        deregistered when the write completes or is aborted. That costs a NIXL/UCX
        registration and deregistration per such tensor per write: little for host memory
        on tcp/sm (nothing is pinned), far more where UCX pins pages (RDMA, CUDA).
        Register long-lived sources (the allocator's pool) once instead.
        Host sources into the peer's GPU memory go through the staging ring when there is one.
        An empty ``notif`` sends no notification.
        """
        if len(srcs) != len(dst_addrs) or not srcs:
            raise ValueError(f"write needs one destination per source, got {len(srcs)} and {len(dst_addrs)}")
        with self._st.lock:
            agent = self._st.check_open()
            target = self._st.peers.get(peer)
            if target is None:
                raise PeerUnreachable(f"not connected to peer {peer!r}: connect() it first")
            # A ring whose every slot was given up (read for good by failed puts) is bypassed.
            if self._st.ring is not None and self._st.ring.usable and srcs[0].get_device() < 0:
                staged = self._write_staged(target, srcs, dst_addrs, notif)
                if staged is not None:
                    return staged
            # Destinations first: a refused one must not leave a source registered for nothing.
            dst_rows, dst_mem = self._dest_rows(target, [(0, src.nbytes, 0) for src in srcs], dst_addrs)
            src_rows, src_mem, temp = self._source_rows(agent, srcs)
            xfer = Xfer(peer, None, temp)
            try:
                self._post(agent, xfer, src_rows, src_mem, dst_rows, dst_mem, notif)
            except BaseException:
                self._settle.release(agent, xfer, "post failed", ended=True)  # raised before anything was posted
                raise
            nbytes = sum(row[1] for row in src_rows)
            if xfer.xfer is not None:  # posted, neither DONE nor given up yet
                self._st.inflight[id(xfer)] = xfer
        return WriteHandle(peer=peer, nbytes=nbytes, token=xfer)

    def _write_staged(self, target: Peer, srcs: Sequence[torch.Tensor], dst_addrs: Sequence[int],
                      notif: bytes) -> WriteHandle | None:
        """Host sources into the peer's VRAM go through the ring; None when the destination is host memory."""
        for src in srcs:
            if src.get_device() >= 0 or not src.is_contiguous():
                raise ValueError("the sources of one write must be contiguous and on one device")
        dst_rows, dst_mem = self._dest_rows(target, [(0, src.nbytes, 0) for src in srcs], dst_addrs)
        if dst_mem != "VRAM":
            return None
        write = self._st.ring.submit(target.name, srcs, dst_rows, notif)
        return WriteHandle(peer=target.name, nbytes=write.nbytes, token=write)

    def _source_rows(self, agent: Any, srcs: Sequence[torch.Tensor]) -> tuple[list[tuple[int, int, int]], str, list]:
        """(addr, len, device id) per source; registers sources outside our regions (temporarily).

        The hot loop of a write (one pass per chunk): plain tensor accessors, no Region objects.
        """
        device = srcs[0].get_device()  # -1: host memory
        spans = [s for s in spans_of(reg.region for reg in self._st.regs) if s.device == device]
        device_id = max(device, 0)
        rows: list[tuple[int, int, int]] = []
        missing: dict[tuple[int, int], torch.Tensor] = {}
        hit = NO_SPAN
        for src in srcs:
            if src.get_device() != device or not src.is_contiguous():
                raise ValueError("the sources of one write must be contiguous and on one device")
            addr, nbytes = src.data_ptr(), src.nbytes
            rows.append((addr, nbytes, device_id))
            if not hit.holds(addr, nbytes):
                hit = next((s for s in spans if s.holds(addr, nbytes)), NO_SPAN)
                if hit is NO_SPAN:
                    missing.setdefault((addr, nbytes), src)
        temp = self._st.register_regions(agent, [region_of(t) for t in missing.values()]) if missing else []
        if temp:
            logger.debug("%s registered %d unregistered source(s) for one write", self._st.name, len(temp))
        return rows, "DRAM" if device < 0 else "VRAM", temp

    def _dest_rows(
        self, peer: Peer, src_rows: Sequence[tuple[int, int, int]], dst_addrs: Sequence[int]
    ) -> tuple[list[tuple[int, int, int]], str]:
        """Remote descriptors built from the peer's Region rows (never from pickled descriptors)."""
        rows: list[tuple[int, int, int]] = []
        first = hit = NO_SPAN
        for (_, nbytes, _), addr in zip(src_rows, dst_addrs):
            if not hit.holds(addr, nbytes):
                hit = next((s for s in peer.spans if s.holds(addr, nbytes)), NO_SPAN)
                if hit is NO_SPAN:
                    raise ValueError(f"destination 0x{addr:x} (+{nbytes} bytes) is outside every region of {peer.name}")
                if first is NO_SPAN:
                    first = hit
                elif hit.mem != first.mem:
                    raise ValueError(f"the destinations of one write must be one memory type ({peer.name})")
            rows.append((addr, nbytes, hit.device_id))
        return rows, first.mem

    def _post(self, agent: Any, xfer: Xfer, src_rows: list, src_mem: str, dst_rows: list, dst_mem: str,
              notif: bytes) -> None:
        """Post ``xfer``; raises only before anything was posted. A failure from ``transfer`` on
        gives the write up (some of its puts may have started)."""
        what = f"a write of {len(src_rows)} chunk(s) to {xfer.peer}"
        try:
            local = agent.get_xfer_descs(src_rows, src_mem)
            remote = agent.get_xfer_descs(dst_rows, dst_mem)
            xfer.xfer = agent.initialize_xfer("WRITE", local, remote, xfer.peer, notif)
        except self._st.disconnected as exc:
            raise PeerUnreachable(f"peer {xfer.peer} disconnected; {what} not posted") from exc
        except self._st.errors as exc:
            raise TransportError(f"NIXL could not prepare {what}: {exc}") from exc
        try:
            status = Status(agent.transfer(xfer.xfer))
        except self._st.errors as exc:
            self._settle.give_up(agent, xfer, f"NIXL failed to post {what}: {exc}", isinstance(exc, self._st.disconnected))
            return
        if status is Status.ERR:
            self._settle.give_up(agent, xfer, f"NIXL reported ERR posting {what}")
        elif status is Status.DONE:
            self._settle.finish(agent, xfer)

    def post_staged(self, peer: str, src_rows: list[Row], dst_rows: list[Row], notif: bytes) -> Xfer:
        """One VRAM -> VRAM transfer out of a ring slot."""
        agent = self._st.check_open()
        if peer not in self._st.peers:
            raise PeerUnreachable(f"peer {peer} disconnected before a staged write was posted")
        xfer = Xfer(peer, None, [])
        try:
            self._post(agent, xfer, src_rows, "VRAM", dst_rows, "VRAM", notif)
        except BaseException:
            self._settle.release(agent, xfer, "post failed", ended=True)  # raised before anything was posted
            raise
        if xfer.xfer is not None:
            self._st.inflight[id(xfer)] = xfer
        return xfer

    # The rest of the ring's port: the Settler's answers about a staged transfer.
    def staged_done(self, xfer: Xfer) -> bool:
        return self._settle.staged_done(xfer)

    def staged_given_up(self, xfer: Xfer) -> tuple[str, bool] | None:
        return self._settle.staged_given_up(xfer)

    def drop_staged(self, xfer: Xfer) -> None:
        self._settle.drop_staged(xfer)
