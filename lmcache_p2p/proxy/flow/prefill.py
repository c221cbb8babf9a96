"""One request's prefill attempts: disaggregated (admission for decoder credit, then a compatible
prefiller, KV to the leased decoder), alone (max_tokens 1: no decoder), or colocated (one instance
serves the whole request; its prompt ids learned here), and the retry prefill a KV failure asks for.

A refused connection goes to another instance of that role; a prefill whose connection broke after
it was sent is retried once elsewhere (the client has received nothing yet), then fails. It owns
these attempts. It must not choose instances itself (``flow/placement.py``), wait for the KV
(``flow/handover.py``) or shape the client's output (``flow/output.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

from lmcache_p2p.config import Role
from lmcache_p2p.proxy.router.admission import Admission, Outcome
from lmcache_p2p.proxy.errors import ProxyError, UpstreamConnectError, UpstreamMalformed, UpstreamUnreachable
from lmcache_p2p.proxy.flow.backends import backend_of
from lmcache_p2p.proxy.flow.context import RequestContext, Services, nothing_routable
from lmcache_p2p.proxy.flow.handover import KvHandover
from lmcache_p2p.proxy.observe.metrics import RequestReuse
from lmcache_p2p.proxy.flow.placement import Placement
from lmcache_p2p.proxy.router.registry import Instance, Lease
from lmcache_p2p.proxy.http.responses import FirstToken, first_token
from lmcache_p2p.proxy.router.routing import ColocatedReason, RequestCost, chunks_needed
from lmcache_p2p.proxy.http.shaping import (
    Endpoint,
    ids_prefill_body,
    prefill_body,
    reads_output_tokens,
    retry_prefill_body,
    tokenize_body,
    truncate_prompt,
)
from lmcache_p2p.proxy.upstream import with_request_id

logger = logging.getLogger(__name__)

_RETRIES_AFTER_BROKEN_PREFILL = 1  # a prefill whose connection broke after it was sent is retried once
_ADMISSION_REASONS = {
    Outcome.TIMEOUT: ColocatedReason.ADMISSION_TIMEOUT,
    Outcome.QUEUE_FULL: ColocatedReason.ADMISSION_QUEUE_FULL,
}


class _PrefillBroken(Exception):
    """A prefill's connection broke after it was sent (the prefiller died): retry it elsewhere."""

    def __init__(self, prefiller: Instance, cause: UpstreamUnreachable) -> None:
        super().__init__(str(cause))
        self.prefiller = prefiller
        self.cause = cause


class PrefillAttempts:
    def __init__(self, services: Services, ctx: RequestContext, placement: Placement, handover: KvHandover) -> None:
        self._s = services
        self._ctx = ctx
        self._placement = placement
        self._handover = handover

    async def run(self, cost: RequestCost) -> FirstToken:
        """The first token (colocated: an empty one; the serving instance generates the whole output)."""
        if self._ctx.req.max_tokens == 1:  # nothing to decode: no decoder, no KV transfer
            if self._ctx.instance_renders:  # its parsers answer it: on one instance's chat endpoint, whole
                return await self._colocate(cost, ColocatedReason.ONE_TOKEN_RENDERED)
            return await self._alone(cost)
        return await self._routed(cost)

    async def retry(self, avoid: Collection[str] = ()) -> None:
        """The KV failed: prefill once more (token ids), on another pair when there is one. ``avoid``: decoders
        known down or unreachable, never used; the retry then goes to the prefiller that holds the prompt (its
        prefix cache) when it can, so that its KV is sent again rather than computed again."""
        ctx = self._ctx
        cost = RequestCost(len(ctx.prompt_ids), ctx.req.output_tokens_estimate)
        decoder = self._placement.lease_decoder(cost, avoid)
        prefiller = self._placement.prefiller_again(decoder) if avoid else None
        prefiller = prefiller or self._placement.pick_prefiller(decoder, exclude=self._placement.tried)
        try:
            await self._send(prefiller, Endpoint.COMPLETIONS.value,
                             lambda kv: retry_prefill_body(ctx.req, ctx.prompt_ids, kv), cost.prompt_tokens)
        except _PrefillBroken as broke:
            raise broke.cause from None

    async def continuation(self, output_ids: list[int]) -> None:
        """A broken decode continues on the leased decoder after ``output_ids``: prefill prompt + those on a
        compatible prefiller, whose KV that decoder takes (``KvBackend.continues_with_kv``). When none
        answers, the decoder computes it itself."""
        ctx = self._ctx
        prompt = [*ctx.prompt_ids, *output_ids]
        try:
            prefiller = self._placement.pick_prefiller(self._placement.lease().instance)
            logger.info("request %s: prefilling prompt + %d output token(s) on %s for the next decoder to pull",
                        ctx.response_id, len(output_ids), prefiller.instance_id)
            await self._send(prefiller, Endpoint.COMPLETIONS.value,
                             lambda kv: retry_prefill_body(ctx.req, prompt, kv), len(prompt), len(output_ids))
        except (ProxyError, _PrefillBroken) as exc:
            logger.warning("request %s: the prefill of its continuation failed (%s); the decoder computes it",
                           ctx.response_id, exc)
            self._handover.abandon(f"the continuation's prefill failed: {exc}")

    async def _alone(self, cost: RequestCost) -> FirstToken:
        """max_tokens 1: the prefill's answer is the whole output and no KV goes anywhere. A prefiller
        answers it, else a decoder; a refused connection goes to the next instance, a broken one is
        retried once."""
        req = self._ctx.req
        body = prefill_body(req, None)
        failed: set[str] = set()
        broken = 0
        last: UpstreamUnreachable | None = None
        while True:
            inst = self._placement.pick_any(cost, failed)
            if inst is None:
                raise last or nothing_routable()
            if last is not None:
                self._s.metrics.failovers.labels("prefill").inc()
            try:
                answer = await self._post(inst, req.endpoint.value, body, cost.prompt_tokens)
                break
            except UpstreamUnreachable as exc:
                failed.add(inst.instance_id)
                broken += not isinstance(exc, UpstreamConnectError)
                if broken > _RETRIES_AFTER_BROKEN_PREFILL:
                    raise
                last = exc
        if inst.role is Role.RECEIVER:
            self._placement.note_colocated(inst, ColocatedReason.NO_PREFILLER)
        first = first_token(req, answer)
        self._ctx.prompt_ids = first.prompt_ids or list(req.prompt_ids or ()) or await self._tokenize(inst)
        return first

    async def _routed(self, cost: RequestCost) -> FirstToken:
        """Disaggregated when a compatible pair has room (after waiting for it), else colocated."""
        ctx = self._ctx
        _, reason = self._placement.pairable()
        if reason is None and reads_output_tokens(ctx.req):
            reason = ColocatedReason.OUTPUT_AWARE_SAMPLING
        if reason is not None:
            return await self._colocate(cost, reason)
        admission = await self._s.admission.admit(lambda: self._placement.grant_decoder(cost))
        self._count_admission(admission)
        if admission.granted is None:
            reason = (admission.refusal.reason if admission.refusal is not None
                      else _ADMISSION_REASONS[admission.outcome])
            logger.info("request %s: no decoder buffer credit for ~%d prompt tokens (%s after %.2f s): %s",
                        ctx.response_id, cost.prompt_tokens, admission.outcome.value, admission.wait_s,
                        admission.message)
            return await self._colocate(cost, reason)
        self._placement.take(admission.granted)
        return await self._disaggregated(cost)

    async def _disaggregated(self, cost: RequestCost) -> FirstToken:
        """Prefill on a prefiller compatible with the leased decoder, KV to that decoder."""
        req = self._ctx.req
        decoder = self._placement.lease().instance
        if not self._placement.compatible_prefillers(decoder):  # gone while the request waited for admission
            return await self._colocate_on(decoder, cost, ColocatedReason.NO_PREFILLER)
        prefiller = self._placement.pick_prefiller(decoder)
        path, build = await self._prefill_request(prefiller)
        broken = 0
        while True:
            try:
                prefiller, answer = await self._send(prefiller, path, build, cost.prompt_tokens)
                break
            except UpstreamConnectError as exc:  # every compatible prefiller refused: nothing was sent
                logger.warning("request %s: no prefiller reachable (%s); decoder %s computes the prompt",
                               self._ctx.response_id, exc, decoder.instance_id)
                return await self._colocate_on(decoder, cost, ColocatedReason.NO_PREFILLER)
            except _PrefillBroken as broke:  # sent, then the connection broke: nothing reached the client
                broken += 1
                retry_on = self._after_broken(broke, broken, decoder)
                if retry_on is None:
                    return await self._colocate_on(decoder, cost, ColocatedReason.PREFILL_FAILED)
                self._placement.hold(decoder, cost.decode_tokens, self._placement.lease().chunks)  # credit, new KV
                prefiller = retry_on
        first = first_token(req, answer)
        prefiller.makes_text |= bool(first.text)
        self._ctx.first_text_final = prefiller.makes_text
        sent_ids = req.prompt_ids if req.prompt_ids is not None else req.tokenized_ids  # not asked back (prefill_body)
        self._ctx.prompt_ids = first.prompt_ids or list(sent_ids or ()) or await self._tokenize(prefiller)
        self._placement.lease().resize_commit(chunks_needed(len(self._ctx.prompt_ids), decoder.chunk_tokens))
        self._note_prefill(prefiller, decoder, answer)
        return first

    async def _prefill_request(self, prefiller: Instance) -> tuple[str, Callable[[dict[str, Any]], dict[str, Any]]]:
        """The prefill's path and body: the client's request on its endpoint, or, where the pair's backend
        asks for it (``KvBackend.prefills_ids``), a /v1/completions of the prompt's ids as ``prefiller``'s
        /tokenize renders them (any prefiller of the pair's backend serves that, should it be retried)."""
        req = self._ctx.req
        # a chat decoded on the decoder's chat endpoint pairs with a chat prefill (vLLM names both chatcmpl-)
        if self._ctx.instance_renders or not backend_of(prefiller).prefills_ids(req, prefiller):
            return req.endpoint.value, lambda kv: prefill_body(req, kv)
        try:
            ids = await self._tokenize(prefiller)
        except UpstreamUnreachable:  # a connection failure is the prefill's to handle, where it is sent
            return req.endpoint.value, lambda kv: prefill_body(req, kv)
        return Endpoint.COMPLETIONS.value, lambda kv: ids_prefill_body(req, ids, kv)

    def _after_broken(self, broke: _PrefillBroken, broken: int, decoder: Instance) -> Instance | None:
        """Where a broken prefill is retried (None: the decoder computes the prompt); raises after the last."""
        self._handover.abandon(f"the prefill on {broke.prefiller.instance_id} broke: {broke.cause}")
        if broken > _RETRIES_AFTER_BROKEN_PREFILL:
            raise broke.cause from None
        retry_on = self._placement.untried_prefiller(decoder)
        rid, on = self._ctx.response_id, broke.prefiller.instance_id
        if retry_on is None:
            logger.warning("request %s: the prefill on %s broke before its first token (%s); decoder %s computes the "
                           "prompt", rid, on, broke.cause, decoder.instance_id)
            return None
        logger.warning("request %s: the prefill on %s broke before its first token (%s); retrying on %s", rid, on,
                       broke.cause, retry_on.instance_id)
        self._s.metrics.failovers.labels("prefill").inc()
        return retry_on

    async def _colocate(self, cost: RequestCost, reason: ColocatedReason) -> FirstToken:
        """One instance serves the whole request: a prefiller when decoders are missing or incompatible,
        else a decoder (it computes the prompt); the other role when the preferred one has none."""
        failed: set[str] = set()
        on_prefiller = reason in (ColocatedReason.NO_DECODER, ColocatedReason.NO_COMPATIBLE_DECODER)
        roles = (Role.SENDER, Role.RECEIVER) if on_prefiller else (Role.RECEIVER, Role.SENDER)
        while True:
            inst = self._placement.pick_any(cost, failed, roles)
            if inst is None:
                raise nothing_routable()
            try:
                return await self._colocate_on(inst, cost, reason)
            except UpstreamUnreachable as exc:  # /tokenize failed: that instance is gone
                self._placement.connect_failed(inst, exc)
                failed.add(inst.instance_id)

    async def _colocate_on(self, inst: Instance, cost: RequestCost, reason: ColocatedReason) -> FirstToken:
        """Lease ``inst`` for the whole request and learn the prompt ids; the output comes in the decode."""
        ctx = self._ctx
        self._handover.abandon(f"the request is served colocated instead ({reason.value})")
        self._placement.hold(inst, cost.decode_tokens, chunks=0)
        req = ctx.req
        ctx.prompt_ids = list(req.prompt_ids) if req.prompt_ids is not None else await self._tokenize(inst)
        ctx.colocated = reason
        self._placement.note_colocated(inst, reason)
        ctx.reuse = RequestReuse(ctx.response_id, len(ctx.prompt_ids), decoder=inst.instance_id, kv_bytes=0)
        return FirstToken(token_id=-1, text="", finish_reason=None, stop_reason=None, logprobs=None,
                          prompt_ids=ctx.prompt_ids, model=str(req.body.get("model") or ""), created=int(time.time()))

    async def _send(self, prefiller: Instance, path: str, build: Callable[[dict[str, Any]], dict[str, Any]],
                    prompt_tokens: int, output_tokens: int = 0) -> tuple[Instance, dict[str, Any]]:
        """Begin a fresh KV attempt (for ours: a waiter for a fresh req_id), THEN send the prefill."""
        decoder = self._placement.lease().instance
        body = build(self._handover.begin(output_tokens))
        headers = with_request_id(self._ctx.headers, self._handover.request_id)
        logger.debug("prefill %s on %s, KV to %s", self._ctx.timeline.req_id, prefiller.http_url, decoder.instance_id)
        try:
            answered = await self._post_prefill(prefiller, path, body, prompt_tokens, decoder, headers)
        except UpstreamConnectError:
            self._handover.not_sent()
            raise
        self._placement.prefilled_on = answered[0]
        backend_of(answered[0]).learn(answered[0], answered[1])
        decode_path = Endpoint.CHAT.value if self._ctx.instance_renders else Endpoint.COMPLETIONS.value
        self._handover.answered(answered[1], path, decode_path)
        return answered

    async def _post_prefill(self, prefiller: Instance, path: str, body: dict[str, Any], prompt_tokens: int,
                            decoder: Instance, headers: Mapping[str, str]) -> tuple[Instance, dict[str, Any]]:
        """POST the prefill; on a refused connection, to the next compatible prefiller. Returns who
        answered; raises _PrefillBroken when a connection broke after the prefill was sent."""
        failed: set[str] = set()
        while True:
            try:
                return prefiller, await self._post(prefiller, path, body, prompt_tokens, headers)
            except UpstreamConnectError as exc:
                failed.add(prefiller.instance_id)
                prefiller = self._placement.next_prefiller(failed, exc, decoder)
            except UpstreamUnreachable as exc:
                raise _PrefillBroken(prefiller, exc) from exc

    async def _post(self, inst: Instance, path: str, body: dict[str, Any], prompt_tokens: int,
                    headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        """One POST to ``inst`` under a lease of its load; failed connections are counted against it.
        ``headers``: the request's (the client's own by default)."""
        s, timeline = self._s, self._ctx.timeline
        timeline.prefill_sent_s = s.clock()
        try:
            with s.registry.lease(inst, prompt_tokens):
                answer = await s.upstream.post_json(inst.http_url, path, body, timeout_s=s.settings.prefill_timeout_s,
                                                    headers=self._ctx.headers if headers is None else headers)
        except UpstreamUnreachable as exc:
            self._placement.connect_failed(inst, exc)
            raise
        timeline.prefill_answered_s = s.clock()
        s.registry.note_connected(inst)
        return answer

    async def _tokenize(self, inst: Instance) -> list[int]:
        answer = await self._s.upstream.post_json(inst.http_url, "/tokenize", tokenize_body(self._ctx.req),
                                                  timeout_s=self._s.settings.prefill_timeout_s,
                                                  headers=self._ctx.headers)
        tokens = answer.get("tokens")
        if not isinstance(tokens, list) or not tokens:
            raise UpstreamMalformed(f"{inst.http_url}/tokenize answered without tokens")
        return truncate_prompt(self._ctx.req, tokens, self._s.tokenizers.max_model_len)  # /tokenize does not

    def _count_admission(self, admission: Admission[Lease]) -> None:
        m = self._s.metrics
        m.admission.labels(admission.outcome.value).inc()
        if admission.outcome is not Outcome.IMMEDIATE:
            m.admission_wait.observe(admission.wait_s)

    def _note_prefill(self, prefiller: Instance, decoder: Instance, answer: dict[str, Any]) -> None:
        """The prefill answered: both instances now hold the prompt; note what the prefiller reused."""
        ctx, router = self._ctx, self._s.router
        router.remember(prefiller, ctx.prefix)
        router.remember(decoder, ctx.prefix)
        ctx.reuse = RequestReuse(ctx.response_id, len(ctx.prompt_ids), prefiller=prefiller.instance_id,
                                 decoder=decoder.instance_id, cached_tokens=_cached_tokens(answer))


def _cached_tokens(answer: dict[str, Any]) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a vLLM answer (``--enable-prompt-tokens-details``)."""
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and cached >= 0 else None
