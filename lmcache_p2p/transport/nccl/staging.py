"""Host <-> device staging rings for the NCCL transport (NCCL only moves device memory).

``SendRing`` carries host chunks to the wire: each piece is copied (when its source is pageable)
into a pinned buffer, copied host->device on a side stream, and sent from that device buffer;
the copy of piece i+1 overlaps the send of piece i. ``RecvRing`` is the mirror for a receiver
whose buffer is in host memory. Each ring belongs to ONE pair thread: no locking.

Ordering is kept on the GPU where possible: NCCL ops are issued with the ring's stream current,
so ProcessGroupNCCL makes its stream wait for our copies. The CPU waits (always with a deadline)
before it overwrites a pinned buffer, and before it copies a received piece out to host memory:
a copy-out is issued only once its receive is known to have succeeded (see ``RecvRing``).
Runs only with CUDA: tested on the GPU machine (tests/transport contract cases
"nccl-cuda-staged", tests/transport/test_nccl.py gpu tests, bench/transfer.py "nccl host->vram").
"""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING, Any

from lmcache_p2p.errors import TransportTimeout
from lmcache_p2p.transport.nccl import group as group_ops
from lmcache_p2p.transport.nccl.wire import pieces

if TYPE_CHECKING:
    import torch

_POLL_S = 0.00005


def _wait_until(done: Any, deadline: float, what: str) -> None:
    """Poll ``done()`` (a CUDA event query or Work.is_completed) until it is True or the deadline."""
    while not done():
        if time.monotonic() >= deadline:
            raise TransportTimeout(f"{what}: not complete at its deadline (p2p.transfer_timeout_s)")
        time.sleep(_POLL_S)


class SendRing:
    """A ring of ``slots`` device buffers (plus pinned bounce buffers) of ``slot_bytes`` each."""

    def __init__(self, device: torch.device, slot_bytes: int, slots: int) -> None:
        import torch

        self.slot_bytes = slot_bytes
        self._stream = torch.cuda.Stream(device)
        with torch.cuda.stream(self._stream):
            self._dev = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(slots)]
        self._pinned: list[torch.Tensor | None] = [None] * slots  # allocated on first pageable source
        self._busy: list[Any] = [None] * slots  # the send still reading each device slot
        self._next = 0

    def send(self, group: Any, src: torch.Tensor, deadline: float) -> list[Any]:
        """Send host tensor ``src`` (flat uint8) to rank 0 piece by piece; one Work per piece."""
        import torch

        pinned_src = src.is_pinned()
        works = []
        for off, n in pieces(src.numel(), self.slot_bytes):
            k = self._take_slot(deadline)
            piece = src[off : off + n]
            if not pinned_src:
                bounce = self._bounce(k)
                bounce[:n].copy_(piece)  # the previous H2D from this buffer finished before its send did
                piece = bounce[:n]
            with torch.cuda.stream(self._stream):
                self._dev[k][:n].copy_(piece, non_blocking=True)
                work = group.send([self._dev[k][:n]], 0, 0)
            self._busy[k] = work
            works.append(work)
        return works

    def quiesce(self, deadline: float) -> bool:
        """Wait (until ``deadline``) for every copy out of host memory queued on the ring's stream;
        after the pair's group was aborted nothing else reads host sources. False if it did not drain."""
        try:
            _wait_until(self._stream.query, deadline, "staging stream drain")
        except TransportTimeout:
            return False
        return True

    def _take_slot(self, deadline: float) -> int:
        k = self._next
        self._next = (k + 1) % len(self._dev)
        work = self._busy[k]
        if work is not None:
            _wait_until(work.is_completed, deadline, "staging slot reuse (send)")
            self._busy[k] = None
        return k

    def _bounce(self, k: int) -> torch.Tensor:
        import torch

        if self._pinned[k] is None:
            self._pinned[k] = torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=True)
        return self._pinned[k]


class RecvRing:
    """Receives into device slots and copies each piece into a host destination.

    A piece's copy-out is issued only once the CPU saw its receive complete without error, never
    queued on the GPU behind a receive that may yet fail: a failed receive (its pair aborted,
    however long ``ncclCommAbort`` takes) copies nothing into host memory. What was issued is
    drained (``quiesce``) before the pair reports its failed writes.
    """

    def __init__(self, device: torch.device, slot_bytes: int, slots: int) -> None:
        import torch

        self._device = device
        self._stream = torch.cuda.Stream(device)
        self._dev: list[torch.Tensor | None] = [None] * slots
        self._slot_bytes = slot_bytes
        self._next = 0
        # Received pieces not yet copied out, in receive order: (recv Work, device piece, host piece, slot).
        self._pending: collections.deque[tuple[Any, Any, Any, int]] = collections.deque()

    def recv(self, group: Any, dst: torch.Tensor, piece_bytes: int, deadline: float) -> list[Any]:
        """Receive ``dst.numel()`` bytes from rank 1 into host view ``dst``; one Work per piece."""
        import torch

        works = []
        for off, n in pieces(dst.numel(), piece_bytes):
            k, slot = self._slot(n, deadline)
            with torch.cuda.stream(self._stream):
                # NCCL waits for our stream, so this recv starts after the slot's previous copy-out.
                work = group.recv([slot[:n]], 1, 0)
            self._pending.append((work, slot[:n], dst[off : off + n], k))
            works.append(work)
        return works

    def finish(self, deadline: float, upto: Any = None) -> None:
        """Copy out the received pieces through the one of Work ``upto`` (all by default), each once
        its receive completed; then wait (with the deadline) until they landed in host memory.
        TransportError if a receive failed: nothing of it or after it is copied."""
        import torch

        ahead = [p[0] for p in self._pending]
        if upto is None:
            count = len(ahead)
        else:  # pieces leave in receive order: ``upto`` gone means this write's pieces all left already
            count = next((i + 1 for i, work in enumerate(ahead) if work is upto), 0)
        self._copy_out(deadline, count)
        event = torch.cuda.Event()
        event.record(self._stream)
        _wait_until(event.query, deadline, "staged copy to host")

    def quiesce(self, deadline: float) -> bool:
        """The pair was torn down: drop pieces never copied out, wait (until ``deadline``) for the
        copies issued. False if they did not drain: host destinations may still change then."""
        self._pending.clear()
        try:
            _wait_until(self._stream.query, deadline, "staged copy-out drain")
        except TransportTimeout:
            return False
        return True

    def _copy_out(self, deadline: float, count: int) -> None:
        """Copy out the first ``count`` pending pieces, in receive order."""
        import torch

        for _ in range(count):
            work, piece, dst, _slot = self._pending[0]
            group_ops.wait_work(work, deadline, "staged recv", cuda=True)  # raises: nothing more is copied
            self._pending.popleft()
            with torch.cuda.stream(self._stream):
                dst.copy_(piece, non_blocking=dst.is_pinned())  # a pageable copy waits for the stream

    def _slot(self, nbytes: int, deadline: float) -> tuple[int, torch.Tensor]:
        import torch

        k = self._next
        self._next = (k + 1) % len(self._dev)
        # The slot's previous piece is copied out before the slot is received into again.
        self._copy_out(deadline, max((i + 1 for i, p in enumerate(self._pending) if p[3] == k), default=0))
        slot = self._dev[k]
        if slot is None or slot.numel() < nbytes:
            with torch.cuda.stream(self._stream):  # freed and reused in this stream's order
                slot = torch.empty(max(nbytes, self._slot_bytes), dtype=torch.uint8, device=self._device)
            self._dev[k] = slot
        return k, slot


class CopyOut:
    """A write's finisher on a RecvRing: copies out its pieces, through its latest receive."""

    def __init__(self, ring: RecvRing) -> None:
        self.ring = ring
        self.upto: Any = None

    def __call__(self, deadline: float) -> None:
        self.ring.finish(deadline, self.upto)
