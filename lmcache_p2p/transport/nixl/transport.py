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

Shape: :class:`NixlTransport` owns one :class:`~lmcache_p2p.transport.nixl.state.NixlState` (the
lifecycle, lock, agent, registrations, peers, writes in flight, the staging ring) and composes
the parts that share it: :class:`~lmcache_p2p.transport.nixl.peers.Peers` (connect, disconnect),
:class:`~lmcache_p2p.transport.nixl.submit.Submitter` (writes) and
:class:`~lmcache_p2p.transport.nixl.settle.Settler` (poll, abort, settle). Building it opens
nothing; ``start()`` creates the agent, its UCX backend and the staging ring. NIXL is one-sided:
it has none of the two-sided hooks (``transport/two_sided.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self

from lmcache_p2p.errors import TransportError
from lmcache_p2p.protocol import Region, TransportInfo
from lmcache_p2p.transport.base import Notification, Transport, WriteHandle, region_of
from lmcache_p2p.transport.lifecycle import Lifecycle
from lmcache_p2p.transport.nixl.peers import Peers
from lmcache_p2p.transport.nixl.records import BACKEND, nixl_error_types, span_of
from lmcache_p2p.transport.nixl.settle import Settler
from lmcache_p2p.transport.nixl.staging import StagingRing
from lmcache_p2p.transport.nixl.state import NixlState
from lmcache_p2p.transport.nixl.submit import Submitter

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

DEFAULT_BACKEND_PARAMS: Mapping[str, str] = {"ucx_error_handling_mode": "none"}


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
        sources written into a peer's GPU memory (``stage_slots`` x ``stage_slot_bytes`` of VRAM).
        Records the settings only; ``start()`` creates the agent."""
        self._params = dict(DEFAULT_BACKEND_PARAMS if backend_params is None else backend_params)
        self._stage = (stage_device, stage_slot_bytes, stage_slots)
        self._state = NixlState(name, Lifecycle(f"NIXL transport {name!r}"))
        self._settle = Settler(self._state)
        self._submit = Submitter(self._state, self._settle)
        self._peers = Peers(self._state, self._settle, self.kind)

    @property
    def given_up(self) -> int:
        """Writes NIXL failed while their puts may still read: they never settle."""
        return self._state.given_up

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> Self:
        """Create the agent and its UCX backend (and the staging ring); closes and raises if that fails."""
        st = self._state
        stage_device, slot_bytes, slots = self._stage
        with st.lock:
            if not st.lifecycle.begin_start():
                return self
            try:
                st.agent = self._create_agent(st.name, self._params)
                st.lifecycle.opened()  # the ring registers its buffer through register()
                if stage_device is not None:
                    st.ring = self._create_ring(stage_device, slot_bytes, slots)
            except BaseException:
                self.close()
                raise
        logger.info("NIXL transport %s ready (UCX params %s, staging %s)", st.name, self._params,
                    f"{slots} x {slot_bytes} bytes on {stage_device}" if st.ring else "off")
        return self

    def _create_agent(self, name: str, params: dict[str, str]) -> Any:
        try:
            import nixl
        except ImportError as exc:
            raise TransportError("nixl is not importable: install nixl==1.5.1 (pyproject dependencies)") from exc
        st = self._state
        st.errors = nixl_error_types(nixl._bindings)
        gone = getattr(nixl._bindings, "nixlRemoteDisconnectError", None)
        st.disconnected = (gone,) if isinstance(gone, type) else ()
        try:
            agent = nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=False, backends=[]))
        except st.errors as exc:
            raise TransportError(f"cannot create NIXL agent {name!r}: {exc}") from exc
        try:
            agent.create_backend(BACKEND, params)
        except st.errors as exc:
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
        ring = StagingRing(dev, slot_bytes, slots, self._submit)
        self.register(ring.buffer)
        return ring

    def close(self) -> None:
        """Abort writes in flight, forget peers, deregister memory, drop the agent. Idempotent."""
        st = self._state
        with st.lock:
            if not st.lifecycle.begin_close():
                return
            agent, st.agent = st.agent, None
            if agent is None:
                return
            if st.ring is not None:
                st.ring.close()
            unsettled = list(st.inflight.values())
            for xfer in unsettled:
                self._settle.release(agent, xfer, "transport closed", ended=False)
            if unsettled:
                logger.warning("%s closed with %d write(s) in flight: they never settle (their sources stay "
                               "referenced by their callers)", st.name, len(unsettled))
            for peer in [*st.peers, *st.retiring]:
                st.remove_remote(agent, peer)
            st.peers.clear()
            st.retiring.clear()
            for reg in st.regs + st.leaked:
                st.deregister(agent, reg)
            st.regs.clear()
            st.leaked.clear()
        logger.debug("NIXL transport %s closed", st.name)

    # ---- memory -------------------------------------------------------------------------------

    def register(self, tensor: torch.Tensor) -> Region:
        """Register ``tensor``'s bytes once (DRAM for host tensors, VRAM with its device id).

        A tensor inside an already registered one is not registered again: the enclosing region
        is returned. The transport keeps a reference to each registered tensor until ``close``.
        """
        region = region_of(tensor)
        wanted = span_of(region)
        st = self._state
        with st.lock:
            agent = st.check_open()
            for reg in st.regs:
                span = span_of(reg.region)
                if span.device == wanted.device and span.holds(region.addr, region.length):
                    return reg.region  # already registered (the same tensor, or one inside it)
            reg = st.register_regions(agent, [region])[0]
            reg.tensor = tensor
            st.regs.append(reg)
        logger.debug("%s registered %d bytes at 0x%x (%s:%d)", st.name, region.length, region.addr,
                     region.device, region.device_id)
        return region

    def info(self) -> TransportInfo:
        """Our agent metadata and registered regions; publish it after the last ``register``."""
        st = self._state
        with st.lock:
            agent = st.check_open()
            try:
                metadata = agent.get_agent_metadata()
            except st.errors as exc:
                raise TransportError(f"NIXL could not export metadata of {st.name!r}: {exc}") from exc
            regions = [reg.region for reg in st.regs]
        return TransportInfo(kind=self.kind, name=st.name, metadata=bytes(metadata), regions=regions)

    # ---- peers --------------------------------------------------------------------------------

    def connect(self, peer: TransportInfo, timeout_s: float) -> str:
        """Load the peer's agent metadata; ``timeout_s`` bounds nothing here: nothing waits."""
        return self._peers.connect(peer)

    def disconnect(self, peer: str) -> None:
        """Abort our writes to ``peer`` and unload its agent; unknown peers are ignored."""
        with self._state.lock:
            agent = self._state.check_open()
            self._peers.forget(agent, peer)

    # ---- writes -------------------------------------------------------------------------------

    def write(self, peer: str, srcs: Sequence[torch.Tensor], dst_addrs: Sequence[int], notif: bytes) -> WriteHandle:
        return self._submit.write(peer, srcs, dst_addrs, notif)

    def poll(self, handle: WriteHandle) -> bool:
        return self._settle.poll(handle)

    def abort(self, handle: WriteHandle) -> None:
        self._settle.abort(handle)

    def settled(self, handle: WriteHandle) -> bool:
        return self._settle.settled(handle)

    # ---- notifications ------------------------------------------------------------------------

    def get_notifications(self) -> list[Notification]:
        """Payloads of writes into our memory completed since the last call (also drives UCX progress)."""
        st = self._state
        with st.lock:
            agent = st.check_open()
            if st.retiring:
                self._settle.reap_retiring(agent)
            try:
                new = agent.get_new_notifs()
            except st.errors as exc:
                raise TransportError(f"NIXL failed to read notifications of {st.name!r}: {exc}") from exc
        return [Notification(peer=str(peer), payload=bytes(p)) for peer, payloads in new.items() for p in payloads]
