"""The receiving half of an NCCL-transport pair (rank 0).

``RecvPair`` owns the thread that pairs with one sender after ``accept`` and then serves its
doorbells: check the header, receive each chunk into its slot, hand the notification to the
transport (or report the write failed once the pair is torn down). It holds the pair's store
client and group and drops them when its thread ends. See transport.py for the whole design.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lmcache_p2p.errors import PeerUnreachable, ProtocolError, TransportError
from lmcache_p2p.transport.nccl import group as group_ops
from lmcache_p2p.transport.nccl import wire
from lmcache_p2p.transport.nccl.pair_common import PairingReport, PairSettings, Stopwatch, enter_device

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

STOP_CHECK_S = 1.0  # an idle serving receiver re-checks its stop flag this often (in case a wake missed)
RECV_AHEAD = 8  # writes whose receives a receiver posts before the oldest of them completes


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
        self._group = None  # Gloo's abort is a no-op: its sockets close when the group is dropped
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
