"""The transport contract: one-sided writes from local memory into a peer's registered memory.

A receiver registers its receive buffer once and publishes :meth:`Transport.info` (plain data,
sent inside our own control messages; never a pickled blob). A sender registers the memory its
chunks live in, ``connect``\\ s to the receiver's info, then ``write``\\ s a batch of local tensors
to remote addresses inside the receiver's regions, with a small notification payload. Completion
is observable on both sides: the sender ``wait``\\ s on the handle, the receiver gets the payload
from ``get_notifications`` only after every byte of that write has landed.

Lifecycle (``lifecycle.py``): construction records settings only; :meth:`Transport.start` opens
the sockets, threads and agents; :meth:`Transport.close` releases them.

Rules every implementation follows (the contract suite in tests/transport checks them):
  * nothing opens in the constructor; ``start()`` opens, and closes what it opened if it fails;
  * every wait takes a timeout and raises :class:`TransportTimeout` past it;
  * third-party failures surface as :class:`TransportError` subclasses, mapped at the edge;
  * ``close()`` is idempotent and safe after a failed start; use before ``start()`` or after
    ``close()`` raises ClosedError;
  * a write's SOURCES stay in use until :meth:`Transport.settled` says otherwise: completion
    (``poll`` True) settles a write; a failed or aborted one is settled only once the transport
    knows nothing reads its sources any more (see "Aborting" below);
  * sources may be host or device memory, destinations host or device memory;
  * a receiver keeps polling ``get_notifications`` while it expects writes: some paths (UCX tcp
    with no progress thread) only take bytes in while the receiver polls, so a receiver that
    stops polling stalls its senders until their waits time out.

Hooks that only two-sided transports need (the receiver pairs with each sender and posts every
write's receives: NCCL) are not part of this contract: see ``two_sided.py``.

Aborting (what a caller may free, and when):
  ``abort(handle)`` fails an unfinished write for its caller and returns at once; it does NOT
  promise that the transport stopped reading the write's sources. Neither library can recall a
  write already on the wire: NIXL 1.5.1's ``release_xfer_handle`` on an active transfer calls
  ``ucp_request_cancel`` (UCX honours it for receives only, not for RMA puts) and frees the
  handle, so the put may still read the source after NIXL forgot it; a posted Gloo/NCCL send
  cannot be cancelled at all, only completed or torn down with its pair. So the handle stays
  pollable after ``abort`` and ``settled(handle)`` turns True once the transport KNOWS no more
  reads can happen (the write completed or failed in the library, was never posted, or its pair
  was torn down). Transports settle every write by their own deadline where the library allows;
  a caller still bounds its wait (``p2p.settle_timeout_s``) and, past it, keeps the memory
  referenced (a small leak, logged) rather than let it be reused under a live read.
"""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Self

from lmcache_p2p.errors import P2PError, TransportTimeout
from lmcache_p2p.protocol import Region, TransportInfo

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True)
class WriteHandle:
    """An in-flight write; opaque to callers except for ``nbytes`` and ``peer``."""

    peer: str
    nbytes: int
    token: object


@dataclasses.dataclass(frozen=True)
class Notification:
    peer: str
    payload: bytes


def region_of(tensor: torch.Tensor) -> Region:
    """Describe a contiguous tensor as a Region (address, length, device)."""
    if not tensor.is_contiguous():
        raise ValueError("only contiguous tensors can be registered or written")
    device = tensor.device
    return Region(
        addr=tensor.data_ptr(),
        length=tensor.numel() * tensor.element_size(),
        device_id=(device.index or 0) if device.type == "cuda" else 0,
        device="cuda" if device.type == "cuda" else "cpu",
    )


class Transport(abc.ABC):
    """Moves bytes from local tensors into a peer's registered memory."""

    kind: str

    @abc.abstractmethod
    def start(self) -> Self:
        """Open what the transport needs (sockets, threads, its library's agent); returns self.

        A second call does nothing. If it fails it closes what it opened and raises (ClosedError
        afterwards: build a new transport to try again).
        """

    @abc.abstractmethod
    def register(self, tensor: torch.Tensor) -> Region:
        """Register a contiguous tensor once; it becomes a source or a destination of writes."""

    @abc.abstractmethod
    def info(self) -> TransportInfo:
        """What a peer needs to connect to us, including our registered regions."""

    @abc.abstractmethod
    def connect(self, peer: TransportInfo, timeout_s: float) -> str:
        """Sender side: prepare writes to ``peer``; return its name. Idempotent per peer."""

    @abc.abstractmethod
    def write(self, peer: str, srcs: Sequence[torch.Tensor], dst_addrs: Sequence[int], notif: bytes) -> WriteHandle:
        """Start writing each ``srcs[i]`` to ``dst_addrs[i]`` in the peer's memory.

        ``notif`` reaches the peer's ``get_notifications`` after all bytes have landed.
        """

    @abc.abstractmethod
    def poll(self, handle: WriteHandle) -> bool:
        """True when the write completed; raise TransportError if it failed."""

    def wait(self, handle: WriteHandle, timeout_s: float) -> None:
        """Block until ``handle`` completes or ``timeout_s`` passes (TransportTimeout, after ``abort``:
        the sources stay in use until :meth:`settled`)."""
        deadline = time.monotonic() + timeout_s
        while not self.poll(handle):
            if time.monotonic() >= deadline:
                self.abort(handle)
                raise TransportTimeout(
                    f"write of {handle.nbytes} bytes to {handle.peer} not complete after {timeout_s:.1f}s "
                    "(p2p.transfer_timeout_s)"
                )
            time.sleep(0)  # yield the GIL; a 2-core machine needs the other threads to progress

    def abort(self, handle: WriteHandle) -> None:  # noqa: B027 - optional hook
        """Fail an unfinished write for its caller; returns at once, never raises.

        Later ``poll`` calls raise TransportError. The sources may still be read until
        :meth:`settled` returns True: keep them alive until then.
        """

    def settled(self, handle: WriteHandle) -> bool:
        """True once nothing will read ``handle``'s sources again; non-blocking, never raises.

        A completed write is settled. A failed or aborted one is settled once the transport
        confirmed that its reads ended (see the module docstring). This default knows only
        completion: a failed write never settles, so its caller keeps the memory (leaks it)
        rather than free it under a live read. Implementations override it.
        """
        try:
            return self.poll(handle)
        except P2PError:
            return False

    @abc.abstractmethod
    def get_notifications(self) -> list[Notification]:
        """Notifications of writes into our memory that completed since the last call."""

    def wait_notifications(self, timeout_s: float) -> list[Notification]:
        """Block until at least one notification arrives, or return [] after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            notifs = self.get_notifications()
            if notifs or time.monotonic() >= deadline:
                return notifs
            time.sleep(0.0002)

    @abc.abstractmethod
    def disconnect(self, peer: str) -> None:
        """Forget ``peer`` (it left or died); later writes to it need a new ``connect``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything; idempotent, safe in every phase (built, started, after a failed start)."""
