"""What both sides of an NcclTransport share: its settings and one declared state object.

The transport (transport.py) builds the :class:`NcclState`, opens it in ``start()`` and closes it;
its sender side (sending.py) and receiver side (receiving.py) each hold the same object and read
or change it under its lock. What only one side needs (its pairs, the notifications) is that
side's own.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import TYPE_CHECKING, Any, cast

from lmcache_p2p.errors import TransportError
from lmcache_p2p.transport.lifecycle import Lifecycle
from lmcache_p2p.transport.nccl.pair_common import PairingReport, PairSettings

if TYPE_CHECKING:
    import torch

    from lmcache_p2p.protocol import Region
    from lmcache_p2p.transport.nccl.recv_pair import RecvPair
    from lmcache_p2p.transport.nccl.send_pair import SendPair

PAIRING_REPORTS_KEPT = 64  # the latest pairings' timings that ``pairings()`` returns


@dataclasses.dataclass(frozen=True)
class NcclOptions:
    """The transport's settings as asked for (NcclTransport's keyword arguments); checked at construction."""

    host: str
    port: int  # 0: any free port
    advertise_host: str | None  # what peers dial (TransportInfo.host); default: host
    device: str  # "cpu" or "cuda[:N]", resolved at start
    timeout_s: float
    close_timeout_s: float
    stage_slot_bytes: int
    stage_slots: int
    max_inflight_writes: int
    max_queued_writes: int

    def __post_init__(self) -> None:
        for name in ("timeout_s", "close_timeout_s", "stage_slot_bytes", "stage_slots", "max_inflight_writes",
                     "max_queued_writes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"NCCL transport {name} must be positive, got {getattr(self, name)!r}")

    def pair_settings(self, name: str, device: Any, port: int) -> PairSettings:
        return PairSettings(name, self.host, port, device, self.timeout_s, self.stage_slot_bytes, self.stage_slots,
                            self.max_inflight_writes, self.max_queued_writes)


def resolve_device(device: str) -> Any:
    """``device`` as a torch.device with its index; TransportError where CUDA is asked for but absent."""
    import torch

    dev = torch.device(device)
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"NCCL transport device must be 'cpu' or 'cuda[:N]', got {device!r}")
    if not torch.cuda.is_available():
        raise TransportError(f"device {device!r} asked for, but CUDA is not available (p2p.buffer_device)")
    return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())


@dataclasses.dataclass(eq=False)
class NcclState:
    """The state an NcclTransport's two sides share; every field changes under ``lock``."""

    name: str
    options: NcclOptions
    lifecycle: Lifecycle
    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)
    settings: PairSettings | None = None  # fixed at start (the store's port is known then)
    store: Any = None  # the TCPStore we host, from start() to close(); pairs dial it
    regions: list[Region] = dataclasses.field(default_factory=list)
    views: list[Any] = dataclasses.field(default_factory=list)  # flat uint8 view of each region (keeps it alive)
    stopped: list[SendPair | RecvPair] = dataclasses.field(default_factory=list)  # threads close() joins
    pairings: collections.deque[PairingReport] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=PAIRING_REPORTS_KEPT))

    def check_open(self) -> PairSettings:
        """The pair settings of a started transport; ClosedError before start() and after close()."""
        self.lifecycle.check_open()
        return cast(PairSettings, self.settings)  # set before the phase turns OPEN

    def check_device(self, tensor: torch.Tensor, what: str) -> None:
        """NCCL moves memory of its own GPU only (host memory is staged); Gloo takes any."""
        settings = self.check_open()
        dev = tensor.device
        if settings.cuda and dev.type == "cuda" and dev.index != settings.device.index:
            raise ValueError(f"cannot {what} memory on {dev}: this NCCL transport runs on {settings.device}")

    def park(self, pairs: list[SendPair | RecvPair]) -> None:
        """Keep stopped pairs until close() joins them (those already ended are dropped)."""
        with self.lock:
            self.stopped = [p for p in self.stopped if not p.join(0)] + pairs
