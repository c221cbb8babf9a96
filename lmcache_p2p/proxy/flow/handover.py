"""One request's KV handover: its attempts (one per prefill, made by the decoder's backend,
``flow/backends.py``: for ours a waiter for "KV ready on every rank of the decoder", for vLLM's
NixlConnector the prefill answer's pull parameters), the wait and what follows a failure or timeout
(``--on-kv-failure``), and how it ends: taken by the decode that reached the decoder (then, for ours,
cancelled once that decode produced output, freeing the slots the engine did not load), or abandoned
and cancelled on every rank of the decoder (``handover/cancel.py``).

It owns the attempts (a fresh ``req_id`` each) and what the decode carries of them. It must not choose instances or
send prefills: a retry prefill is the caller's (``retry`` below), the decoder comes from the
placement (``flow/placement.py``). Nothing here waits without a deadline (``--kv-timeout-s``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from lmcache_p2p.proxy.errors import KvNotReady, ProxyError
from lmcache_p2p.proxy.flow.backends import KvAttempt, KvBackend, backend_of
from lmcache_p2p.proxy.flow.context import RequestContext, Services
from lmcache_p2p.proxy.flow.placement import Placement
from lmcache_p2p.proxy.settings import KvFailurePolicy
from lmcache_p2p.proxy.handover.waiters import KvOutcome, KvStatus
from lmcache_p2p.proxy.router.instances import Backend

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DecodeKv:
    """What a decode that takes a handover carries: its ``kv_transfer_params`` (None: none) and how many
    output tokens end the prompt whose KV it takes (the decode is prompted with exactly that prompt when
    ``prompt_fixed``; see ``flow/backends.py``)."""

    params: dict[str, Any] | None
    output_tokens: int
    prompt_fixed: bool
    backend: Backend  # a decoder of another backend takes none of it (it recomputes)


class KvHandover:
    def __init__(self, services: Services, ctx: RequestContext, placement: Placement) -> None:
        self._s = services
        self._ctx = ctx
        self._placement = placement
        self._current: KvAttempt | None = None
        self._taken: KvAttempt | None = None  # the attempt the running decode took: cancelled after its 1st output
        self._kv: DecodeKv | None = None  # what the decode carries, as of the last take
        self.outcome: KvOutcome | None = None  # the last wait's

    @property
    def pending(self) -> bool:
        """A KV handover is under way that no decode has taken yet."""
        return self._current is not None

    @property
    def backend(self) -> KvBackend:
        """The strategy of the leased decoder's backend."""
        return backend_of(self._placement.lease().instance)

    def begin(self, output_tokens: int = 0) -> dict[str, Any]:
        """A fresh attempt (for ours: a waiter for a fresh req_id) on the leased decoder, before its prefill is
        sent, for the prompt + ``output_tokens`` output tokens; returns the prefill's ``kv_transfer_params``."""
        lease = self._placement.lease()
        decoder = lease.instance
        self.abandon("superseded by a new prefill")
        attempt = self._current = backend_of(decoder).attempt(self._s, lease, output_tokens)
        self._ctx.timeline.req_id, self._ctx.timeline.tp_size = attempt.req_id, decoder.tp_size
        self._ctx.timeline.backend = decoder.backend.value
        return attempt.prefill_params

    def answered(self, answer: dict[str, Any]) -> None:
        """The prefill of the current attempt answered."""
        if self._current is not None:
            self._current.answered(answer)

    def not_sent(self) -> None:
        """Every prefiller refused the connection: no KV is on its way (nothing to cancel)."""
        if self._current is not None:
            self._current.prefill_sent = False

    def take(self) -> DecodeKv | None:
        """The decode goes to the decoder holding the KV: it takes the handover. What that decode carries
        (None: no KV comes with it): a new attempt's, else the last one's while its KV is still unread (a
        decode that was refused before it reached its decoder)."""
        if self._current is not None:
            attempt = self._current
            attempt.drop()
            self._taken, self._current = attempt, None
            backend = backend_of(attempt.decoder.instance)
            self._kv = DecodeKv(attempt.decode_params(), attempt.output_tokens,
                                backend.decode_prompt_is_prefill_prompt, backend.backend)
        return self._kv

    def free_taken(self) -> None:
        """The decode produced output: its engine loaded what it will load; free what is left."""
        taken, self._taken = self._taken, None
        self._kv = None  # read by the decoder that produced output: no other decoder may take it
        if taken is not None:
            taken.cancel(self._s, "the decode is running: free the KV its engine did not load")

    def moved(self) -> None:
        """The decode moves to another decoder before it produced output (its connection was refused): the KV
        it took stays for the next decoder where the backend's can (pulled), else is freed."""
        if self._kv is not None and self._kv.params is None:
            self.free_taken()

    def abandon(self, reason: str) -> None:
        """The decode will not take this handover's KV: stop waiting, and tell its decoder to free it."""
        attempt, self._current = self._current, None
        if attempt is None:
            return
        attempt.drop()
        attempt.decoder.return_credit()
        attempt.cancel(self._s, reason)

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
        attempt = self._current
        outcome = await attempt.wait(self._s.settings.kv_timeout_s)
        if not backend_of(attempt.decoder.instance).decoder_keeps_kv:
            self._placement.lease().settle()  # its slots are reserved: the next heartbeat counts them
        m = self._s.metrics
        m.kv_outcomes.labels(outcome.status.value).inc()
        m.observe_kv_wait(outcome.wait_s)
        if outcome.status is KvStatus.READY:
            m.kv_bytes.inc(outcome.nbytes)
            ready_at_s = attempt.ready_at_s  # None: ready with the prefill's answer (the decoder pulls it)
            timeline = self._ctx.timeline
            timeline.kv_ready_s = ready_at_s if ready_at_s is not None else timeline.prefill_answered_s
        self.outcome = outcome
        return outcome

    def _give_up(self, outcome: KvOutcome, action: str) -> None:
        attempt = self._current
        logger.warning("request %s: KV %s (req_id %s, decoder %s): %s; %s", self._ctx.response_id,
                       outcome.status.value, attempt.req_id if attempt else "?",
                       attempt.decoder.instance.instance_id if attempt else "?", outcome.reason, action)
        self.abandon(f"KV {outcome.status.value}: {outcome.reason}")
