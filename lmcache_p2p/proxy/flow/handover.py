"""One request's KV handover: the waiter for "KV ready on every rank of the decoder", the wait and
what follows a failure or timeout (``--on-kv-failure``), and how it ends: taken by the decode that
reached the decoder (then cancelled once that decode produced output, freeing the slots the engine
did not load), or abandoned and cancelled on every rank of the decoder (``handover/cancel.py``).

It owns the attempts (a fresh ``req_id`` each) and their waiters. It must not choose instances or
send prefills: a retry prefill is the caller's (``retry`` below), the decoder comes from the
placement (``flow/placement.py``). Nothing here waits without a deadline (``--kv-timeout-s``).
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from lmcache_p2p.proxy.errors import KvNotReady, ProxyError
from lmcache_p2p.proxy.flow.context import RequestContext, Services
from lmcache_p2p.proxy.flow.placement import Placement
from lmcache_p2p.proxy.router.registry import Lease
from lmcache_p2p.proxy.settings import KvFailurePolicy
from lmcache_p2p.proxy.http.shaping import kv_transfer_params
from lmcache_p2p.proxy.handover.waiters import KvOutcome, KvStatus, KvWaiter

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class _Attempt:
    """One attempt at getting a request's KV onto ``decoder``, under a fresh ``req_id``."""

    waiter: KvWaiter
    decoder: Lease  # the lease whose buffer credit this KV takes
    prefill_sent: bool = True  # False once every prefiller refused the connection: no KV can be on its way

    @property
    def req_id(self) -> str:
        return self.waiter.req_id


class KvHandover:
    def __init__(self, services: Services, ctx: RequestContext, placement: Placement) -> None:
        self._s = services
        self._ctx = ctx
        self._placement = placement
        self._current: _Attempt | None = None
        self._taken: _Attempt | None = None  # the attempt the running decode took: cancelled after its 1st output
        self.outcome: KvOutcome | None = None  # the last wait's

    @property
    def pending(self) -> bool:
        """A KV handover is under way that no decode has taken yet."""
        return self._current is not None

    def begin(self) -> dict[str, Any]:
        """Register a fresh waiter for a fresh req_id on the leased decoder (before its prefill is sent);
        returns the prefill's ``kv_transfer_params``."""
        lease = self._placement.lease()
        decoder = lease.instance
        self.abandon("superseded by a new prefill")
        req_id = uuid.uuid4().hex
        self._current = _Attempt(self._s.waiters.register(req_id, decoder.tp_size), lease)
        self._ctx.timeline.req_id, self._ctx.timeline.tp_size = req_id, decoder.tp_size
        return kv_transfer_params(req_id, decoder)

    def not_sent(self) -> None:
        """Every prefiller refused the connection: no KV is on its way (nothing to cancel)."""
        if self._current is not None:
            self._current.prefill_sent = False

    def take(self) -> None:
        """The decode goes to the decoder holding the KV: it takes the handover."""
        if self._current is not None:
            self._current.waiter.drop()
            self._taken, self._current = self._current, None

    def free_taken(self) -> None:
        """The decode produced output (or moved): its engine loaded what it will load; free what is left."""
        taken, self._taken = self._taken, None
        if taken is not None and taken.prefill_sent:
            self._s.canceller.cancel(taken.decoder.instance, taken.req_id,
                                     "the decode is running: free the KV its engine did not load")

    def abandon(self, reason: str) -> None:
        """The decode will not take this handover's KV: stop waiting, and tell its decoder to free it."""
        attempt, self._current = self._current, None
        if attempt is None:
            return
        attempt.waiter.drop()
        attempt.decoder.return_credit()
        if attempt.prefill_sent:
            self._s.canceller.cancel(attempt.decoder.instance, attempt.req_id, reason)

    async def settle(self, retry: Callable[[], Awaitable[None]]) -> None:
        """Wait for the KV; on a failure or timeout do what ``--on-kv-failure`` says (``retry``: prefill
        once more, then recompute)."""
        if self._current is None:  # colocated: no KV comes
            return
        outcome = await self._wait()
        if outcome.status is KvStatus.READY:
            return
        policy = self._s.settings.on_kv_failure
        if policy is KvFailurePolicy.RECOMPUTE:
            self._give_up(outcome, "the decoder recomputes")
            return
        if policy is KvFailurePolicy.FAIL:
            self._give_up(outcome, "answering an error (--on-kv-failure=fail)")
            status = 504 if outcome.status is KvStatus.TIMEOUT else 502
            raise KvNotReady(f"KV for the request did not reach the decoder: {outcome.reason} "
                             "(--on-kv-failure=fail)", status_code=status)
        self._give_up(outcome, "retrying the prefill once")
        try:
            await retry()
        except ProxyError as exc:
            logger.warning("request %s: the retry prefill failed (%s); the decoder recomputes", self._ctx.response_id,
                           exc)
            self.abandon(f"the retry prefill failed: {exc}")
            return
        outcome = await self._wait()
        if outcome.status is not KvStatus.READY:
            self._give_up(outcome, "the decoder recomputes")

    async def _wait(self) -> KvOutcome:
        if self._current is None:
            raise RuntimeError("no KV handover: prefill() first")
        waiter = self._current.waiter
        outcome = await waiter.wait(self._s.settings.kv_timeout_s)
        self._placement.lease().settle()
        m = self._s.metrics
        m.kv_outcomes.labels(outcome.status.value).inc()
        m.observe_kv_wait(outcome.wait_s)
        if outcome.status is KvStatus.READY:
            m.kv_bytes.inc(outcome.nbytes)
            self._ctx.timeline.kv_ready_s = waiter.ready_at_s
        self.outcome = outcome
        return outcome

    def _give_up(self, outcome: KvOutcome, action: str) -> None:
        attempt = self._current
        logger.warning("request %s: KV %s (req_id %s, decoder %s): %s; %s", self._ctx.response_id,
                       outcome.status.value, attempt.req_id if attempt else "?",
                       attempt.decoder.instance.instance_id if attempt else "?", outcome.reason, action)
        self.abandon(f"KV {outcome.status.value}: {outcome.reason}")
