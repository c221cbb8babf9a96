"""What both halves of an NCCL-transport pair share: settings, a write's state, pairing timings.

The halves themselves: ``send_pair.py`` (:class:`SendPair`, rank 1) and ``recv_pair.py``
(:class:`RecvPair`, rank 0); ``pairs.py`` names them all.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from lmcache_p2p.transport.nccl import wire

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class PendingWrite:
    """The state behind a WriteHandle's token; transitions happen under its pair's lock."""

    peer: str
    header: wire.Header
    srcs: list[Any]  # flat uint8 views; dropped once the write has finished
    deadline: float
    posted: bool = False
    done: bool = False
    error: str = ""
    timed_out: bool = False
    works: list[Any] = dataclasses.field(default_factory=list)
    finished: threading.Event = dataclasses.field(default_factory=threading.Event)  # done or failed
    # Nothing reads ``srcs`` any more: never posted, completed, or its pair's group was torn down.
    settled: threading.Event = dataclasses.field(default_factory=threading.Event)

    def fail(self, error: str, timed_out: bool = False) -> None:
        if not self.done and not self.error:
            self.error = error
            self.timed_out = timed_out
        self.finished.set()

    def succeed(self) -> None:
        if not self.error:  # an aborted write stays failed even if its bytes landed
            self.done = True
        self.finished.set()

    def release(self) -> None:
        # Dropping the Works is what ends a posted Gloo send still waiting for its receiver: it
        # reads the source whenever the receiver posts, even after abort() or with its group gone,
        # until its Work is destroyed (torch 2.13; tests/transport/test_nccl.py). So before settled.
        self.srcs = []
        self.works = []

    def settle(self) -> None:
        """No op of the pair reads this write's sources any more (caller: the pair's thread)."""
        self.release()
        self.settled.set()


@dataclasses.dataclass(frozen=True)
class PairSettings:
    """What the pair threads need from their transport; fixed when it starts."""

    name: str
    host: str
    port: int
    device: Any  # torch.device
    timeout_s: float
    stage_slot_bytes: int
    stage_slots: int
    max_inflight_writes: int
    max_queued_writes: int  # writes a sender pair holds before its thread posts them (p2p.nccl_max_queued_writes)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def watchdog_s(self) -> float:
        """NCCL's watchdog timeout: past every deadline of ours, so that our own waits fail first."""
        return self.timeout_s * 2 + 10


@dataclasses.dataclass(frozen=True)
class PairingReport:
    """How long one pairing took, by step (logged, and kept by the transport: ``pairings()``).

    ``group_ms``: claiming the offer and building the process group; ``handshake_ms``: the first
    message (NCCL creates the pair's communicator here); ``warmup_ms``: a ``wire.WARMUP_BYTES``
    piece; ``ready_ms``: the receiver's "serving" message (the sender waits for it)."""

    role: str  # "sender" | "receiver"
    peer: str
    pair_id: str
    group_ms: float
    handshake_ms: float
    warmup_ms: float
    ready_ms: float
    warmup_bytes: int

    @property
    def total_ms(self) -> float:
        return self.group_ms + self.handshake_ms + self.warmup_ms + self.ready_ms

    def log(self, name: str) -> None:
        logger.info("%s: paired as %s with %s (pair %s) in %.1f ms: group %.1f ms, handshake %.1f ms, "
                    "warm-up %.1f ms (%d bytes), ready %.1f ms", name, self.role, self.peer, self.pair_id,
                    self.total_ms, self.group_ms, self.handshake_ms, self.warmup_ms, self.warmup_bytes, self.ready_ms)


class Stopwatch:
    """Milliseconds between successive ``lap()`` calls."""

    def __init__(self) -> None:
        self._last = time.monotonic()

    def lap(self) -> float:
        now = time.monotonic()
        elapsed, self._last = (now - self._last) * 1e3, now
        return elapsed


def enter_device(settings: PairSettings) -> None:
    if settings.cuda:
        import torch

        torch.cuda.set_device(settings.device)


def new_send_ring(settings: PairSettings) -> Any:
    """A sender's staging ring (GPU): device slots for host-resident chunks; see staging.py."""
    from lmcache_p2p.transport.nccl.staging import SendRing

    return SendRing(settings.device, settings.stage_slot_bytes, settings.stage_slots)


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    import torch

    return tensor.reshape(-1).view(torch.uint8)
