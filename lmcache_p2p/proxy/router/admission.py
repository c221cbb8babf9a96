"""Admission: a request whose KV has no room in any decoder buffer waits here, like vLLM queues.

A disaggregated request needs buffer credit on a decoder for its KV (``router/registry.py``). When no
decoder has room, the request waits in one bounded, fair queue until credit frees (a decoder loaded,
cancelled or failed a request's KV, a heartbeat announced free slots, a decoder joined); the registry
tells :meth:`AdmissionQueue.poke` of each such change, which retries the waiters in arrival order.

    admission = await queue.admit(grant)     # grant() -> a Lease, None (no room now), or raises CannotAdmit
    if admission.granted is None:            # TIMEOUT, QUEUE_FULL or REFUSED: the caller serves the
        ...                                  # request another way (a decoder recomputes the prompt)

Fairness: FIFO. A waiter further back may be admitted past one that does not fit yet (a small
request past a large one), but each waiter can be overtaken at most ``max_overtakes`` times; after
that nobody behind it is admitted before it, so a large request is never starved by small ones.

Bounds (every wait is finite):

* ``--admission-timeout-s``: the longest a request waits. Then it is not refused: ``flow/flow.py`` lets
  a decoder compute the prompt itself (no KV transfer), flagged ``colocated{reason=admission_timeout}``.
* ``--admission-queue-max``: the most requests that wait at once. One more is not queued (and not
  refused): a decoder computes its prompt at once (``reason=admission_queue_full``). The proxy
  answers 503 only when no instance at all could serve the request.
* a request that can never be admitted (its KV is larger than every buffer, or no decoder is left
  to pair with) leaves the queue at once (``grant`` raises :class:`CannotAdmit`).

Single event loop; ``poke`` never awaits, so the registry may call it from anywhere.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import time
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

DEFAULT_MAX_OVERTAKES = 8


class Releasable(Protocol):
    def release(self) -> None: ...


T = TypeVar("T", bound=Releasable)


class CannotAdmit(Exception):  # noqa: N818 - a signal from a grant function, not an error to report
    """Raised by a grant function: this request can never be admitted (``reason`` says why)."""

    def __init__(self, reason: Any, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Outcome(str, enum.Enum):
    IMMEDIATE = "immediate"  # granted without waiting
    ADMITTED = "admitted"  # granted after a wait
    TIMEOUT = "timeout"  # no credit within --admission-timeout-s
    QUEUE_FULL = "queue_full"  # --admission-queue-max requests were already waiting
    REFUSED = "refused"  # the grant function said it can never succeed (CannotAdmit)


@dataclasses.dataclass(frozen=True)
class Admission(Generic[T]):
    outcome: Outcome
    granted: T | None
    wait_s: float
    refusal: CannotAdmit | None = None

    @property
    def message(self) -> str:
        return str(self.refusal) if self.refusal is not None else self.outcome.value


@dataclasses.dataclass(eq=False)
class _Waiter(Generic[T]):
    grant: Callable[[], T | None]
    future: asyncio.Future[T]
    overtaken: int = 0


class AdmissionQueue:
    def __init__(self, timeout_s: float, max_waiting: int, *, max_overtakes: int = DEFAULT_MAX_OVERTAKES,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._timeout_s = timeout_s
        self._max_waiting = max_waiting
        self._max_overtakes = max_overtakes
        self._clock = clock
        self._waiters: collections.deque[_Waiter[Any]] = collections.deque()
        self._poking = False
        self._poke_again = False

    def __len__(self) -> int:
        """Requests waiting now."""
        return len(self._waiters)

    async def admit(self, grant: Callable[[], T | None]) -> Admission[T]:
        """Wait (bounded) until ``grant()`` returns a grant, in turn with the other waiters.

        ``grant`` must not await; it returns None while there is no room and raises
        :class:`CannotAdmit` when there never will be. A grant handed out after the caller was
        cancelled is released.
        """
        start_s = self._clock()
        waiter: _Waiter[T] = _Waiter(grant, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self.poke()
        immediate = waiter.future.done()
        if not immediate:
            if len(self._waiters) > self._max_waiting:
                self._remove(waiter)
                waiter.future.cancel()
                return Admission(Outcome.QUEUE_FULL, None, 0.0)
            try:
                await asyncio.wait({waiter.future}, timeout=self._timeout_s)
            except BaseException:
                self._abandon(waiter)
                raise
        self._remove(waiter)
        wait_s = self._clock() - start_s
        if not waiter.future.done():
            waiter.future.cancel()
            self.poke()  # it may have held back the waiters behind it
            return Admission(Outcome.TIMEOUT, None, wait_s)
        exc = waiter.future.exception()
        if isinstance(exc, CannotAdmit):
            return Admission(Outcome.REFUSED, None, wait_s, exc)
        if exc is not None:
            raise exc
        return Admission(Outcome.IMMEDIATE if immediate else Outcome.ADMITTED, waiter.future.result(), wait_s)

    def poke(self) -> None:
        """Credit may have freed: admit the waiters that fit now, in turn. Never awaits; re-entrant
        calls (a grant that releases something) run once more after the current pass."""
        if self._poking:
            self._poke_again = True
            return
        self._poking = True
        try:
            self._poke_again = True
            while self._poke_again:
                self._poke_again = False
                self._pass()
        finally:
            self._poking = False

    def _pass(self) -> None:
        passed: list[_Waiter[Any]] = []  # waiting ahead of the one being tried, not admitted in this pass
        for waiter in list(self._waiters):
            if waiter.future.done():
                continue
            try:
                granted = waiter.grant()
            except CannotAdmit as exc:
                self._remove(waiter)
                waiter.future.set_exception(exc)
                continue
            except Exception as exc:  # a bug in the grant: fail this request only
                self._remove(waiter)
                waiter.future.set_exception(exc)
                continue
            if granted is None:
                passed.append(waiter)
                if waiter.overtaken >= self._max_overtakes:
                    return  # nobody behind it goes first any more
                continue
            self._remove(waiter)
            waiter.future.set_result(granted)
            for ahead in passed:
                ahead.overtaken += 1

    def _remove(self, waiter: _Waiter[Any]) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass

    def _abandon(self, waiter: _Waiter[Any]) -> None:
        """The caller is gone (cancelled): leave the queue; release a grant it will never use."""
        self._remove(waiter)
        fut = waiter.future
        if not fut.done():
            fut.cancel()
        elif not fut.cancelled() and fut.exception() is None:
            fut.result().release()
        self.poke()
