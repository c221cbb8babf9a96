"""One request, end to end: pick decoder D and prefiller P, prefill on P (its KV goes to D), wait
until every TP rank of D reports the KV ready, then decode on D.

    flow = orchestrator.open(request)
    try:
        first = await flow.prefill()         # the first token (send it to a streaming client now)
        if flow.needs_decode:
            async for delta in flow.decode():  # waits for KV, retries or recomputes, then streams
                ...
    finally:
        flow.close()                         # never awaits: safe in a cancelled task

The waiter for "KV ready" is registered before the prefill is sent. On a KV failure or timeout
(``--kv-timeout-s``) the policy decides: ``retry`` prefills once more (token ids, another pair
when there is one) and then recomputes, ``recompute`` sends the decode at once (the decoder
recomputes what it lacks), ``fail`` answers 502/504. Nothing waits without a deadline.

A prefill or decode whose connection failed (refused / connect timeout: the instance got nothing)
goes to another routable instance of that role, each tried once; a decode that moves to another
decoder recomputes there. Every failed connection counts towards taking the instance out of
rotation (``registry.note_connect_failure``).

A request's KV handover (its ``req_id`` on decoder D) ends in one of two ways: the decode request
reaches D, or the proxy abandons it (KV failed or timed out, the decode moved elsewhere, the first
token ended the output, the client left, an error) and tells every rank of D to free it
(``cancel.py``), unless the prefill never reached a prefiller.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from typing import Any

from lmcache_p2p.config import Role
from lmcache_p2p.proxy.cancel import KvCanceller
from lmcache_p2p.proxy.errors import KvNotReady, ProxyError, UpstreamConnectError, UpstreamMalformed
from lmcache_p2p.proxy.metrics import ProxyMetrics
from lmcache_p2p.proxy.registry import Instance, Lease, Registry
from lmcache_p2p.proxy.responses import Delta, FirstToken, decode_delta, first_token, usage
from lmcache_p2p.proxy.routing import RequestCost, Router, chunks_needed
from lmcache_p2p.proxy.settings import KvFailurePolicy
from lmcache_p2p.proxy.shaping import (
    ClientRequest,
    Endpoint,
    decode_body,
    kv_transfer_params,
    prefill_body,
    retry_prefill_body,
    tokenize_body,
)
from lmcache_p2p.proxy.upstream import Upstream
from lmcache_p2p.proxy.waiters import KvOutcome, KvStatus, KvWaiter, KvWaiters

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class FlowSettings:
    kv_timeout_s: float = 10.0
    prefill_timeout_s: float = 120.0
    decode_idle_timeout_s: float = 120.0
    on_kv_failure: KvFailurePolicy = KvFailurePolicy.RETRY


class Orchestrator:
    def __init__(self, registry: Registry, router: Router, waiters: KvWaiters, upstream: Upstream,
                 canceller: KvCanceller, metrics: ProxyMetrics, settings: FlowSettings,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.registry = registry
        self.router = router
        self.waiters = waiters
        self.upstream = upstream
        self.canceller = canceller
        self.metrics = metrics
        self.settings = settings
        self.clock = clock

    def open(self, req: ClientRequest, headers: Mapping[str, str], received_s: float) -> RequestFlow:
        return RequestFlow(self, req, headers, received_s)


@dataclasses.dataclass(eq=False)
class _Handover:
    """One attempt at getting a request's KV onto ``decoder``, under a fresh ``req_id``."""

    waiter: KvWaiter
    decoder: Instance
    prefill_sent: bool = True  # False once every prefiller refused the connection: no KV can be on its way

    @property
    def req_id(self) -> str:
        return self.waiter.req_id


class RequestFlow:
    def __init__(self, orch: Orchestrator, req: ClientRequest, headers: Mapping[str, str], received_s: float) -> None:
        self._o = orch
        self.req = req
        self.response_id = uuid.uuid4().hex
        self._headers = headers
        self._received_s = received_s
        self._decoder: Lease | None = None
        self._handover: _Handover | None = None
        self._tried: set[str] = set()
        self.first: FirstToken | None = None
        self.prompt_ids: list[int] = []
        self._prefill_done_s = 0.0
        self._decode_completion_tokens: int | None = None
        self._decoded_tokens = 0

    # ---- phase 1: prefill ----------------------------------------------------------------------

    async def prefill(self) -> FirstToken:
        """Route, prefill on the client's endpoint, learn the prompt ids; returns the first token."""
        req = self.req
        cost = RequestCost(req.prompt_tokens_estimate, req.output_tokens_estimate)
        if req.max_tokens == 1:  # nothing to decode: no decoder, no KV transfer
            prefiller, answer = await self._post_prefill(self._pick_prefiller(exclude=()), req.endpoint.value,
                                                         prefill_body(req, None), cost.prompt_tokens)
        else:
            self._lease_decoder(cost, exclude=())
            prefiller, answer = await self._send_prefill(self._pick_prefiller(exclude=()), req.endpoint.value,
                                                         lambda kv: prefill_body(req, kv), cost.prompt_tokens)
        first = first_token(req, answer)
        self.prompt_ids = first.prompt_ids or list(req.prompt_ids or ()) or await self._tokenize(prefiller)
        if self._decoder is not None:
            self._decoder.resize_commit(chunks_needed(len(self.prompt_ids), self._decoder.instance.chunk_tokens))
        self.first = first
        self._prefill_done_s = self._o.clock()
        ttft_s = self._prefill_done_s - self._received_s
        self._o.metrics.observe_ttft(req.endpoint.value, ttft_s)
        return first

    @property
    def decoder_regenerates_first(self) -> bool:
        """The first token's text is held back (an incomplete UTF-8 character, or a skipped special token).

        A decoder prompted with prompt ids + such a token starts detokenizing mid-character and emits
        the prompt's text with its first output (seen with vLLM 0.32 and a byte-level BPE). So the
        decoder gets the prompt alone and generates the whole output, first token included; the
        prefill still provided the KV. The client has received nothing visible yet.
        """
        return self.needs_decode and not self._first_or_raise().text

    @property
    def needs_decode(self) -> bool:
        """False when the first token already ended the output (max_tokens 1, EOS, a stop string)."""
        more_allowed = self.req.max_tokens is None or self.req.max_tokens > 1
        return more_allowed and self._first_or_raise().finish_reason in (None, "length")

    # ---- phase 2: KV, then decode ----------------------------------------------------------------

    async def decode(self) -> AsyncIterator[Delta]:
        """Wait for the KV (retrying or recomputing per policy), then stream the decoder's output."""
        first = self._first_or_raise()
        await self._settle_kv()
        body = decode_body(self.req, self.prompt_ids, None if self.decoder_regenerates_first else first.token_id)
        o = self._o
        async with contextlib.AsyncExitStack() as stack:
            events = await self._open_decode(stack, body)
            first_event = True
            async for event in events:
                if first_event:
                    first_event = False
                    o.metrics.observe_handover(o.clock() - self._prefill_done_s)
                if isinstance(event.get("usage"), dict):
                    self._decode_completion_tokens = event["usage"].get("completion_tokens")
                delta = decode_delta(event)
                if delta is not None:
                    self._decoded_tokens += len(delta.token_ids)
                    yield delta

    def usage(self) -> dict[str, int]:
        decoded = self._decode_completion_tokens
        from_prefill = 0 if self.decoder_regenerates_first else 1
        from_decoder = decoded if isinstance(decoded, int) else self._decoded_tokens
        return usage(len(self.prompt_ids), from_prefill + from_decoder)

    def close(self) -> None:
        """Abandon a KV handover the decode did not take (cancel it), release the decoder; idempotent,
        never awaits."""
        if self._handover is not None:
            ended = self.first is not None and not self.needs_decode
            self._abandon_kv("no decode needed: the first token ended the output" if ended
                             else "the request ended before its decode (client gone or an error)")
        if self._decoder is not None:
            self._decoder.release()

    # ---- internals -------------------------------------------------------------------------------

    def _first_or_raise(self) -> FirstToken:
        if self.first is None:
            raise RuntimeError("prefill() first")
        return self.first

    def _lease(self) -> Lease:
        if self._decoder is None:
            raise RuntimeError("no decoder leased: prefill() first")
        return self._decoder

    def _lease_decoder(self, cost: RequestCost, exclude: Collection[str]) -> Instance:
        o = self._o
        decoder = o.router.pick_decoder(o.registry.routable(Role.RECEIVER), cost, exclude)
        self._hold_decoder(decoder, cost.decode_tokens, chunks_needed(cost.prompt_tokens, decoder.chunk_tokens))
        return decoder

    def _hold_decoder(self, decoder: Instance, tokens: int, chunks: int) -> None:
        lease = self._o.registry.lease(decoder, tokens, chunks)
        if self._decoder is not None:
            self._decoder.release()
        self._decoder = lease
        self._tried.add(decoder.instance_id)

    def _pick_prefiller(self, exclude: Collection[str]) -> Instance:
        o = self._o
        prefiller = o.router.pick_prefiller(o.registry.routable(Role.SENDER), exclude)
        self._tried.add(prefiller.instance_id)
        return prefiller

    async def _send_prefill(self, prefiller: Instance, path: str, build: Callable[[dict[str, Any]], dict[str, Any]],
                            prompt_tokens: int) -> tuple[Instance, dict[str, Any]]:
        """Register a fresh waiter for a fresh req_id, THEN send the prefill."""
        decoder = self._lease().instance
        self._abandon_kv("superseded by a new prefill")
        req_id = uuid.uuid4().hex
        handover = self._handover = _Handover(self._o.waiters.register(req_id, decoder.tp_size), decoder)
        body = build(kv_transfer_params(req_id, decoder))
        logger.debug("prefill %s on %s, KV to %s", req_id, prefiller.http_url, decoder.instance_id)
        try:
            return await self._post_prefill(prefiller, path, body, prompt_tokens)
        except UpstreamConnectError:
            handover.prefill_sent = False
            raise

    async def _post_prefill(self, prefiller: Instance, path: str, body: dict[str, Any],
                            prompt_tokens: int) -> tuple[Instance, dict[str, Any]]:
        """POST the prefill; on a failed connection, to the next routable prefiller. Returns who answered."""
        o = self._o
        failed: set[str] = set()
        while True:
            try:
                with o.registry.lease(prefiller, prompt_tokens):
                    answer = await o.upstream.post_json(prefiller.http_url, path, body,
                                                        timeout_s=o.settings.prefill_timeout_s, headers=self._headers)
            except UpstreamConnectError as exc:
                failed.add(prefiller.instance_id)
                self._connect_failed(prefiller, exc)
                prefiller = self._next_prefiller(failed, exc)
                continue
            o.registry.note_connected(prefiller)
            return prefiller, answer

    def _next_prefiller(self, failed: Collection[str], exc: UpstreamConnectError) -> Instance:
        """Another routable prefiller (untried ones first); re-raises ``exc`` when there is none."""
        o = self._o
        others = [p for p in o.registry.routable(Role.SENDER) if p.instance_id not in failed]
        if not others:
            raise exc
        prefiller = o.router.pick_prefiller(others, exclude=self._tried)
        self._tried.add(prefiller.instance_id)
        o.metrics.failovers.labels("prefill").inc()
        logger.info("request %s: prefilling on %s instead", self.response_id, prefiller.instance_id)
        return prefiller

    async def _open_decode(self, stack: contextlib.AsyncExitStack, body: dict[str, Any]
                           ) -> AsyncIterator[dict[str, Any]]:
        """Open the decode stream; on a failed connection, on the next routable decoder (it recomputes)."""
        o = self._o
        failed: set[str] = set()
        while True:
            decoder = self._lease().instance
            try:
                events = await stack.enter_async_context(o.upstream.stream_events(
                    decoder.http_url, Endpoint.COMPLETIONS.value, body,
                    idle_timeout_s=o.settings.decode_idle_timeout_s, headers=self._headers))
            except UpstreamConnectError as exc:
                failed.add(decoder.instance_id)
                self._connect_failed(decoder, exc)
                self._abandon_kv(f"decoder {decoder.instance_id} unreachable: the request decodes elsewhere")
                self._next_decoder(failed, exc)
                continue
            o.registry.note_connected(decoder)
            if self._handover is not None:  # the decode reached the decoder holding the KV: it takes it
                self._handover.waiter.drop()
                self._handover = None
            return events

    def _next_decoder(self, failed: Collection[str], exc: UpstreamConnectError) -> None:
        """Lease another routable decoder to recompute on; re-raises ``exc`` when there is none."""
        o = self._o
        others = [d for d in o.registry.routable(Role.RECEIVER) if d.instance_id not in failed]
        if not others:
            raise exc
        cost = RequestCost(len(self.prompt_ids), self.req.output_tokens_estimate)
        decoder = o.router.pick_decoder(others, cost, exclude=self._tried, needs_kv=False)
        self._hold_decoder(decoder, cost.decode_tokens, chunks=0)
        o.metrics.failovers.labels("decode").inc()
        logger.info("request %s: decoding on %s instead (it recomputes the prompt)", self.response_id,
                    decoder.instance_id)

    def _connect_failed(self, inst: Instance, exc: UpstreamConnectError) -> None:
        logger.info("request %s: cannot connect to %s %s: %s", self.response_id, inst.role_name, inst.instance_id,
                    exc)
        self._o.metrics.connect_failures.labels(inst.role.value).inc()
        self._o.registry.note_connect_failure(inst)

    def _abandon_kv(self, reason: str) -> None:
        """The decode will not take this handover's KV: stop waiting, and tell its decoder to free it."""
        handover, self._handover = self._handover, None
        if handover is None:
            return
        handover.waiter.drop()
        if handover.prefill_sent:
            self._o.canceller.cancel(handover.decoder, handover.req_id, reason)

    async def _tokenize(self, prefiller: Instance) -> list[int]:
        answer = await self._o.upstream.post_json(prefiller.http_url, "/tokenize", tokenize_body(self.req),
                                                  timeout_s=self._o.settings.prefill_timeout_s, headers=self._headers)
        tokens = answer.get("tokens")
        if not isinstance(tokens, list) or not tokens:
            raise UpstreamMalformed(f"{prefiller.http_url}/tokenize answered without tokens")
        return tokens

    async def _settle_kv(self) -> None:
        outcome = await self._wait_kv()
        if outcome.status is KvStatus.READY:
            return
        policy = self._o.settings.on_kv_failure
        if policy is KvFailurePolicy.RECOMPUTE:
            self._give_up_kv(outcome, "the decoder recomputes")
            return
        if policy is KvFailurePolicy.FAIL:
            self._give_up_kv(outcome, "answering an error (--on-kv-failure=fail)")
            status = 504 if outcome.status is KvStatus.TIMEOUT else 502
            raise KvNotReady(f"KV for the request did not reach the decoder: {outcome.reason} "
                             "(--on-kv-failure=fail)", status_code=status)
        self._give_up_kv(outcome, "retrying the prefill once")
        try:
            await self._retry_prefill()
        except ProxyError as exc:
            logger.warning("request %s: the retry prefill failed (%s); the decoder recomputes", self.response_id, exc)
            self._abandon_kv(f"the retry prefill failed: {exc}")
            return
        outcome = await self._wait_kv()
        if outcome.status is not KvStatus.READY:
            self._give_up_kv(outcome, "the decoder recomputes")

    async def _wait_kv(self) -> KvOutcome:
        if self._handover is None:
            raise RuntimeError("no KV handover: prefill() first")
        outcome = await self._handover.waiter.wait(self._o.settings.kv_timeout_s)
        self._lease().settle()
        m = self._o.metrics
        m.kv_outcomes.labels(outcome.status.value).inc()
        m.observe_kv_wait(outcome.wait_s)
        if outcome.status is KvStatus.READY:
            m.kv_bytes.inc(outcome.nbytes)
        return outcome

    async def _retry_prefill(self) -> None:
        cost = RequestCost(len(self.prompt_ids), self.req.output_tokens_estimate)
        exclude = set(self._tried)
        self._lease_decoder(cost, exclude)
        prefiller = self._pick_prefiller(exclude)
        await self._send_prefill(prefiller, Endpoint.COMPLETIONS.value,
                                 lambda kv: retry_prefill_body(self.req, self.prompt_ids, kv), cost.prompt_tokens)

    def _give_up_kv(self, outcome: KvOutcome, action: str) -> None:
        handover = self._handover
        logger.warning("request %s: KV %s (req_id %s, decoder %s): %s; %s", self.response_id, outcome.status.value,
                       handover.req_id if handover else "?", handover.decoder.instance_id if handover else "?",
                       outcome.reason, action)
        self._abandon_kv(f"KV {outcome.status.value}: {outcome.reason}")
