"""The two halves of an NCCL-transport pair, each with its thread.

``SendPair`` (rank 1) owns a queue of writes and the thread that posts them in order (doorbell,
then the chunks' sends) and completes them oldest first. ``RecvPair`` (rank 0) owns the thread
that pairs with one sender after ``accept`` and then serves its doorbells: check the header,
receive each chunk into its slot, hand the notification to the transport. Both hold the pair's
store client and group and drop them when their thread ends. See nccl.py for the whole design.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lmcache_p2p.errors import PeerUnreachable, ProtocolError, TransportError, TransportTimeout
from lmcache_p2p.protocol import TransportInfo
from lmcache_p2p.transport.nccl import group as group_ops
from lmcache_p2p.transport.nccl import wire

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 300.0  # an idle sender thread re-arms its wait this often (it is woken to stop)
STOP_CHECK_S = 1.0  # an idle serving receiver re-checks its stop flag this often (in case a wake missed)
RECV_AHEAD = 8  # writes whose receives a receiver posts before the oldest of them completes
_STOP = object()  # queue sentinel of a sender thread


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
    """What the pair threads need from their transport; fixed at construction."""

    name: str
    host: str
    port: int
    device: Any  # torch.device
    timeout_s: float
    stage_slot_bytes: int
    stage_slots: int
    max_inflight_writes: int

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


# ---- the sending side of one pair ----------------------------------------------------------------


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
        with self._lock:
            if self.down:
                raise PeerUnreachable(f"pair {self.pair_id} to {self.peer} is down ({self.down}): connect() again")
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


@dataclasses.dataclass(eq=False)
class _PostedRecv:
    """A write whose receives a receiver pair posted; completed in doorbell order."""

    header: wire.Header
    deadline: float
    works: list[Any] = dataclasses.field(default_factory=list)
    finishers: list[Any] = dataclasses.field(default_factory=list)  # run after the works, with the deadline


@dataclasses.dataclass(frozen=True)
class RecvHooks:
    """What a receiver pair needs from its transport."""

    on_paired: Callable[[RecvPair], bool]  # False: do not serve (closed, or stopped meanwhile)
    on_ended: Callable[[RecvPair], None]
    notify: Callable[[str, bytes], None]  # (sender, payload) once a write's bytes all landed
    slot_view: Callable[[wire.ChunkDest], Any]  # the registered memory a chunk lands in
    region_bytes: Callable[[], list[int]]  # the length of each registered region
    admit: Callable[[str, wire.Header], None]  # ProtocolError: the receiver refuses this write
    on_report: Callable[[PairingReport], None] = lambda _report: None  # a pairing's timings
    # (sender, payload, why) of an admitted write that will not land whole; called once nothing more of it lands
    write_failed: Callable[[str, bytes, str], None] = lambda _sender, _payload, _why: None


# ---- the receiving side of one pair --------------------------------------------------------------


class RecvPair:
    """Rank 0 of a pair: one thread that pairs, then serves doorbells until stopped or broken."""

    def __init__(self, hooks: RecvHooks, settings: PairSettings, sender: str) -> None:
        self.sender = sender
        self.pair_id = ""
        self.seq = 0
        self.serving = False  # paired: woken through its doorbell, no longer through its claim key
        self._hooks = hooks
        self._s = settings
        self._store: Any = None
        self._group: Any = None
        self._ring: Any = None
        self._deadline = 0.0  # of the pairing: offer, group, handshake, warm-up and ready
        self._laps: list[float] = []  # group, handshake and warm-up milliseconds
        self._warmup_bytes = 0
        self._posted: collections.deque[_PostedRecv] = collections.deque()  # admitted, not yet notified
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"nccl-recv:{settings.name}<-{sender}", daemon=True)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def start(self) -> None:
        self._thread.start()

    def stop(self, store: Any) -> None:
        """End the thread: set the flag, then wake its store wait with ``store`` (the transport's).

        Pairing, it waits on its claim key: retracting the offer wakes it (and no sender can join
        afterwards). Serving, it waits on its doorbell: a BYE there wakes it, placed only where
        no header is. Writes announced before it stopped are still received, each by its own
        deadline; one that does not land is reported through ``RecvHooks.write_failed`` once the
        pair is torn down. A wake that misses (the doorbell moved on meanwhile) costs at most
        ``STOP_CHECK_S``: an idle serving thread re-checks the flag that often.
        """
        self._stopping.set()
        if not self.pair_id or store is None:
            return  # not offered yet: it checks the flag right after offering
        try:
            if self.serving:
                store.compare_set(wire.doorbell_key(self.pair_id, self.seq), "", wire.BYE.encode())
            else:
                store.add(wire.claim_key(self.pair_id), 1)
        except group_ops.dist_errors() as exc:
            logger.debug("%s: could not wake pair %s: %s", self._s.name, self.pair_id, exc)

    def join(self, timeout_s: float) -> bool:
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        why = "the pair stopped"
        try:
            enter_device(self._s)
            if self._pair() and self._hooks.on_paired(self):
                self._ready()
                self._serve()
        except (TransportError, ProtocolError) as exc:
            why = f"the pair broke: {exc}"
            logger.warning(
                "%s: pair %s with %s ended: %s", self._s.name, self.pair_id or "(unpaired)", self.sender, exc
            )
        except Exception as exc:  # a thread must not die silently
            why = f"the pair's thread failed: {exc}"
            logger.exception("%s: receiver thread of pair %s with %s failed", self._s.name, self.pair_id, self.sender)
        finally:
            if self._teardown():
                self._report_unfinished(why)
            self._group = self._store = self._ring = None
            self._hooks.on_ended(self)

    def _teardown(self) -> bool:
        """Abort the group, drop the receives' Works, drain the staging copies: after this no byte
        of the pair lands. False if the copies did not drain by ``timeout_s``."""
        group_ops.drop_group(self._group)
        for posted in self._posted:
            posted.works.clear()  # a Gloo op reads or writes its buffer until its Work is gone
            posted.finishers.clear()
        if self._ring is None or self._ring.quiesce(time.monotonic() + self._s.timeout_s):
            return True
        logger.error("%s: staging copies of pair %s did not drain; its %d failed write(s) are left to the "
                     "receiver's write window", self._s.name, self.pair_id, len(self._posted))
        return False

    def _report_unfinished(self, why: str) -> None:
        """Every admitted write not notified failed: say so (after teardown: nothing more of it lands)."""
        posted, self._posted = self._posted, collections.deque()
        for write in posted:
            if write.header.notif:
                self._hooks.write_failed(self.sender, write.header.notif, why)
        if posted:
            logger.warning("%s: %d write(s) from %s on pair %s did not land: %s", self._s.name, len(posted),
                           self.sender, self.pair_id, why)

    def _pair(self) -> bool:
        """Offer a fresh pair id; once the sender claims it, join the group as rank 0.

        False when stopped before pairing; PeerUnreachable when the sender did not come within
        ``timeout_s`` (the offer is then retracted: a late sender cannot join a group nobody serves).
        """
        deadline = self._deadline = time.monotonic() + self._s.timeout_s
        self._store = group_ops.store_client(self._s.host, self._s.port, self._s.timeout_s)
        try:
            gen = self._store.add(wire.generation_key(self.sender), 1)
            self.pair_id = f"{self.sender}/{gen}"
            self._store.set(wire.offer_key(self.sender), self.pair_id)
            if self._stopping.is_set() or not self._await_claim(deadline):
                return False
            watch = Stopwatch()  # from the claim on: the time the sender waits for us
            join_s = max(group_ops.remaining_s(deadline), 0.001)
            self._group = group_ops.new_group(
                self._store, self.pair_id, 0, self._s.device, self._s.host, join_s, self._s.watchdog_s
            )
            self.serving = True  # from here stop() wakes the doorbell
            self._laps.append(watch.lap())
            group_ops.handshake(self._group, 0, self._s.device, deadline)
            self._laps.append(watch.lap())
            self._warmup_bytes = group_ops.warm_up(self._group, 0, self._s.device, deadline)
            self._laps.append(watch.lap())
        except (*group_ops.dist_errors(), TransportError) as exc:
            if isinstance(exc, PeerUnreachable):
                raise
            raise PeerUnreachable(f"pairing with {self.sender} failed: {exc}") from exc
        return True

    def _ready(self) -> None:
        """Registered with the transport: tell the sender, whose connect() returns then."""
        watch = Stopwatch()
        try:
            group_ops.ready(self._group, 0, self._s.device, self._deadline)
        except (*group_ops.dist_errors(), TransportError) as exc:
            raise PeerUnreachable(f"pairing with {self.sender} failed at its last step: {exc}") from exc
        report = PairingReport("receiver", self.sender, self.pair_id, *self._laps, watch.lap(), self._warmup_bytes)
        report.log(self._s.name)
        self._hooks.on_report(report)

    def _await_claim(self, deadline: float) -> bool:
        """Wait until the claim key exists: True if the sender claimed, False if we were stopped."""
        key = wire.claim_key(self.pair_id)
        try:
            self._store.wait([key], group_ops.timedelta_s(group_ops.remaining_s(deadline)))
        except group_ops.dist_errors() as exc:
            if not group_ops.is_store_timeout(exc):
                raise
            if self._store.add(key, 1) == 1:  # retracted before any sender claimed it
                raise PeerUnreachable(
                    f"sender did not join pair {self.pair_id} within {self._s.timeout_s:.1f}s (p2p.transfer_timeout_s)"
                ) from exc
        return not self._stopping.is_set()

    def _serve(self) -> None:
        """Serve doorbells in order, keeping up to RECV_AHEAD writes' receives posted.

        Posting the next write's receives before the previous one completed keeps the GPU busy
        between writes (NCCL runs the ops of one pair in order); a notification still goes out
        only once its own write's bytes all landed, in doorbell order. Stopped or told BYE, the
        writes already announced are still received (each by its deadline) before it returns.
        """
        regions = self._hooks.region_bytes
        posted = self._posted
        while not self._stopping.is_set():
            if posted and self._done(posted[0]):
                self._complete_oldest()
                continue
            header = self._next_header(block=not posted) if len(posted) < RECV_AHEAD else None
            if header is None:
                if posted and self._s.cuda and time.monotonic() < posted[0].deadline:
                    time.sleep(group_ops.POLL_S)  # NCCL: poll the oldest while looking for doorbells
                elif posted:
                    self._complete_oldest()  # Gloo learns completion only by waiting
                continue
            if header.kind is wire.HeaderKind.BYE:
                break
            header.check_fits(regions())
            self._hooks.admit(self.sender, header)  # before any byte of it is received
            self._post_receives(header)
            if len(posted) >= RECV_AHEAD and not self._s.cuda:
                self._complete_oldest()
        while posted:  # writes announced before the stop or the BYE are still received
            self._complete_oldest()
        why = "stopped" if self._stopping.is_set() else "closed by the sender"
        logger.info("%s: pair %s with %s %s", self._s.name, self.pair_id, self.sender, why)

    def _complete_oldest(self) -> None:
        """Complete the oldest posted write; it leaves ``_posted`` only once notified."""
        self._complete(self._posted[0])
        self._posted.popleft()

    def _done(self, posted: _PostedRecv) -> bool:
        """NCCL: every receive of this write completed (no wait). Gloo: never known before a wait."""
        return self._s.cuda and (not posted.works or posted.works[-1].is_completed())  # ops run in order

    def _next_header(self, block: bool = True) -> wire.Header | None:
        """The header of doorbell ``seq`` (consumed); None after an idle wait, or at once when
        ``block`` is False and the doorbell has not rung yet."""
        key = wire.doorbell_key(self.pair_id, self.seq)
        try:
            if not block:
                if not self._store.check([key]):
                    return None
            else:
                self._store.wait([key], group_ops.timedelta_s(STOP_CHECK_S))
        except group_ops.dist_errors() as exc:
            if group_ops.is_store_timeout(exc):
                return None
            raise TransportError(f"lost the store while waiting for a write: {exc}") from exc
        try:
            raw = self._store.get(key)
            self._store.delete_key(key)
        except group_ops.dist_errors() as exc:
            raise TransportError(f"lost the store while reading a write header: {exc}") from exc
        self.seq += 1
        return wire.Header.decode(raw)

    def _post_receives(self, header: wire.Header) -> None:
        """Post a receive for every chunk straight into its slot view (or through a bounce).

        The write joins ``_posted`` first: one whose receives were only partly posted is reported too."""
        posted = _PostedRecv(header, time.monotonic() + self._s.timeout_s)
        self._posted.append(posted)
        try:
            for chunk in header.chunks:
                view = self._hooks.slot_view(chunk)
                posted.works.extend(self._recv_into(view, header.piece_bytes, posted.deadline, posted.finishers))
        except group_ops.dist_errors() as exc:
            raise TransportError(f"posting receives for {header.nbytes} bytes failed: {exc}") from exc

    def _complete(self, posted: _PostedRecv) -> None:
        """Wait (deadline: transfer timeout) until every byte of a write landed; then notify."""
        header = posted.header
        what = f"write of {header.nbytes} bytes from {self.sender}"
        for work in posted.works:
            group_ops.wait_work(work, posted.deadline, what, self._s.cuda)
        for finish in posted.finishers:
            finish(posted.deadline)
        if header.notif:
            self._hooks.notify(self.sender, header.notif)

    def _recv_into(self, view: torch.Tensor, piece_bytes: int, deadline: float, finishers: list[Any]) -> list[Any]:
        spans = wire.pieces(view.numel(), piece_bytes)
        if not self._s.cuda and view.device.type != "cpu":
            import torch

            bounce = torch.empty(view.numel(), dtype=torch.uint8)  # Gloo receives into host memory only
            finishers.append(lambda _deadline, dst=view, src=bounce: dst.copy_(src))
            view = bounce
        if self._s.cuda and view.device.type == "cpu":
            from lmcache_p2p.transport.nccl.staging import CopyOut

            ring = self._recv_ring()
            works = ring.recv(self._group, view, piece_bytes, deadline)
            copy_out = next((f for f in finishers if isinstance(f, CopyOut)), None)
            if copy_out is None:
                copy_out = CopyOut(ring)
                finishers.append(copy_out)
            copy_out.upto = works[-1]
            return works
        return [self._group.recv([view[off : off + n]], 1, 0) for off, n in spans]

    def _recv_ring(self) -> Any:
        if self._ring is None:
            from lmcache_p2p.transport.nccl.staging import RecvRing

            self._ring = RecvRing(self._s.device, self._s.stage_slot_bytes, self._s.stage_slots)
        return self._ring
