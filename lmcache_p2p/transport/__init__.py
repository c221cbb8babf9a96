"""Transports: move bytes from local memory into a peer's registered memory.

``base.py`` is the contract, ``lifecycle.py`` its built -> started -> closed phases and
``two_sided.py`` the extra hooks of transports whose receiver posts every write (NCCL);
``nixl/`` (UCX: tcp, shared memory, cuda_ipc) and ``nccl/`` (torch.distributed pair groups;
Gloo on CPU) implement it. This package never interprets what it
moves and never talks to LMCache; descriptors cross the wire as ``protocol`` messages only.
"""

from __future__ import annotations

from lmcache_p2p.transport.base import Notification, Transport, WriteHandle, region_of
from lmcache_p2p.transport.two_sided import TwoSided, two_sided


def create_transport(kind: str, name: str, **options) -> Transport:
    """Build (not start) the transport named by ``p2p.transport``; its library is imported lazily."""
    if kind == "nixl":
        from lmcache_p2p.transport.nixl.transport import NixlTransport

        return NixlTransport(name, **options)
    if kind == "nccl":
        from lmcache_p2p.transport.nccl.transport import NcclTransport

        return NcclTransport(name, **options)
    raise ValueError(f"unknown transport {kind!r}; expected nixl or nccl")


__all__ = ["Notification", "Transport", "TwoSided", "WriteHandle", "create_transport", "region_of", "two_sided"]
