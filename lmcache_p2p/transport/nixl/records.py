"""The NIXL transport's records: NIXL's statuses, registered spans, registrations, peers, transfers.

Plain data shared by the transport's parts (state.py, peers.py, submit.py, settle.py).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from lmcache_p2p.protocol import Region

if TYPE_CHECKING:
    import torch

BACKEND = "UCX"


class Status(enum.Enum):
    """NIXL's transfer statuses, wrapped at the edge."""

    DONE = "DONE"
    PROC = "PROC"
    ERR = "ERR"


def mem_type(region: Region) -> str:
    return "VRAM" if region.device == "cuda" else "DRAM"


class Span(NamedTuple):
    """A registered region as the write loop checks it: [lo, hi) on ``device`` (-1: host)."""

    lo: int
    hi: int
    device: int
    device_id: int
    mem: str

    def holds(self, addr: int, nbytes: int) -> bool:
        return self.lo <= addr and addr + nbytes <= self.hi


NO_SPAN = Span(0, 0, -2, 0, "")


def span_of(r: Region) -> Span:
    return Span(r.addr, r.addr + r.length, r.device_id if r.device == "cuda" else -1, r.device_id, mem_type(r))


def spans_of(regions: Iterable[Region]) -> list[Span]:
    return [span_of(r) for r in regions]


@dataclasses.dataclass
class Registration:
    region: Region
    descs: Any  # nixlRegDList, handed back to deregister_memory
    tensor: torch.Tensor | None  # keeps registered memory alive while NIXL may touch it


@dataclasses.dataclass
class Peer:
    name: str
    metadata: bytes
    spans: list[Span]  # the peer's registered regions: where writes may land


@dataclasses.dataclass
class Xfer:
    """The mutable state behind a WriteHandle's token."""

    peer: str
    xfer: Any  # nixl_xfer_handle, None once released
    temp: list[Registration]  # sources registered for this write only
    done: bool = False
    error: str = ""
    unreachable: bool = False  # the failure was the peer going away
    settled: bool = False  # NIXL reported the transfer DONE, or it was never posted: nothing reads the sources
    given_up: bool = False  # failed while its puts may still read: it never settles


def nixl_error_types(bindings: Any) -> tuple[type[BaseException], ...]:
    """Every exception class NIXL's bindings raise (nixlBackendError, nixlNotFoundError, ...)."""
    found = [
        obj
        for name, obj in vars(bindings).items()
        if name.startswith("nixl") and name.endswith("Error") and isinstance(obj, type)
    ]
    return (*found, RuntimeError)

