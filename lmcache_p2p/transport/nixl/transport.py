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
    a write already in flight (on tcp and sm alike).
  * UCX sm moves host bytes with CMA (process_vm_writev) INSIDE ``write``: the caller's thread
    does the copy (the GIL is released meanwhile) and the handle is usually done at once.
    CMA throughput roughly doubles when the receiver's buffer (and the sources) are backed by
    transparent huge pages (madvise(MADV_HUGEPAGE)); see bench/transfer.py.
  * UCX tcp with the progress thread off: a receiver only takes bytes in while it polls
    (``get_notifications``), so a receiver that stops polling stalls its senders' writes.
  * The receiver needs no metadata of its senders to get their notifications.
  * ``add_remote_agent`` returns bytes; ``get_new_notifs`` keys its dict by str; statuses are
    the strings "DONE" / "PROC" / "ERR", wrapped in :class:`~lmcache_p2p.transport.nixl.records.Status`.
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
a fraction of the speed of a local copy; staged, they move at copy-engine speed): see staging.py. Every other combination (device
or host sources, host or device destinations) is one NIXL transfer with one descriptor per chunk.

Threads: every call into the agent holds one lock (the agent is created without NIXL's own
locking), so writes, polls and notification polls may come from different threads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lmcache_p2p.errors import ClosedError, PeerUnreachable, TransportError
from lmcache_p2p.protocol import Region, TransportInfo
from lmcache_p2p.transport.base import Notification, Transport, region_of
from lmcache_p2p.transport.nixl.records import (
    BACKEND,
    Peer,
    Registration,
    Xfer,
    mem_type,
    nixl_error_types,
    span_of,
    spans_of,
)
from lmcache_p2p.transport.nixl.settle import WriteSettling
from lmcache_p2p.transport.nixl.staging import StagingRing
from lmcache_p2p.transport.nixl.submit import WriteSubmission

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

DEFAULT_BACKEND_PARAMS: Mapping[str, str] = {"ucx_error_handling_mode": "none"}


class NixlTransport(WriteSubmission, WriteSettling, Transport):
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
        self._regs: list[Registration] = []
        self._peers: dict[str, Peer] = {}
        self._inflight: dict[int, Xfer] = {}  # posted and not yet settled (aborted ones included)
        self._retiring: set[str] = set()  # disconnected peers whose agents stay until their writes settled
        self._leaked: list[Registration] = []  # temp sources of writes NIXL refused to cancel
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
        self._errors = nixl_error_types(nixl._bindings)
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
        wanted = span_of(region)
        with self._lock:
            agent = self._check_open()
            for reg in self._regs:
                span = span_of(reg.region)
                if span.device == wanted.device and span.holds(region.addr, region.length):
                    return reg.region  # already registered (the same tensor, or one inside it)
            reg = self._register_regions(agent, [region])[0]
            reg.tensor = tensor
            self._regs.append(reg)
        logger.debug("%s registered %d bytes at 0x%x (%s:%d)", self._name, region.length, region.addr,
                     region.device, region.device_id)
        return region

    def _register_regions(self, agent: Any, regions: Sequence[Region]) -> list[Registration]:
        """One NIXL registration per region, so that each can be deregistered on its own."""
        done: list[Registration] = []
        try:
            for region in regions:
                descs = agent.get_reg_descs([(region.addr, region.length, region.device_id, "")], mem_type(region))
                agent.register_memory(descs, backends=[BACKEND])
                done.append(Registration(region, descs, None))
        except self._errors as exc:
            for reg in done:
                self._deregister(agent, reg)
            raise TransportError(
                f"NIXL could not register {mem_type(region)} memory 0x{region.addr:x} (+{region.length} bytes): {exc}"
            ) from exc
        return done

    def _deregister(self, agent: Any, reg: Registration) -> None:
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
                known.spans = spans_of(peer.regions)
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
            self._peers[name] = Peer(name, bytes(peer.metadata), spans_of(peer.regions))
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
