"""Host -> remote-GPU writes for the NIXL transport, staged through the sender's own GPU.

Why: UCX moves pinned host memory into a peer's GPU slowly (with ``cuda_ipc,cuda_copy,tcp``,
cuda_ipc only copies device memory, so UCX falls back to a pipeline through host bounce buffers),
while a local pinned host->device copy runs at the bus limit and cuda_ipc between two GPUs at
the GPU link's speed (figures: bench/transfer.py, shared/FACTS.md). LMCache keeps a prefiller's
chunks in host memory, so this is the path that matters.

How: a small ring of device slots on the sender's GPU, allocated and registered with NIXL (VRAM)
once. Each host piece is copied into a slot on a side stream; a slot whose copy finished goes out
as ONE NIXL transfer with one descriptor per piece in it. The copy into the next slot overlaps the
transfer out of the previous one. A source larger than a slot travels as slot-sized pieces;
smaller sources of one write are packed into one slot (a slot holds pieces of one write only).

Ordering: the slot with a write's last piece goes out last and carries the write's notification,
only after every other slot of that write completed, so the peer sees the notification only once
every byte landed (as with a direct write).

Progress: nothing runs in the background. The ring advances whenever the transport is polled
(``poll``/``wait``/``write``), as UCX itself does without a progress thread; the sender service
polls its handles continuously. Writes go through the ring in submission order.

Failures: a failed or aborted write stops using the ring: its queued pieces are dropped, its
filled-but-unsent slots are freed (later copies into them are ordered on the same stream), and
slots already on the wire are freed when their transfer ends. A slot whose transfer the transport
gave up (NIXL failed it while its puts may still read: see transport.py) is never refilled: it is
lost for the process's life, counted in ``lost_slots`` and logged; a ring with no slot left is
bypassed by the transport. Host sources must stay valid until the write is settled: finished,
and the last copy out of them landed (``StagedWrite.settled``).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from lmcache_p2p.errors import PeerUnreachable, TransportError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

ALIGN_BYTES = 256  # packed pieces start at this alignment inside a slot (copy-engine friendly)

# Ring buffers that puts given up unfinished may still read once their ring closed.
_KEPT_FOR_LIFE: list[Any] = []

Row = tuple[int, int, int]  # (address, bytes, device id), as NIXL descriptors take them


class XferPort(Protocol):
    """What the ring needs from its transport (implemented by submit.Submitter)."""

    def post_staged(self, peer: str, src_rows: list[Row], dst_rows: list[Row], notif: bytes) -> Any:
        """Post one VRAM -> VRAM transfer; return its token. PeerUnreachable / TransportError."""

    def staged_done(self, xfer: Any) -> bool:
        """True once the transfer completed; TransportError once it failed and ended (released then).
        A transfer failed while NIXL still runs it answers False: its slot is still being read."""

    def staged_given_up(self, xfer: Any) -> tuple[str, bool] | None:
        """(why, peer unreachable) once the transport gave the transfer up: it may read its slot for good."""

    def drop_staged(self, xfer: Any) -> None:
        """Release an unfinished transfer (abort); never raises."""


class _State(enum.Enum):
    FREE = "free"
    COPYING = "copying"  # host -> slot copy issued; ``event`` tells when it landed
    SENDING = "sending"  # a NIXL transfer reads the slot
    LOST = "lost"  # a transfer given up unfinished may read the slot: never refilled


@dataclasses.dataclass(eq=False)
class StagedWrite:
    """A write going through the ring; the token behind its WriteHandle."""

    peer: str
    notif: bytes
    nbytes: int
    pieces: collections.deque[tuple[Any, int, int]]  # (flat uint8 host view, remote addr, remote device id)
    open_slots: int = 0  # filled slots of this write whose transfer has not completed
    done: bool = False
    error: str = ""
    unreachable: bool = False  # the failure was the peer going away
    last_copy: Any = None  # CUDA event after the latest host -> slot copy of this write's pieces

    def fail(self, error: str, unreachable: bool = False) -> None:
        if not self.done and not self.error:
            self.error, self.unreachable = error, unreachable

    @property
    def finished(self) -> bool:
        return self.done or bool(self.error)

    @property
    def settled(self) -> bool:
        """Nothing reads the host sources any more: finished, and every copy out of them landed
        (NIXL reads only ring slots; pieces never copied are never read after a failure)."""
        return self.finished and (self.last_copy is None or bool(self.last_copy.query()))


@dataclasses.dataclass(eq=False)
class _Slot:
    view: Any  # device uint8 tensor of slot_bytes
    addr: int
    state: _State = _State.FREE
    write: StagedWrite | None = None
    rows: list[tuple[int, int, int, int]] = dataclasses.field(default_factory=list)  # (slot addr, n, dst, dev)
    last: bool = False  # holds the write's last piece (goes out last, with the notification)
    event: Any = None
    xfer: Any = None

    def free(self) -> None:
        self.state, self.write, self.rows, self.last, self.event, self.xfer = _State.FREE, None, [], False, None, None


class StagingRing:
    """``slots`` device buffers of ``slot_bytes`` on ``device``; see the module docstring."""

    def __init__(self, device: torch.device, slot_bytes: int, slots: int, port: XferPort) -> None:
        import torch

        if slot_bytes <= 0 or slots <= 0 or slot_bytes % ALIGN_BYTES:
            raise ValueError(f"staging needs slots > 0 and slot_bytes a positive multiple of {ALIGN_BYTES}")
        self.device = device
        self.slot_bytes = slot_bytes
        self._port = port
        with torch.cuda.device(device):
            self._stream = torch.cuda.Stream(device)
            self.buffer = torch.empty(slot_bytes * slots, dtype=torch.uint8, device=device)
        base = self.buffer.data_ptr()
        self._slots = [_Slot(self.buffer[i * slot_bytes : (i + 1) * slot_bytes], base + i * slot_bytes)
                       for i in range(slots)]
        self._queue: collections.deque[StagedWrite] = collections.deque()  # writes with pieces left to copy
        self._copying: collections.deque[_Slot] = collections.deque()  # in fill order
        self.lost_slots = 0

    @property
    def usable(self) -> bool:
        """False once every slot was lost to a given-up transfer."""
        return self.lost_slots < len(self._slots)

    # ---- called by the transport, under its lock ------------------------------------------------

    def submit(self, peer: str, srcs: Sequence[torch.Tensor], dst_rows: Sequence[Row], notif: bytes) -> StagedWrite:
        """Queue host ``srcs`` for ``dst_rows`` (validated remote VRAM rows) and start copying."""
        import torch

        pieces: collections.deque[tuple[Any, int, int]] = collections.deque()
        for src, (dst, nbytes, dev) in zip(srcs, dst_rows):
            flat = src.reshape(-1).view(torch.uint8)
            for off in range(0, nbytes, self.slot_bytes):
                n = min(self.slot_bytes, nbytes - off)
                pieces.append((flat[off : off + n], dst + off, dev))
        if not pieces:
            raise ValueError("cannot write empty tensors")
        write = StagedWrite(peer, bytes(notif), sum(row[1] for row in dst_rows), pieces)
        self._queue.append(write)
        self.pump()
        return write

    def pump(self) -> None:
        """Advance every slot: reap finished transfers, post copied slots, fill free slots."""
        import torch

        with torch.cuda.device(self.device):
            self._reap()
            self._post_copied()
            self._fill()

    def abort(self, write: StagedWrite, reason: str) -> None:
        """Fail ``write``; it takes no more ring time (slots on the wire finish on their own)."""
        write.fail(reason)
        self._drop_failed()

    def fail_peer(self, peer: str, reason: str) -> None:
        """The peer is gone: fail every unfinished write to it."""
        for write in self._writes():
            if write.peer == peer:
                write.fail(reason, unreachable=True)
        self._drop_failed()

    def close(self) -> None:
        """Fail everything and release transfers still reading slots."""
        for write in self._writes():
            write.fail("transport closed")
        if any(slot.state in (_State.SENDING, _State.LOST) for slot in self._slots):
            _KEPT_FOR_LIFE.append(self.buffer)  # puts that never settled may still read it
        for slot in self._slots:
            if slot.state is _State.SENDING:
                self._port.drop_staged(slot.xfer)
            slot.free()
        self._queue.clear()
        self._copying.clear()

    # ---- the steps of pump ----------------------------------------------------------------------

    def _writes(self) -> list[StagedWrite]:
        seen = {id(w): w for w in self._queue}
        seen.update({id(s.write): s.write for s in self._slots if s.write is not None})
        return [w for w in seen.values() if not w.finished]

    def _reap(self) -> None:
        for slot in self._slots:
            if slot.state is not _State.SENDING:
                continue
            write = slot.write
            try:
                if not self._port.staged_done(slot.xfer):
                    self._lose_if_given_up(slot)
                    continue
            except PeerUnreachable as exc:
                write.fail(str(exc), unreachable=True)
            except TransportError as exc:
                write.fail(str(exc))
            else:
                write.open_slots -= 1
                if slot.last and not write.error:
                    write.done = True
            slot.free()
        self._drop_failed()

    def _lose_if_given_up(self, slot: _Slot) -> None:
        given_up = self._port.staged_given_up(slot.xfer)
        if given_up is None:
            return
        slot.write.fail(*given_up)
        slot.state, slot.write = _State.LOST, None
        self.lost_slots += 1
        logger.warning("staging slot at 0x%x lost: its transfer failed (%s) while NIXL may still read it; %d of %d "
                       "slot(s) lost", slot.addr, given_up[0], self.lost_slots, len(self._slots))

    def _post_copied(self) -> None:
        for slot in list(self._copying):
            write = slot.write
            if not slot.event.query():
                break  # copies land in stream order: later slots are not done either
            if slot.last and write.open_slots > 1:
                continue  # the notification goes out after every other slot of this write
            self._copying.remove(slot)
            src_rows = [(addr, n, self.device.index) for addr, n, _, _ in slot.rows]
            dst_rows = [(dst, n, dev) for _, n, dst, dev in slot.rows]
            try:
                slot.xfer = self._port.post_staged(write.peer, src_rows, dst_rows, write.notif if slot.last else b"")
            except PeerUnreachable as exc:
                write.fail(str(exc), unreachable=True)
                slot.free()
                continue
            except TransportError as exc:
                write.fail(str(exc))
                slot.free()
                continue
            slot.state = _State.SENDING

    def _fill(self) -> None:
        import torch

        for slot in self._slots:
            while self._queue and self._queue[0].finished:
                self._queue.popleft()
            if not self._queue:
                return
            if slot.state is not _State.FREE:
                continue
            write = self._queue[0]
            off = 0
            with torch.cuda.stream(self._stream):
                while write.pieces and off + write.pieces[0][0].numel() <= self.slot_bytes:
                    src, dst, dev = write.pieces.popleft()
                    n = src.numel()
                    # Pinned sources copy asynchronously; pageable ones return once the driver took them.
                    slot.view[off : off + n].copy_(src, non_blocking=True)
                    slot.rows.append((slot.addr + off, n, dst, dev))
                    off = -(-(off + n) // ALIGN_BYTES) * ALIGN_BYTES
                slot.event = torch.cuda.Event()
                slot.event.record(self._stream)
            write.last_copy = slot.event
            slot.state, slot.write = _State.COPYING, write
            write.open_slots += 1
            if not write.pieces:
                slot.last = True
                self._queue.popleft()
            self._copying.append(slot)

    def _drop_failed(self) -> None:
        """Free filled-but-unsent slots of failed writes (later copies into them are stream-ordered)."""
        for slot in list(self._copying):
            if slot.write is not None and slot.write.error:
                self._copying.remove(slot)
                slot.free()
        while self._queue and self._queue[0].finished:
            self._queue.popleft()
        self._queue = collections.deque(w for w in self._queue if not w.finished)
