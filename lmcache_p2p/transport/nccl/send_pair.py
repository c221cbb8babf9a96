"""The sending half of an NCCL-transport pair (rank 1).

``SendPair`` owns a queue of writes and the thread that posts them in order (doorbell, then the
chunks' sends) and completes them oldest first; it holds the pair's store client and group and
drops them when its thread ends. The queue holds at most ``max_queued_writes`` writes not yet
taken by the thread (``p2p.nccl_max_queued_writes``): a write past it is refused at once, never
queued, so a pair whose thread is stuck cannot pile up its callers' memory without end. See
transport.py for the whole design.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from lmcache_p2p.errors import PeerUnreachable, TransportError, TransportTimeout
from lmcache_p2p.protocol import TransportInfo
from lmcache_p2p.transport.nccl import group as group_ops
from lmcache_p2p.transport.nccl import wire
from lmcache_p2p.transport.nccl.pair_common import PairSettings, PendingWrite, enter_device, new_send_ring

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 300.0  # an idle sender thread re-arms its wait this often (it is woken to stop)
_STOP = object()  # queue sentinel of a sender thread


class SendPair:
    """Rank 1 of a pair: a queue of writes and the thread that posts and completes them."""

    def __init__(self, settings: PairSettings, peer: TransportInfo, pair_id: str, store: Any, group: Any,
                 ring: Any = None) -> None:
        self.peer = peer.name
        self.regions = list(peer.regions)
        self.pair_id = pair_id
        self.down = ""  # why the pair takes no more writes ("" while it does)
        self._s = settings
        self._store = store
        self._group = group
        self._lock = threading.Lock()
        self._queue: queue.Queue[Any] = queue.Queue()
        self._inflight: collections.deque[PendingWrite] = collections.deque()
        self._broken: list[PendingWrite] = []  # posted writes that failed: settled once the group is gone
        self._seq = 0
        self._ring: Any = ring  # made at pairing on a GPU (eager), else at the first host-sourced write
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"nccl-send:{settings.name}->{peer.name}", daemon=True)

    # -- called from user threads --

    def start(self) -> None:
        self._thread.start()

    def submit(self, write: PendingWrite) -> None:
        """Queue ``write`` for the thread; raises (and settles it: nothing will read its sources) if
        the pair is down or its queue is full."""
        with self._lock:
            if self.down:
                write.fail("pair is down")
                write.settle()
                raise PeerUnreachable(f"pair {self.pair_id} to {self.peer} is down ({self.down}): connect() again")
            queued = self._queue.qsize()  # only the thread takes items meanwhile: never more than counted
            if queued >= self._s.max_queued_writes:
                write.fail("queue full")
                write.settle()
                raise TransportError(
                    f"pair {self.pair_id} to {self.peer} holds {queued} writes its thread has not posted yet, the "
                    f"limit: write of {write.header.nbytes} bytes refused; raise p2p.nccl_max_queued_writes or "
                    "send less at once"
                )
            self._queue.put(write)

    def abort(self, write: PendingWrite) -> None:
        """Fail an unfinished write for its caller.

        A queued write is dropped (and settled: it is never sent). One already on the wire
        cannot be recalled from a two-sided stream: it still completes in order, or fails with
        its pair; it settles then. Its bytes and notification may still arrive, as with an
        aborted NIXL write.
        """
        with self._lock:
            if not write.done and not write.error:
                write.fail("aborted while on the wire" if write.posted else "aborted before it was sent")
            if not write.posted:
                write.settle()  # _start sees the error under this lock and never posts it

    def stop(self) -> None:
        with self._lock:
            self.down = self.down or "disconnected"
            self._stopping.set()
            self._queue.put(_STOP)

    def join(self, timeout_s: float) -> bool:
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # -- the pair's thread --

    def _run(self) -> None:
        graceful = False
        try:
            enter_device(self._s)
            self._loop()
            graceful = True
        except TransportError as exc:
            logger.warning("%s: pair %s to %s broke: %s", self._s.name, self.pair_id, self.peer, exc)
            self._break(str(exc))
        except Exception as exc:  # a thread must not die silently
            logger.exception("%s: sender thread of pair %s failed", self._s.name, self.pair_id)
            self._break(f"internal error: {exc}")
        finally:
            self._fail_queued()
            if graceful:
                self._ring_bye()
            group_ops.drop_group(self._group)  # abort, never a collective: the peer may be dead
            self._settle_broken()
            self._group = self._store = self._ring = None

    def _settle_broken(self) -> None:
        """The group is aborted: NCCL/Gloo ops no longer touch the failed writes' memory, except
        a staged host->device copy still queued on the ring's stream (waited for, bounded)."""
        if not self._broken:
            return
        if self._ring is not None and not self._ring.quiesce(time.monotonic() + self._s.timeout_s):
            logger.error("%s: staging stream of pair %s did not drain; %d failed write(s) stay unsettled",
                         self._s.name, self.pair_id, len(self._broken))
            return
        for write in self._broken:
            write.settle()
        self._broken.clear()

    def _loop(self) -> None:
        """Post queued writes first; complete the oldest posted one when nothing is queued.

        On NCCL the oldest is completed only once it is done (polled), so that writes queued
        meanwhile are posted at once; Gloo can only learn completion by waiting for it.
        """
        while True:
            try:
                item = self._queue.get_nowait() if self._inflight else self._queue.get(timeout=IDLE_WAIT_S)
            except queue.Empty:
                if self._inflight:
                    if self._oldest_pending():
                        time.sleep(group_ops.POLL_S)
                        continue
                    self._complete(self._inflight.popleft())
                continue
            if item is _STOP:
                break
            if self._start(item):
                self._inflight.append(item)
                if len(self._inflight) >= self._s.max_inflight_writes:
                    self._complete(self._inflight.popleft())
        while self._inflight:  # posted writes finish (or fail at their deadline) even when stopping
            self._complete(self._inflight.popleft())

    def _start(self, write: PendingWrite) -> bool:
        with self._lock:
            if write.error:
                write.settle()  # aborted while queued (settled by abort already)
                return False
            if self._stopping.is_set() or self.down:
                write.fail(f"pair to {self.peer} is down ({self.down or 'disconnected'}) before the write was sent")
                write.settle()
                return False
            if time.monotonic() >= write.deadline:  # never sent, so the pair stays in step
                write.fail("not sent before its deadline (p2p.transfer_timeout_s)", timed_out=True)
                write.settle()
                return False
            write.posted = True
        try:
            self._post(write)
        except TransportError as exc:
            self._fail_first(write, exc)
            raise
        return True

    def _post(self, write: PendingWrite) -> None:
        """Ring doorbell N with the header, then post the chunks' sends (in order)."""
        try:
            self._store.set(wire.doorbell_key(self.pair_id, self._seq), write.header.encode())
        except group_ops.dist_errors() as exc:
            raise PeerUnreachable(f"cannot reach the store of {self.peer} to announce a write: {exc}") from exc
        self._seq += 1
        try:
            for src in write.srcs:
                write.works.extend(self._send(src, write.header.piece_bytes, write.deadline))
        except group_ops.dist_errors() as exc:
            raise TransportError(
                f"posting a write of {write.header.nbytes} bytes to {self.peer} failed: {exc}"
            ) from exc

    def _send(self, src: torch.Tensor, piece_bytes: int, deadline: float) -> list[Any]:
        if not self._s.cuda:
            if src.device.type != "cpu":
                src = src.cpu()  # Gloo sends host memory; the Work keeps this copy alive
            return [self._group.send([src], 0, 0)]
        if src.device.type == "cpu":
            return self._send_ring().send(self._group, src, deadline)
        return [self._group.send([src[off : off + n]], 0, 0) for off, n in wire.pieces(src.numel(), piece_bytes)]

    def _send_ring(self) -> Any:
        if self._ring is None:
            self._ring = new_send_ring(self._s)
        return self._ring


    def _oldest_pending(self) -> bool:
        """NCCL: the oldest posted write is still moving and within its deadline."""
        oldest = self._inflight[0]
        if time.monotonic() >= oldest.deadline:
            return False  # _complete reports the timeout
        # One communicator runs its ops in order: the last op done means the write is done.
        return bool(oldest.works) and not group_ops.is_done(oldest.works[-1], self._s.cuda)

    def _complete(self, write: PendingWrite) -> None:
        what = f"write of {write.header.nbytes} bytes to {self.peer}"
        try:
            for work in write.works:
                group_ops.wait_work(work, write.deadline, what, self._s.cuda)
        except TransportError as exc:
            self._fail_first(write, exc)
            raise
        with self._lock:
            write.succeed()
        write.settle()  # every op of this write completed

    def _fail_first(self, write: PendingWrite, exc: TransportError) -> None:
        """The write whose op failed: the pair goes down BEFORE its caller hears of it. Its ops
        may still run (a late NCCL kernel) until the thread aborts the group: settled then."""
        with self._lock:
            self.down = self.down or str(exc)
            write.fail(str(exc), timed_out=isinstance(exc, TransportTimeout))
            self._broken.append(write)

    def _break(self, reason: str) -> None:
        with self._lock:
            self.down = self.down or reason
            for write in self._inflight:
                write.fail(f"pair to {self.peer} broke: {reason}")
                self._broken.append(write)  # settled once the thread aborted the group
            self._inflight.clear()

    def _fail_queued(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                item.fail(f"pair to {self.peer} is down ({self.down}) before the write was sent")
                item.settle()

    def _ring_bye(self) -> None:
        try:
            self._store.set(wire.doorbell_key(self.pair_id, self._seq), wire.BYE.encode())
        except group_ops.dist_errors() as exc:
            logger.debug("%s: could not say BYE on pair %s: %s", self._s.name, self.pair_id, exc)
