"""Per-request waits for "KV ready" from every TP rank of the chosen decoder.

A waiter is registered under the request's ``req_id`` BEFORE the prefill is sent (the notice often
arrives before the prefill's HTTP answer) and dropped when the request ends, in every way, or its
KV is abandoned. Notices for unknown ``req_id`` (late, after a timeout or a retry, or the KvFailed a
receiver reports for a request the proxy cancelled) are counted and ignored at DEBUG. Matching is
by ``req_id`` alone: it is a fresh uuid per attempt, never parsed for anything.

A wait ends at the first of: KvReady from every rank; a KvFailed (its :class:`KvFailCause` says what
the reporter knows: the prefiller could not reach the decoder, the decoder refused or lost the slots, the
prefiller's own store failed); the decoder known down (``decoder_down``: the registry took it out, or the
request's owner could not reach it); ``--kv-timeout-s``, the bound of last resort when nothing is known.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from collections.abc import Callable

from lmcache_p2p.protocol import KvFailCause, KvFailed, KvReady

logger = logging.getLogger(__name__)


class KvStatus(str, enum.Enum):
    READY = "ready"
    FAILED = "failed"
    TIMEOUT = "timeout"
    DECODER_DOWN = "decoder_down"  # the decoder was known down before its KV was ready


@dataclasses.dataclass(frozen=True)
class KvOutcome:
    status: KvStatus
    wait_s: float  # from the start of the wait (after the prefill answered) to the outcome
    nbytes: int = 0
    chunks: int = 0
    reason: str = ""
    chunks_held: int = 0  # KvReady's new fields (0 from peers that do not send them)
    bytes_received: int = 0
    cause: KvFailCause = KvFailCause.UNKNOWN  # a FAILED outcome's, as its KvFailed said


class KvWaiter:
    def __init__(self, table: KvWaiters, req_id: str, tp_size: int, clock: Callable[[], float],
                 decoder_id: str = "") -> None:
        self.req_id = req_id
        self.tp_size = tp_size
        self.decoder_id = decoder_id  # the instance the KV goes to (``KvWaiters.decoder_down``)
        self._table = table
        self._clock = clock
        self._ready: dict[int, KvReady] = {}
        self._failed: KvFailed | None = None
        self._down = ""  # why the decoder is known down, once it is (and before any KvFailed)
        self._done = asyncio.Event()
        self.ready_at_s: float | None = None  # when the last rank's KvReady arrived (the request's timeline)

    def on_ready(self, msg: KvReady) -> None:
        if not 0 <= msg.tp_rank < self.tp_size:
            logger.warning("KV ready for %s from rank %d, but the decoder has tp %d: ignored",
                           self.req_id, msg.tp_rank, self.tp_size)
            return
        self._ready[msg.tp_rank] = msg
        if len(self._ready) == self.tp_size and not self._done.is_set():
            self.ready_at_s = self._clock()
            self._done.set()

    def on_failed(self, msg: KvFailed) -> None:
        if self._failed is None and not self._down:
            self._failed = msg
        self._done.set()

    def on_down(self, why: str) -> None:
        """The decoder is known down: the KV will not be ready there (ignored once the wait ended)."""
        if self._failed is None and not self._down and not self._done.is_set():
            self._down = why
        self._done.set()

    async def wait(self, timeout_s: float) -> KvOutcome:
        """Wait at most ``timeout_s`` for every rank's notice or the first failure."""
        start = self._clock()
        try:
            await asyncio.wait_for(self._done.wait(), timeout_s)
        except TimeoutError:
            if not self._done.is_set():  # a notice can land while the timed-out wait is being cancelled
                ranks = sorted(self._ready)
                return KvOutcome(KvStatus.TIMEOUT, self._clock() - start,
                                 reason=f"no KV ready within {timeout_s:.1f} s (--kv-timeout-s); ranks ready: {ranks}")
        elapsed_s = self._clock() - start
        if self._failed is not None:
            return KvOutcome(KvStatus.FAILED, elapsed_s, cause=self._failed.cause,
                             reason=f"rank {self._failed.tp_rank} of {self._failed.instance_id}: {self._failed.reason}")
        if self._down:
            return KvOutcome(KvStatus.DECODER_DOWN, elapsed_s, reason=self._down)
        return KvOutcome(
            KvStatus.READY,
            elapsed_s,
            nbytes=sum(m.nbytes for m in self._ready.values()),
            chunks=max(m.chunks for m in self._ready.values()),
            chunks_held=max(m.chunks_held for m in self._ready.values()),
            bytes_received=sum(m.bytes_received for m in self._ready.values()),
        )

    def drop(self) -> None:
        """Idempotent; does not await (safe in a cancelled task)."""
        self._table._drop(self)


class KvWaiters:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._waiters: dict[str, KvWaiter] = {}
        self.unmatched = 0

    def __len__(self) -> int:
        return len(self._waiters)

    def register(self, req_id: str, tp_size: int, decoder_id: str = "") -> KvWaiter:
        if req_id in self._waiters:
            raise ValueError(f"a KV waiter for {req_id} is already registered")
        waiter = KvWaiter(self, req_id, tp_size, self._clock, decoder_id)
        self._waiters[req_id] = waiter
        return waiter

    def deliver(self, msg: KvReady | KvFailed) -> bool:
        """Hand a notice to its waiter; False when no request waits for it."""
        waiter = self._waiters.get(msg.req_id)
        if waiter is None:
            self.unmatched += 1
            logger.debug("%s for %s from %s: no request waits for it", type(msg).__name__, msg.req_id,
                         msg.instance_id)
            return False
        if isinstance(msg, KvReady):
            waiter.on_ready(msg)
        else:
            waiter.on_failed(msg)
        return True

    def decoder_down(self, decoder_id: str, why: str) -> int:
        """End the wait of every request whose KV goes to ``decoder_id`` (DECODER_DOWN); how many."""
        waiting = [w for w in self._waiters.values() if w.decoder_id == decoder_id]
        for waiter in waiting:
            waiter.on_down(why)
        return len(waiting)

    def _drop(self, waiter: KvWaiter) -> None:
        if self._waiters.get(waiter.req_id) is waiter:
            del self._waiters[waiter.req_id]
