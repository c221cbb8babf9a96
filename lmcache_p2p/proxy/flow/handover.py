"""One request's KV handover: its attempts (one per prefill, made by the decoder's backend,
``flow/backends.py``: for ours a waiter for "KV ready on every rank of the decoder", for vLLM's
NixlConnector the prefill answer's pull parameters), the wait and what follows a failure or timeout
(``--on-kv-failure``), and how it ends: taken by the decode that reached the decoder (then, for ours,
cancelled once that decode produced output, freeing the slots the engine did not load), or abandoned
and cancelled on every rank of the decoder (``handover/cancel.py``).

A handover that cannot happen ends its wait as soon as that is known, not at ``--kv-timeout-s``: a
KvFailed (the prefiller could not reach the decoder, the decoder refused or lost the slots), the
decoder taken out by the registry (``KvWaiters.decoder_down``), or the decoder's ``GET /health``
unanswered while the KV is overdue (probed every ``--kv-probe-after-s``). When the decoder is known
down or unreachable, the request fails over without it: ``retry`` prefills once more towards another
decoder, and otherwise (or with ``recompute``) the prefiller that computed the prompt continues the
decode (its prefix cache holds the prompt), else another instance computes it
(``Placement.continue_without``). The KV timeout stays the bound of last resort.

With ``--early-decode`` (``go_early``) the decode takes an lmcache_p2p attempt before its KV is ready: it
carries the attempt's marker, the wait runs beside it (``flow/early.py`` decides what came first), and a KV
that fails first takes the same path as a wait that failed before the decode (``fail_over``).

It owns the attempts (a fresh ``req_id`` each), what the decode carries of them, and the probe of their
decoder. It must not choose instances or send prefills: a retry prefill is the caller's (``retry`` below), the
decoder comes from the placement (``flow/placement.py``). Nothing here waits without a deadline (``--kv-timeout-s``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from lmcache_p2p.config import Role
from lmcache_p2p.protocol import KvFailCause
from lmcache_p2p.proxy.errors import KvNotReady, ProxyError, UpstreamError
from lmcache_p2p.proxy.flow.backends import KvAttempt, KvBackend, backend_of
from lmcache_p2p.proxy.flow.context import RequestContext, Services
from lmcache_p2p.proxy.flow.early import Early, EarlyRace
from lmcache_p2p.proxy.flow.placement import Placement
from lmcache_p2p.proxy.router.health import HEALTH_PATH
from lmcache_p2p.proxy.router.registry import Instance
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
    portable: bool  # the params take the KV to any decoder of the backend (pulled); else only to the attempt's
    request_id: str | None = None  # the X-Request-Id it carries: its prefill's (see ``KvAttempt.request_id``)


class KvHandover:
    def __init__(self, services: Services, ctx: RequestContext, placement: Placement) -> None:
        self._s = services
        self._ctx = ctx
        self._placement = placement
        self._current: KvAttempt | None = None
        self._taken: KvAttempt | None = None  # the attempt the running decode took: cancelled after its 1st output
        self._kv: DecodeKv | None = None  # what the decode carries, as of the last take
        self._early: EarlyRace | None = None  # the KV wait beside a decode sent before it (--early-decode)
        self._early_attempt: KvAttempt | None = None  # that decode's attempt
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

    @property
    def request_id(self) -> str | None:
        """The ``X-Request-Id`` the current attempt's prefill carries (None: none)."""
        return self._current.request_id if self._current is not None else None

    def answered(self, answer: dict[str, Any], endpoint: str, decode_endpoint: str) -> None:
        """The prefill of the current attempt answered (it was sent to ``endpoint``; its decode goes to
        ``decode_endpoint``)."""
        if self._current is not None:
            self._current.answered(answer, endpoint, decode_endpoint)

    def not_sent(self) -> None:
        """Every prefiller refused the connection: no KV is on its way (nothing to cancel)."""
        if self._current is not None:
            self._current.prefill_sent = False

    def take(self) -> DecodeKv | None:
        """The decode goes to the decoder holding the KV: it takes the handover. What that decode carries
        (None: no KV comes with it): a new attempt's, else the last one's while its KV is still unread (a
        decode that was refused before it reached its decoder). An early decode's attempt keeps its waiter:
        its wait runs on beside the decode."""
        if self._current is not None:
            attempt = self._current
            early = attempt is self._early_attempt
            if not early:
                attempt.drop()
            self._taken, self._current = attempt, None
            backend = backend_of(attempt.decoder.instance)
            pulled = attempt.decode_params()
            params = attempt.early_params(len(self._ctx.prompt_ids) + attempt.output_tokens) if early else pulled
            self._kv = DecodeKv(params, attempt.output_tokens, backend.decode_prompt_is_prefill_prompt,
                                backend.backend, pulled is not None, attempt.request_id)
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
        if self._kv is not None and not self._kv.portable:
            self.free_taken()

    def abandon(self, reason: str) -> None:
        """The decode will not take this handover's KV: stop waiting, and tell its decoder to free it."""
        attempt, self._current = self._current, None
        if attempt is None:
            return
        attempt.drop()
        attempt.decoder.return_credit()
        attempt.cancel(self._s, reason)

    async def settle(self, retry: Callable[[Collection[str]], Awaitable[None]]) -> None:
        """Wait for the KV; on a failure or timeout do what ``--on-kv-failure`` says (``fail_over``)."""
        if self._current is None:  # colocated: no KV comes
            return
        outcome = await self._wait(self._current)
        if outcome.status is not KvStatus.READY:
            await self.fail_over(outcome, retry)

    def go_early(self) -> bool:
        """``--early-decode``: the current attempt's decode goes before its KV is ready, and its wait runs beside
        it; whether it does (an attempt of a backend whose decode may, its prefill sent)."""
        attempt = self._current
        if (not self._s.settings.early_decode or attempt is None or not attempt.prefill_sent
                or not backend_of(attempt.decoder.instance).decodes_early):
            return False
        self.stop_early()
        self._early_attempt = attempt
        self._early = EarlyRace(self._wait(attempt), self._count_early, f"kv-early-{attempt.req_id}")
        self._ctx.timeline.early_decode = True
        return True

    async def early_failure(self) -> KvOutcome | None:
        """The early decode's KV failure when it came before the decode's first output (the decode is given up:
        its attempt is the current one again, for ``fail_over``); None when the decode goes on."""
        early, attempt = self._early, self._early_attempt
        if early is None or attempt is None:
            return None
        failed = await early.decided()
        if failed is not None and self._taken is attempt:
            self._current, self._taken, self._kv = attempt, None, None
        return failed

    def decode_first(self) -> bool:
        """The early decode produced its first output; False when the KV's failure gave it up already (that
        output is not the request's). The wait goes on, for the KV's figures."""
        return self._early is None or self._early.decode_first()

    def decode_left(self) -> None:
        """The decode left its decoder (refused, broke): a wait beside it stops (its KV is freed, not awaited)."""
        if self._early is not None:
            self._early.decode_first()
            self.stop_early()

    def stop_early(self) -> None:
        """Stop the wait beside an early decode, if one runs (the request closes); never awaits."""
        early, attempt, self._early, self._early_attempt = self._early, self._early_attempt, None, None
        if early is not None and attempt is not None:
            early.stop()
            attempt.drop()

    async def fail_over(self, outcome: KvOutcome, retry: Callable[[Collection[str]], Awaitable[None]]) -> None:
        """The current attempt's KV failed or timed out: what ``--on-kv-failure`` says, without its decoder when
        that is known down or unreachable (``retry`` avoids it, and the prefiller continues instead of it
        recomputing)."""
        if self._current is None:
            raise RuntimeError("no KV handover to fail over")
        decoder = self._current.decoder.instance
        policy = self._s.settings.on_kv_failure
        if policy is KvFailurePolicy.FAIL:
            self._give_up(outcome, "answering an error (--on-kv-failure=fail)")
            status = 504 if outcome.status is KvStatus.TIMEOUT else 502
            raise KvNotReady(f"KV for the request did not reach the decoder: {outcome.reason} "
                             "(--on-kv-failure=fail)", status_code=status)
        out = self._out_of_reach(outcome, decoder)
        if policy is KvFailurePolicy.RECOMPUTE:
            self._give_up(outcome, f"{out}: the decode continues without it" if out else "the decoder recomputes")
            self._continue_without(decoder, out)
            return
        self._give_up(outcome, f"{out}: retrying the prefill once towards another decoder" if out
                      else "retrying the prefill once")
        try:
            await retry((decoder.instance_id,) if out else ())
        except ProxyError as exc:
            logger.warning("request %s: the retry prefill failed (%s); %s", self._ctx.response_id, exc,
                           "the decode continues without the decoder" if out else "the decoder recomputes")
            self.abandon(f"the retry prefill failed: {exc}")
            self._continue_without(decoder, out)
            return
        decoder = self._placement.lease().instance
        outcome = await self._wait(self._current)
        if outcome.status is not KvStatus.READY:
            out = self._out_of_reach(outcome, decoder)
            self._give_up(outcome, f"{out}: the decode continues without it" if out else "the decoder recomputes")
            self._continue_without(decoder, out)

    def _out_of_reach(self, outcome: KvOutcome, decoder: Instance) -> str:
        """Why the decode must not go to ``decoder`` after ``outcome`` ("" when it may: it recomputes)."""
        if outcome.status is KvStatus.DECODER_DOWN:
            return f"decoder {decoder.instance_id} is down"
        if outcome.cause is KvFailCause.UNREACHABLE:
            return f"the prefiller cannot reach decoder {decoder.instance_id}"
        if all(d is not decoder for d in self._s.registry.routable(Role.RECEIVER)):
            return f"decoder {decoder.instance_id} is out of rotation"
        return ""

    def _continue_without(self, decoder: Instance, why: str) -> None:
        if why:
            self._placement.continue_without(decoder, why)

    async def _wait(self, attempt: KvAttempt | None) -> KvOutcome:
        if attempt is None:
            raise RuntimeError("no KV handover: prefill() first")
        probe = None
        if self._s.settings.kv_probe_after_s > 0 and attempt.can_be_overdue:
            probe = asyncio.get_running_loop().create_task(self._probe(attempt), name=f"kv-probe-{attempt.req_id}")
        try:
            outcome = await attempt.wait(self._s.settings.kv_timeout_s)
        finally:
            if probe is not None:
                probe.cancel()  # never awaited: it only sleeps or probes, and ends at its next step
        if not backend_of(attempt.decoder.instance).decoder_keeps_kv:
            attempt.decoder.settle()  # its slots are reserved: the next heartbeat counts them
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

    def _count_early(self, first: Early) -> None:
        self._s.metrics.early_decodes.labels(first.value).inc()

    async def _probe(self, attempt: KvAttempt) -> None:
        """While the KV is overdue, probe its decoder every ``--kv-probe-after-s``: one that does not answer
        ends the wait (DECODER_DOWN) and counts towards taking it out of rotation."""
        s = self._s
        decoder = attempt.decoder.instance
        while True:
            await asyncio.sleep(s.settings.kv_probe_after_s)
            try:
                status = await s.upstream.get_status(decoder.http_url, HEALTH_PATH,
                                                     timeout_s=s.settings.health_probe_timeout_s)
            except UpstreamError as exc:
                problem = str(exc)
            else:
                if status == 200:
                    continue
                problem = f"GET {decoder.http_url}{HEALTH_PATH} answered {status}"
            s.registry.note_connect_failure(decoder)
            attempt.on_down(f"decoder {decoder.instance_id} did not answer while its KV was overdue "
                                   f"(--kv-probe-after-s): {problem}")
            return

    def _give_up(self, outcome: KvOutcome, action: str) -> None:
        attempt = self._current
        logger.warning("request %s: KV %s (req_id %s, decoder %s): %s; %s", self._ctx.response_id,
                       outcome.status.value, attempt.req_id if attempt else "?",
                       attempt.decoder.instance.instance_id if attempt else "?", outcome.reason, action)
        self.abandon(f"KV {outcome.status.value}: {outcome.reason}")
