"""The NIXL transport: one-sided UCX writes from local tensors into a peer's registered memory.

Owns one NIXL agent (progress thread OFF: we poll, always with a deadline), its UCX backend, the
memory it registered, the remote agents it loaded and the writes in flight. It never sets
environment variables: the UCX transport is chosen by the caller's ``UCX_TLS`` /
``UCX_NET_DEVICES`` (``tcp,self`` + ``lo``; ``sm,self``; ``cuda_ipc`` on GPUs).

What crosses the wire is :class:`TransportInfo`: the agent metadata blob (parsed by NIXL itself)
and our registered regions as plain (address, length, device) rows. Remote descriptors are built
locally from those rows; NIXL's pickle-based ``get_serialized_descs``/``deserialize_descs`` are
never used.

NIXL/UCX behaviour this module relies on or works around (nixl 1.5.1; see shared/FACTS.md):
  * ``UCX_TLS=sm,self`` fails to create the backend unless ``ucx_error_handling_mode`` is
    ``none``; ``none`` also works for tcp, so it is the default. Even so, a peer that died is
    seen (NIXL_ERR_REMOTE_DISCONNECT -> :class:`PeerUnreachable`): at post, or by ``poll`` for
    a write already in flight (seen within ~30 ms on tcp and sm here).
  * UCX sm moves host bytes with CMA (process_vm_writev) INSIDE ``write``: the caller's thread
    does the copy (the GIL is released meanwhile) and the handle is usually done at once.
    CMA throughput roughly doubles when the receiver's buffer (and the sources) are backed by
    transparent huge pages (madvise(MADV_HUGEPAGE)); see bench/transfer.py.
  * UCX tcp with the progress thread off: a receiver only takes bytes in while it polls
    (``get_notifications``), so a receiver that stops polling stalls its senders' writes.
  * The receiver needs no metadata of its senders to get their notifications.
  * ``add_remote_agent`` returns bytes; ``get_new_notifs`` keys its dict by str; statuses are
    the strings "DONE" / "PROC" / "ERR", wrapped in :class:`_Status` here.
  * No write can be recalled. ``release_xfer_handle`` on an active transfer makes the UCX
    backend call ``ucp_request_cancel`` (which UCX honours for receives, not for RMA puts) and
    free the request, then reports success: the put may go on reading its source with nobody
    left to tell when it stops. And once a remote agent is removed, ``check_xfer_state`` on a
    transfer to it only answers NOT_FOUND. So ``abort`` never releases an active transfer: it
    fails the handle for the caller and keeps polling it; the write is ``settled`` once NIXL
    reports it DONE (UCX completed every request). ``disconnect`` keeps the peer's agent
    loaded until its writes in flight settled (then removes it). ``close`` (or a reconnect
    under the same name) gives up on an unsettled write: it never settles, so its caller keeps
    the memory.
  * ERR does not mean the transfer ended: the UCX backend's handle status returns the first
    failed request's error without looking at the transfer's other puts, and keeps answering
    ERR while they run. Nothing in NIXL tells when they stop, so a write that NIXL failed (at
    post, on a state check, or a state check that raised) is given up like one at ``close``:
    failed for its caller, never settled (its sources and temporary registrations stay in use,
    a staging ring slot it read stays busy for the process's life), counted in ``given_up``
    and logged. A write that raises was never posted; once ``transfer`` was called it returns
    a handle, failed or not.

Host sources into a peer's GPU memory go through a :class:`~lmcache_p2p.transport.nixl.staging.StagingRing`
on the sender's own GPU when the transport is built with ``stage_device`` (UCX alone moves them at
~0.6 GB/s; staged, they move at PCIe speed): see staging.py. Every other combination (device
or host sources, host or device destinations) is one NIXL transfer with one descriptor per chunk.

Threads: every call into the agent holds one lock (the agent is created without NIXL's own
locking), so writes, polls and notification polls may come from different threads.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from lmcache_p2p.errors import ClosedError, PeerUnreachable, TransportError
from lmcache_p2p.protocol import Region, TransportInfo
from lmcache_p2p.transport.base import Notification, Transport, WriteHandle, region_of
from lmcache_p2p.transport.nixl.staging import Row, StagedWrite, StagingRing

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

BACKEND = "UCX"
DEFAULT_BACKEND_PARAMS: Mapping[str, str] = {"ucx_error_handling_mode": "none"}


class _Status(enum.Enum):
    """NIXL's transfer statuses, wrapped at the edge."""

    DONE = "DONE"
    PROC = "PROC"
    ERR = "ERR"


def _mem_type(region: Region) -> str:
    return "VRAM" if region.device == "cuda" else "DRAM"


class _Span(NamedTuple):
    """A registered region as the write loop checks it: [lo, hi) on ``device`` (-1: host)."""

    lo: int
    hi: int
    device: int
    device_id: int
    mem: str

    def holds(self, addr: int, nbytes: int) -> bool:
        return self.lo <= addr and addr + nbytes <= self.hi


_NO_SPAN = _Span(0, 0, -2, 0, "")


def _span(r: Region) -> _Span:
    return _Span(r.addr, r.addr + r.length, r.device_id if r.device == "cuda" else -1, r.device_id, _mem_type(r))


def _spans(regions: Iterable[Region]) -> list[_Span]:
    return [_span(r) for r in regions]


@dataclasses.dataclass
class _Registration:
    region: Region
    descs: Any  # nixlRegDList, handed back to deregister_memory
    tensor: torch.Tensor | None  # keeps registered memory alive while NIXL may touch it


@dataclasses.dataclass
class _Peer:
    name: str
    metadata: bytes
    spans: list[_Span]  # the peer's registered regions: where writes may land


@dataclasses.dataclass
class _Xfer:
    """The mutable state behind a WriteHandle's token."""

    peer: str
    xfer: Any  # nixl_xfer_handle, None once released
    temp: list[_Registration]  # sources registered for this write only
    done: bool = False
    error: str = ""
    unreachable: bool = False  # the failure was the peer going away
    settled: bool = False  # NIXL reported the transfer DONE, or it was never posted: nothing reads the sources
    given_up: bool = False  # failed while its puts may still read: it never settles


def _nixl_error_types(bindings: Any) -> tuple[type[BaseException], ...]:
    """Every exception class NIXL's bindings raise (nixlBackendError, nixlNotFoundError, ...)."""
    found = [
        obj
        for name, obj in vars(bindings).items()
        if name.startswith("nixl") and name.endswith("Error") and isinstance(obj, type)
    ]
    return (*found, RuntimeError)


class NixlTransport(Transport):
    """A NIXL agent with a UCX backend; see the module docstring."""

    kind = "nixl"

    def __init__(
        self,
        name: str,
        *,
        backend_params: Mapping[str, str] | None = None,
        stage_device: str | None = None,
        stage_slot_bytes: int = 16 << 20,
        stage_slots: int = 4,
    ) -> None:
        """``stage_device`` ("cuda:N", the sender's own GPU) enables the staging ring for host
        sources written into a peer's GPU memory (``stage_slots`` x ``stage_slot_bytes`` of VRAM)."""
        # Every attribute close() touches is set before anything that can fail.
        self._name = name
        self._lock = threading.RLock()
        self._closed = False
        self._agent: Any = None
        self._errors: tuple[type[BaseException], ...] = (RuntimeError,)
        self._disconnected: tuple[type[BaseException], ...] = ()
        self._regs: list[_Registration] = []
        self._peers: dict[str, _Peer] = {}
        self._inflight: dict[int, _Xfer] = {}  # posted and not yet settled (aborted ones included)
        self._retiring: set[str] = set()  # disconnected peers whose agents stay until their writes settled
        self._leaked: list[_Registration] = []  # temp sources of writes NIXL refused to cancel
        self.given_up = 0  # writes NIXL failed while their puts may still read: never settled
        self._ring: StagingRing | None = None
        params = dict(DEFAULT_BACKEND_PARAMS if backend_params is None else backend_params)
        try:
            self._agent = self._create_agent(name, params)
            if stage_device is not None:
                self._ring = self._create_ring(stage_device, stage_slot_bytes, stage_slots)
        except BaseException:
            self.close()
            raise
        logger.info("NIXL transport %s ready (UCX params %s, staging %s)", name, params,
                    f"{stage_slots} x {stage_slot_bytes} bytes on {stage_device}" if self._ring else "off")

    # ---- lifecycle ----------------------------------------------------------------------------

    def _create_agent(self, name: str, params: dict[str, str]) -> Any:
        try:
            import nixl
        except ImportError as exc:
            raise TransportError("nixl is not importable: install nixl==1.5.1 (pyproject dependencies)") from exc
        self._errors = _nixl_error_types(nixl._bindings)
        gone = getattr(nixl._bindings, "nixlRemoteDisconnectError", None)
        self._disconnected = (gone,) if isinstance(gone, type) else ()
        try:
            agent = nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=False, backends=[]))
        except self._errors as exc:
            raise TransportError(f"cannot create NIXL agent {name!r}: {exc}") from exc
        try:
            agent.create_backend(BACKEND, params)
        except self._errors as exc:
            raise TransportError(
                f"cannot create NIXL's UCX backend with params {params} for agent {name!r} "
                "(check UCX_TLS / UCX_NET_DEVICES; UCX_TLS=sm needs ucx_error_handling_mode=none)"
            ) from exc
        return agent

    def _create_ring(self, device: str, slot_bytes: int, slots: int) -> StagingRing:
        import torch

        dev = torch.device(device)
        if dev.type != "cuda" or not torch.cuda.is_available():
            raise TransportError(f"staging device {device!r} is not a usable CUDA device (stage_device)")
        dev = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
        ring = StagingRing(dev, slot_bytes, slots, self)
        self.register(ring.buffer)
        return ring

    def close(self) -> None:
        """Abort writes in flight, forget peers, deregister memory, drop the agent. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            agent, self._agent = self._agent, None
            if agent is None:
                return
            if self._ring is not None:
                self._ring.close()
            unsettled = list(self._inflight.values())
            for xfer in unsettled:
                self._release(agent, xfer, "transport closed", ended=False)
            if unsettled:
                logger.warning("%s closed with %d write(s) in flight: they never settle (their sources stay "
                               "referenced by their callers)", self._name, len(unsettled))
            for peer in [*self._peers, *self._retiring]:
                self._remove_remote(agent, peer)
            self._peers.clear()
            self._retiring.clear()
            for reg in self._regs + self._leaked:
                self._deregister(agent, reg)
            self._regs.clear()
            self._leaked.clear()
        logger.debug("NIXL transport %s closed", self._name)

    def _check_open(self) -> Any:
        if self._closed or self._agent is None:
            raise ClosedError(f"NIXL transport {self._name!r} is closed")
        return self._agent

    # ---- memory -------------------------------------------------------------------------------

    def register(self, tensor: torch.Tensor) -> Region:
        """Register ``tensor``'s bytes once (DRAM for host tensors, VRAM with its device id).

        A tensor inside an already registered one is not registered again: the enclosing region
        is returned. The transport keeps a reference to each registered tensor until ``close``.
        """
        region = region_of(tensor)
        wanted = _span(region)
        with self._lock:
            agent = self._check_open()
            for reg in self._regs:
                span = _span(reg.region)
                if span.device == wanted.device and span.holds(region.addr, region.length):
                    return reg.region  # already registered (the same tensor, or one inside it)
            reg = self._register_regions(agent, [region])[0]
            reg.tensor = tensor
            self._regs.append(reg)
        logger.debug("%s registered %d bytes at 0x%x (%s:%d)", self._name, region.length, region.addr,
                     region.device, region.device_id)
        return region

    def _register_regions(self, agent: Any, regions: Sequence[Region]) -> list[_Registration]:
        """One NIXL registration per region, so that each can be deregistered on its own."""
        done: list[_Registration] = []
        try:
            for region in regions:
                descs = agent.get_reg_descs([(region.addr, region.length, region.device_id, "")], _mem_type(region))
                agent.register_memory(descs, backends=[BACKEND])
                done.append(_Registration(region, descs, None))
        except self._errors as exc:
            for reg in done:
                self._deregister(agent, reg)
            raise TransportError(
                f"NIXL could not register {_mem_type(region)} memory 0x{region.addr:x} (+{region.length} bytes): {exc}"
            ) from exc
        return done

    def _deregister(self, agent: Any, reg: _Registration) -> None:
        try:
            agent.deregister_memory(reg.descs, backends=[BACKEND])
        except self._errors:
            logger.warning("%s: NIXL failed to deregister 0x%x (+%d bytes)", self._name, reg.region.addr,
                           reg.region.length, exc_info=True)

    def info(self) -> TransportInfo:
        """Our agent metadata and registered regions; publish it after the last ``register``."""
        with self._lock:
            agent = self._check_open()
            try:
                metadata = agent.get_agent_metadata()
            except self._errors as exc:
                raise TransportError(f"NIXL could not export metadata of {self._name!r}: {exc}") from exc
            regions = [reg.region for reg in self._regs]
        return TransportInfo(kind=self.kind, name=self._name, metadata=bytes(metadata), regions=regions)

    # ---- peers --------------------------------------------------------------------------------

    def connect(self, peer: TransportInfo, timeout_s: float) -> str:
        """Load the peer's agent metadata (local work only: UCX connects on the first write).

        Idempotent; new metadata under a known name (the peer restarted or registered more
        memory) replaces the old. ``timeout_s`` bounds nothing here: nothing waits.
        """
        if peer.kind != self.kind:
            raise PeerUnreachable(f"peer {peer.name!r} speaks transport {peer.kind!r}, we speak {self.kind!r}")
        with self._lock:
            agent = self._check_open()
            if peer.name in self._retiring:
                self._give_up_retiring(agent, peer.name)
            known = self._peers.get(peer.name)
            if known is not None and known.metadata == peer.metadata:
                known.spans = _spans(peer.regions)
                return known.name
            if known is not None:
                self._forget_peer(agent, peer.name)
            try:
                loaded = agent.add_remote_agent(peer.metadata)
            except self._errors as exc:
                raise PeerUnreachable(
                    f"NIXL rejected the metadata of peer {peer.name!r} ({len(peer.metadata)} bytes): {exc}"
                ) from exc
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if name != peer.name:
                self._remove_remote(agent, name)
                raise PeerUnreachable(f"peer announced itself as {peer.name!r} but its NIXL agent is {name!r}")
            self._peers[name] = _Peer(name, bytes(peer.metadata), _spans(peer.regions))
        logger.debug("%s connected to %s (%d regions)", self._name, name, len(peer.regions))
        return name

    def disconnect(self, peer: str) -> None:
        """Abort our writes to ``peer`` and unload its agent; unknown peers are ignored."""
        with self._lock:
            agent = self._check_open()
            self._forget_peer(agent, peer)

    def _forget_peer(self, agent: Any, peer: str) -> None:
        """Fail our writes to ``peer``; unload its agent now, or once its writes in flight settled."""
        if self._peers.pop(peer, None) is None:
            return
        if self._ring is not None:
            self._ring.fail_peer(peer, f"peer {peer} disconnected")
        live = [x for x in self._inflight.values() if x.peer == peer]
        for xfer in live:
            if not xfer.done and not xfer.error:
                xfer.error = f"peer {peer} disconnected"
        if live:
            self._retiring.add(peer)  # NIXL cannot report on a write to an agent it no longer knows
        else:
            self._remove_remote(agent, peer)

    def _reap_retiring(self, agent: Any) -> None:
        """Advance writes to disconnected peers; unload each peer whose writes all settled."""
        for peer in list(self._retiring):
            for xfer in [x for x in self._inflight.values() if x.peer == peer and x.xfer is not None]:
                self._advance(agent, xfer)
            if not any(x.peer == peer for x in self._inflight.values()):
                self._retiring.discard(peer)
                self._remove_remote(agent, peer)

    def _give_up_retiring(self, agent: Any, peer: str) -> None:
        """``peer`` reconnects under the same name before its old writes settled: they never will."""
        stuck = [x for x in self._inflight.values() if x.peer == peer]
        for xfer in stuck:
            self._release(agent, xfer, f"peer {peer} reconnected", ended=False)
        logger.warning("%s: %s reconnected with %d old write(s) still in flight; they never settle", self._name,
                       peer, len(stuck))
        self._retiring.discard(peer)
        self._remove_remote(agent, peer)

    def _remove_remote(self, agent: Any, name: str) -> None:
        try:
            agent.remove_remote_agent(name)
        except self._errors:
            logger.warning("%s: NIXL failed to remove remote agent %s", self._name, name, exc_info=True)

    # ---- writes -------------------------------------------------------------------------------

    def write(self, peer: str, srcs: Sequence[torch.Tensor], dst_addrs: Sequence[int], notif: bytes) -> WriteHandle:
        """Post ONE NIXL transfer with one descriptor per source tensor.

        A source outside every registered region is registered for this write only and
        deregistered when the write completes or is aborted. That costs a NIXL/UCX
        registration and deregistration per such tensor per write: ~5 us for host memory
        on tcp/sm (measured; nothing is pinned), far more where UCX pins pages (RDMA, CUDA).
        Register long-lived sources (the allocator's pool) once instead.
        Host sources into the peer's GPU memory go through the staging ring when there is one.
        An empty ``notif`` sends no notification.
        """
        if len(srcs) != len(dst_addrs) or not srcs:
            raise ValueError(f"write needs one destination per source, got {len(srcs)} and {len(dst_addrs)}")
        with self._lock:
            agent = self._check_open()
            target = self._peers.get(peer)
            if target is None:
                raise PeerUnreachable(f"not connected to peer {peer!r}: connect() it first")
            # A ring whose every slot was given up (read for good by failed puts) is bypassed.
            if self._ring is not None and self._ring.usable and srcs[0].get_device() < 0:
                staged = self._write_staged(target, srcs, dst_addrs, notif)
                if staged is not None:
                    return staged
            # Destinations first: a refused one must not leave a source registered for nothing.
            dst_rows, dst_mem = self._dest_rows(target, [(0, src.nbytes, 0) for src in srcs], dst_addrs)
            src_rows, src_mem, temp = self._source_rows(agent, srcs)
            xfer = _Xfer(peer, None, temp)
            try:
                self._post(agent, xfer, src_rows, src_mem, dst_rows, dst_mem, notif)
            except BaseException:
                self._release(agent, xfer, "post failed", ended=True)  # raised before anything was posted
                raise
            nbytes = sum(row[1] for row in src_rows)
            if xfer.xfer is not None:  # posted, neither DONE nor given up yet
                self._inflight[id(xfer)] = xfer
        return WriteHandle(peer=peer, nbytes=nbytes, token=xfer)

    def _write_staged(self, target: _Peer, srcs: Sequence[torch.Tensor], dst_addrs: Sequence[int],
                      notif: bytes) -> WriteHandle | None:
        """Host sources into the peer's VRAM go through the ring; None when the destination is host memory."""
        for src in srcs:
            if src.get_device() >= 0 or not src.is_contiguous():
                raise ValueError("the sources of one write must be contiguous and on one device")
        dst_rows, dst_mem = self._dest_rows(target, [(0, src.nbytes, 0) for src in srcs], dst_addrs)
        if dst_mem != "VRAM":
            return None
        write = self._ring.submit(target.name, srcs, dst_rows, notif)
        return WriteHandle(peer=target.name, nbytes=write.nbytes, token=write)

    def _source_rows(self, agent: Any, srcs: Sequence[torch.Tensor]) -> tuple[list[tuple[int, int, int]], str, list]:
        """(addr, len, device id) per source; registers sources outside our regions (temporarily).

        The hot loop of a write (one pass per chunk): plain tensor accessors, no Region objects.
        """
        device = srcs[0].get_device()  # -1: host memory
        spans = [s for s in _spans(reg.region for reg in self._regs) if s.device == device]
        device_id = max(device, 0)
        rows: list[tuple[int, int, int]] = []
        missing: dict[tuple[int, int], torch.Tensor] = {}
        hit = _NO_SPAN
        for src in srcs:
            if src.get_device() != device or not src.is_contiguous():
                raise ValueError("the sources of one write must be contiguous and on one device")
            addr, nbytes = src.data_ptr(), src.nbytes
            rows.append((addr, nbytes, device_id))
            if not hit.holds(addr, nbytes):
                hit = next((s for s in spans if s.holds(addr, nbytes)), _NO_SPAN)
                if hit is _NO_SPAN:
                    missing.setdefault((addr, nbytes), src)
        temp = self._register_regions(agent, [region_of(t) for t in missing.values()]) if missing else []
        if temp:
            logger.debug("%s registered %d unregistered source(s) for one write", self._name, len(temp))
        return rows, "DRAM" if device < 0 else "VRAM", temp

    def _dest_rows(
        self, peer: _Peer, src_rows: Sequence[tuple[int, int, int]], dst_addrs: Sequence[int]
    ) -> tuple[list[tuple[int, int, int]], str]:
        """Remote descriptors built from the peer's Region rows (never from pickled descriptors)."""
        rows: list[tuple[int, int, int]] = []
        first = hit = _NO_SPAN
        for (_, nbytes, _), addr in zip(src_rows, dst_addrs):
            if not hit.holds(addr, nbytes):
                hit = next((s for s in peer.spans if s.holds(addr, nbytes)), _NO_SPAN)
                if hit is _NO_SPAN:
                    raise ValueError(f"destination 0x{addr:x} (+{nbytes} bytes) is outside every region of {peer.name}")
                if first is _NO_SPAN:
                    first = hit
                elif hit.mem != first.mem:
                    raise ValueError(f"the destinations of one write must be one memory type ({peer.name})")
            rows.append((addr, nbytes, hit.device_id))
        return rows, first.mem

    def _post(self, agent: Any, xfer: _Xfer, src_rows: list, src_mem: str, dst_rows: list, dst_mem: str,
              notif: bytes) -> None:
        """Post ``xfer``; raises only before anything was posted. A failure from ``transfer`` on
        gives the write up (some of its puts may have started)."""
        what = f"a write of {len(src_rows)} chunk(s) to {xfer.peer}"
        try:
            local = agent.get_xfer_descs(src_rows, src_mem)
            remote = agent.get_xfer_descs(dst_rows, dst_mem)
            xfer.xfer = agent.initialize_xfer("WRITE", local, remote, xfer.peer, notif)
        except self._disconnected as exc:
            raise PeerUnreachable(f"peer {xfer.peer} disconnected; {what} not posted") from exc
        except self._errors as exc:
            raise TransportError(f"NIXL could not prepare {what}: {exc}") from exc
        try:
            status = _Status(agent.transfer(xfer.xfer))
        except self._errors as exc:
            self._give_up(agent, xfer, f"NIXL failed to post {what}: {exc}", isinstance(exc, self._disconnected))
            return
        if status is _Status.ERR:
            self._give_up(agent, xfer, f"NIXL reported ERR posting {what}")
        elif status is _Status.DONE:
            self._finish(agent, xfer)

    def poll(self, handle: WriteHandle) -> bool:
        """True once the write completed (its handle is then released); TransportError if it failed."""
        if isinstance(handle.token, StagedWrite):
            return self._poll_staged(handle, handle.token)
        xfer: _Xfer = handle.token
        with self._lock:
            agent = self._check_open()
            if not xfer.done and not xfer.error:
                self._advance(agent, xfer)
        if xfer.error:
            error = PeerUnreachable if xfer.unreachable else TransportError
            raise error(f"write of {handle.nbytes} bytes to {handle.peer} failed: {xfer.error}")
        return xfer.done

    def _advance(self, agent: Any, xfer: _Xfer) -> None:
        """Ask NIXL for the state of ``xfer``; finish it on DONE, give it up on ERR or a failed check."""
        try:
            status = _Status(agent.check_xfer_state(xfer.xfer))
        except self._errors as exc:
            self._give_up(agent, xfer, f"state check failed: {exc}", isinstance(exc, self._disconnected))
            return
        if status is _Status.DONE:
            self._finish(agent, xfer)
        elif status is _Status.ERR:
            self._give_up(agent, xfer, "NIXL reported ERR")

    def _poll_staged(self, handle: WriteHandle, write: StagedWrite) -> bool:
        with self._lock:
            self._check_open()
            if not write.finished:
                self._ring.pump()
        if write.error:
            error = PeerUnreachable if write.unreachable else TransportError
            raise error(f"write of {handle.nbytes} bytes to {handle.peer} failed: {write.error}")
        return write.done

    def abort(self, handle: WriteHandle) -> None:
        """Fail an unfinished write for its caller; it stays in flight until NIXL finishes it
        (see the module docstring: NIXL cannot recall a put), so poll ``settled``."""
        with self._lock:
            if isinstance(handle.token, StagedWrite):
                if self._ring is not None and not handle.token.finished:
                    self._ring.abort(handle.token, "aborted")
                return
            xfer: _Xfer = handle.token
            if not xfer.done and not xfer.error:
                xfer.error = "aborted"

    def settled(self, handle: WriteHandle) -> bool:
        """True once NIXL reported the write finished (DONE or ERR); advances it if need be."""
        with self._lock:
            agent = self._agent
            if isinstance(handle.token, StagedWrite):
                write: StagedWrite = handle.token
                if agent is not None and self._ring is not None and not write.settled:
                    self._ring.pump()
                return write.settled
            xfer: _Xfer = handle.token
            if agent is not None and not xfer.settled and xfer.xfer is not None:
                self._advance(agent, xfer)
            if agent is not None and self._retiring:
                self._reap_retiring(agent)
            return xfer.settled

    # ---- the staging ring's port (called by StagingRing under our lock) ---------------------------

    def post_staged(self, peer: str, src_rows: list[Row], dst_rows: list[Row], notif: bytes) -> _Xfer:
        """One VRAM -> VRAM transfer out of a ring slot."""
        agent = self._check_open()
        if peer not in self._peers:
            raise PeerUnreachable(f"peer {peer} disconnected before a staged write was posted")
        xfer = _Xfer(peer, None, [])
        try:
            self._post(agent, xfer, src_rows, "VRAM", dst_rows, "VRAM", notif)
        except BaseException:
            self._release(agent, xfer, "post failed", ended=True)  # raised before anything was posted
            raise
        if xfer.xfer is not None:
            self._inflight[id(xfer)] = xfer
        return xfer

    def staged_done(self, xfer: _Xfer) -> bool:
        """True once the transfer completed; TransportError once it failed AND nothing reads its slot.

        A transfer failed for its caller while still on the wire (its peer disconnected) keeps
        reading its ring slot until NIXL reports DONE: False until then, so the ring does not
        refill the slot under it. One given up (ERR, close, a reconnect) never ends: see
        ``staged_given_up``.
        """
        if not xfer.settled and xfer.xfer is not None and self._agent is not None:
            self._advance(self._agent, xfer)
        if xfer.error:
            if not xfer.settled:
                return False
            raise TransportError(f"staged write to {xfer.peer} failed: {xfer.error}")
        return xfer.done

    def staged_given_up(self, xfer: _Xfer) -> tuple[str, bool] | None:
        """(why, peer unreachable) once ``xfer`` was given up (its slot may be read for good), else None."""
        return (xfer.error, xfer.unreachable) if xfer.given_up else None

    def drop_staged(self, xfer: _Xfer) -> None:
        """The ring closes with ``xfer`` reading one of its slots (ring memory, not a caller's)."""
        if not xfer.settled and xfer.xfer is not None and self._agent is not None:
            self._release(self._agent, xfer, "aborted", ended=False)

    def _give_up(self, agent: Any, xfer: _Xfer, error: str, unreachable: bool = False) -> None:
        """NIXL failed ``xfer`` but may still run its other puts: fail it, never settle it."""
        if not xfer.done and not xfer.error:
            xfer.unreachable = unreachable
        self._release(agent, xfer, error, ended=False)
        self.given_up += 1
        logger.warning("%s: a write to %s failed (%s) while NIXL may still read its sources: it never settles, its "
                       "memory stays in use (%d write(s) given up so far)", self._name, xfer.peer, error, self.given_up)

    def _finish(self, agent: Any, xfer: _Xfer) -> None:
        self._release(agent, xfer, "", ended=True)
        xfer.done = True

    def _release(self, agent: Any, xfer: _Xfer, error: str, *, ended: bool) -> None:
        """Free the NIXL handle and the write's temporary registrations; record ``error`` if any.

        ``ended``: NIXL reported the transfer DONE (or it was never posted), so nothing reads its
        sources and the write is settled. Otherwise (ERR, close, a reconnect) NIXL only attempts a
        cancel: the sources may still be read, the write never settles and its temporary
        registrations stay until close.
        """
        self._inflight.pop(id(xfer), None)
        if error and not xfer.done and not xfer.error:
            xfer.error = error
        released = True
        if xfer.xfer is not None:
            try:
                xfer.xfer.release()
            except self._errors:
                logger.warning("%s: NIXL could not release a write to %s (%s)", self._name, xfer.peer, error)
                released = False
            xfer.xfer = None
        for reg in xfer.temp:
            if released and ended:
                self._deregister(agent, reg)
            else:
                self._leaked.append(reg)
        xfer.temp = []
        xfer.settled = ended
        xfer.given_up = not ended

    # ---- notifications ------------------------------------------------------------------------

    def get_notifications(self) -> list[Notification]:
        """Payloads of writes into our memory completed since the last call (also drives UCX progress)."""
        with self._lock:
            agent = self._check_open()
            if self._retiring:
                self._reap_retiring(agent)
            try:
                new = agent.get_new_notifs()
            except self._errors as exc:
                raise TransportError(f"NIXL failed to read notifications of {self._name!r}: {exc}") from exc
        return [Notification(peer=str(peer), payload=bytes(p)) for peer, payloads in new.items() for p in payloads]
