"""One request, end to end: pick decoder D and prefiller P, prefill on P (its KV goes to D), wait
until every TP rank of D reports the KV ready, then decode on D.

    flow = orchestrator.open(request)
    try:
        first = await flow.prefill()         # the first token (send it to a streaming client now)
        if flow.needs_decode:
            async for delta in flow.decode():  # waits for KV, retries or recomputes, then streams
                ...                            # (app.py starts it before the first byte is written)
    finally:
        flow.close()                         # never awaits: safe in a cancelled task

The waiter for "KV ready" is registered before the prefill is sent. On a KV failure or timeout
(``--kv-timeout-s``) the policy decides: ``retry`` prefills once more (token ids, another pair
when there is one) and then recomputes, ``recompute`` sends the decode at once (the decoder
recomputes what it lacks), ``fail`` answers 502/504. Nothing waits without a deadline.

Routing (``routing.py`` has the policy): a disaggregated request first waits in the admission
queue (``admission.py``) for buffer credit on a decoder whose KV fingerprint matches a prefiller's,
then prefills on a compatible prefiller. When that is not possible the request is served colocated
(one instance, no KV transfer, ``colocated_total{reason}``): on a prefiller when no decoder is
routable or compatible, on a decoder (it computes the prompt itself) when no prefiller is routable or
reachable, when admission timed out, its queue was full, or the KV is larger than every buffer. A
colocated request gets no first token from a prefill: ``prefill()`` learns the prompt ids (the
client's, else ``/tokenize`` on that instance) and the instance generates the whole output in
``decode()``. The proxy answers 503 only when no instance at all is routable.

A prefill or decode whose connection failed (refused / connect timeout: the instance got nothing)
goes to another routable instance of that role, each tried once; a decode that moves to another
decoder recomputes there. A prefill whose connection broke after it was sent (the prefiller died
with the request in hand: ``UpstreamUnreachable``, not a connect error) is retried once, invisibly (the client has received nothing yet):
its KV on the decoder is cancelled, then it goes to another compatible prefiller, or the decoder
computes the prompt itself (``colocated{reason=prefill_failed}``); a second break fails the request
(a request that kills every engine it reaches must not go round the cluster). Every failed or broken
connection counts towards taking the instance out of rotation (``registry.note_connect_failure``).

The decoder always gets the prompt ids + the first token, so it loads the whole prompt's KV. With
the model's tokenizer (``tokenizer.py``) the proxy makes the client's text from token ids as one
vLLM instance would (``detokenize.py``); without one the text comes from the instances, and a
text prompt whose first token has no text of its own (an incomplete UTF-8 character) falls back
to "the decoder regenerates the first token" (prompt alone; its last chunk is recomputed).

A decode stream that breaks (the decoder died, answered 5xx, or went silent) continues on another
decoder, else on a prefiller serving colocated, prompted with prompt ids + every token the client
already has (remaining ``max_tokens``, same sampling params: with greedy sampling the output
equals one instance's), at most ``--migration-limit`` times per request; nothing is sent twice.

Except under sampling that reads the request's own OUTPUT tokens (vLLM 0.32: presence and frequency
penalties count output tokens only; ``bad_words`` match their prefix against output tokens only): an
instance prompted with tokens already output does not see them as output, so its output differs from
one instance's, even at temperature 0. Such a request is served whole by one instance
(``colocated{reason=output_aware_sampling}``), and a stream of it that breaks after its first output
token ends with an error rather than continue elsewhere (a wrong answer is worse than an error).

A request's KV handover (its ``req_id`` on decoder D) ends in one of two ways: the decode request
reaches D (once D produced its first token the proxy cancels the ``req_id``, so that slots the
engine did not load, e.g. an unused partial last chunk, are freed now rather than at lease
expiry), or the proxy abandons it (KV failed or timed out, the decode moved elsewhere, the first
token ended the output, the client left, an error) and tells every rank of D to free it
(``cancel.py``), unless the prefill never reached a prefiller.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from typing import Any

from lmcache_p2p.config import Role
from lmcache_p2p.proxy.admission import Admission, AdmissionQueue, CannotAdmit, Outcome
from lmcache_p2p.proxy.cancel import KvCanceller
from lmcache_p2p.proxy.detokenize import OutputText, TextParams
from lmcache_p2p.proxy.held_text import HeldText, Replay
from lmcache_p2p.proxy.errors import (
    KvNotReady,
    NoInstanceAvailable,
    ProxyError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamMalformed,
    UpstreamStatus,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from lmcache_p2p.proxy.metrics import ProxyMetrics, RequestReuse
from lmcache_p2p.proxy.prefix import PromptPrefix
from lmcache_p2p.proxy.registry import Instance, Lease, Registry
from lmcache_p2p.proxy.responses import Delta, FirstToken, decode_delta, first_token, usage
from lmcache_p2p.proxy.routing import (
    ColocatedReason,
    RequestCost,
    Router,
    chunks_needed,
    exceeds_every_buffer,
    no_capacity,
)
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
from lmcache_p2p.proxy.timeline import Timeline
from lmcache_p2p.proxy.tokenizer import ProxyTokenizer, TokenizerProvider
from lmcache_p2p.proxy.upstream import Upstream
from lmcache_p2p.proxy.waiters import KvOutcome, KvStatus, KvWaiter, KvWaiters

logger = logging.getLogger(__name__)


_RETRIES_AFTER_BROKEN_PREFILL = 1  # a prefill whose connection broke after it was sent is retried once
_INLINE_TOKENIZE_MAX_TOKENS = 2048  # estimated prompt tokens (--chars-per-token) tokenized on the event loop

_ADMISSION_REASONS = {
    Outcome.TIMEOUT: ColocatedReason.ADMISSION_TIMEOUT,
    Outcome.QUEUE_FULL: ColocatedReason.ADMISSION_QUEUE_FULL,
}


@dataclasses.dataclass(frozen=True)
class FlowSettings:
    kv_timeout_s: float = 10.0
    prefill_timeout_s: float = 120.0
    decode_idle_timeout_s: float = 120.0
    on_kv_failure: KvFailurePolicy = KvFailurePolicy.RETRY
    admission_timeout_s: float = 5.0
    admission_queue_max: int = 1024
    migration_limit: int = 2  # mid-stream moves of one request's decode to another instance
    tokenizer_wait_s: float = 10.0  # longest a request waits for the tokenizer's first load


class Orchestrator:
    def __init__(self, registry: Registry, router: Router, waiters: KvWaiters, upstream: Upstream,
                 canceller: KvCanceller, metrics: ProxyMetrics, settings: FlowSettings,
                 clock: Callable[[], float] = time.perf_counter, tokenizers: TokenizerProvider | None = None) -> None:
        self.registry = registry
        self.router = router
        self.waiters = waiters
        self.upstream = upstream
        self.canceller = canceller
        self.metrics = metrics
        self.settings = settings
        self.clock = clock
        self.admission = AdmissionQueue(settings.admission_timeout_s, settings.admission_queue_max)
        registry.on_credit.append(self.admission.poke)
        metrics.admission_waiting.set_function(lambda: len(self.admission))
        registry.on_forgotten.append(router.forget)  # its caches are gone with it
        registry.on_pending.append(router.forget)  # new, restarted, moved or down: caches may be gone
        router.on_prefix_decision.append(lambda role, d: metrics.reuse.observe_decision(role.value, d.value))
        self.tokenizers = tokenizers or TokenizerProvider.fixed(None)

    def open(self, req: ClientRequest, headers: Mapping[str, str], received_s: float) -> RequestFlow:
        return RequestFlow(self, req, headers, received_s)


@dataclasses.dataclass(eq=False)
class _Handover:
    """One attempt at getting a request's KV onto ``decoder``, under a fresh ``req_id``."""

    waiter: KvWaiter
    decoder: Lease  # the lease whose buffer credit this KV takes
    prefill_sent: bool = True  # False once every prefiller refused the connection: no KV can be on its way

    @property
    def req_id(self) -> str:
        return self.waiter.req_id


@dataclasses.dataclass(frozen=True)
class DecodeTarget:
    """Where a relay worker sends a decode (``/v1/completions`` there) and what it sends."""

    url: str
    body: dict[str, Any]


def _nothing_routable() -> NoInstanceAvailable:
    return NoInstanceAvailable("no prefiller or decoder available: start one (p2p.proxy_url -> this proxy's control "
                               "port) or pass --prefill / --decode URL")


class _PrefillBroken(Exception):
    """A prefill's connection broke after it was sent (the prefiller died): retry it elsewhere."""

    def __init__(self, prefiller: Instance, cause: UpstreamUnreachable) -> None:
        super().__init__(str(cause))
        self.prefiller = prefiller
        self.cause = cause


class RequestFlow:
    def __init__(self, orch: Orchestrator, req: ClientRequest, headers: Mapping[str, str], received_s: float) -> None:
        self._o = orch
        self.req = req
        self.response_id = uuid.uuid4().hex
        self._headers = headers
        self._received_s = received_s
        self._decoder: Lease | None = None  # the instance that decodes (colocated: serves the whole request)
        self._handover: _Handover | None = None
        self.colocated: ColocatedReason | None = None  # set when one instance serves the whole request
        self._tried: set[str] = set()
        self.first: FirstToken | None = None
        self.prompt_ids: list[int] = []
        self._prefill_done_s = 0.0
        self._tokenizer: ProxyTokenizer | None = None
        self._text: OutputText | None = None  # None: the text comes from the instances
        self._output_ids: list[int] = []  # the output's token ids the client has (or will get with ``first``)
        self._held = HeldText(enabled=False)  # the last output as the client got it (set for the decode)
        self._replay = Replay((), "")  # what of the current stream's first output the client already has
        self._finished = False
        self._context_full = False
        self._handover_observed = False
        self._taken: _Handover | None = None  # the handover the running decode took: cancelled after its 1st token
        self._prefix: PromptPrefix | None = None  # the prompt's chunk hashes (--policy prefix)
        self._reuse: RequestReuse | None = None  # what the prefill and the KV handover reused and moved
        self._kv: KvOutcome | None = None
        self._output_remembered = False
        self.timeline = Timeline(received_s)  # recorded at close (metrics.record_timeline)
        self._timeline_recorded = False

    # ---- phase 1: prefill ----------------------------------------------------------------------

    async def prefill(self) -> FirstToken:
        """Route, prefill on the client's endpoint, learn the prompt ids; returns the first token.

        Colocated (``self.colocated``), no prefill runs: the returned first token is empty and the
        serving instance generates the whole output in ``decode()``.
        """
        req = self.req = await self._measure(self.req)
        cost = RequestCost(req.prompt_tokens, req.output_tokens_estimate)
        if req.max_tokens == 1:  # nothing to decode: no decoder, no KV transfer
            first = await self._prefill_alone(cost)
        else:
            first = await self._prefill_routed(cost)
        self.first = self._shape_first(first)
        self._prefill_done_s = self._o.clock()
        if self.colocated is None:
            self._o.metrics.observe_ttft(req.endpoint.value, self._prefill_done_s - self._received_s)
        return self.first

    @property
    def decoder_regenerates_first(self) -> bool:
        """The proxy has no tokenizer, the prompt is text and the first token has no text of its own.

        A decoder prompted with prompt ids + such a token starts detokenizing mid-character and emits
        the prompt's text with its first output (seen with vLLM 0.32 and a byte-level BPE). Without a
        tokenizer the proxy cannot make the text itself, so the decoder gets the prompt alone and
        generates the whole output, first token included (its last chunk is recomputed). Token-id
        prompts (``--skip-tokenizer-init`` instances have no text at all) always get prompt + first.
        """
        if self.colocated is not None:
            return True  # the serving instance generates the whole output
        first = self._first_or_raise()
        return self.needs_decode and self._text is None and self.req.prompt_ids is None and not first.text

    @property
    def needs_decode(self) -> bool:
        """False when the first token already ended the output (max_tokens 1, EOS, a stop string, or the
        prompt + first token fill the context: ``max_model_len`` from the instances' /v1/models)."""
        if self.colocated is not None:
            return True  # the serving instance generates the whole output
        return self._needs_decode_after(self._first_or_raise())

    # ---- phase 2: KV, then decode ----------------------------------------------------------------

    async def decode(self) -> AsyncIterator[Delta]:
        """Wait for the KV (retrying or recomputing per policy), then stream the output after the first
        token; a stream that breaks continues elsewhere (``--migration-limit``)."""
        await self._settle_kv()
        self._held = HeldText.for_request(self.req, proxy_text=self._text is not None)
        if self.decoder_regenerates_first:
            self._output_ids = []
        elif self.first is not None:
            self._held.observe(Delta(self.first.text, list(self._output_ids), None, None, None))
        failed: set[str] = set()
        migrations = 0
        while True:
            try:
                async for delta in self._decode_stream():
                    yield delta
                self._remember_output()  # before the client's [DONE]: its next turn may follow at once
                return
            except UpstreamError as exc:
                if context_full(exc):
                    logger.info("request %s: the context is full after %d output token(s): the output ends there",
                                self.response_id, len(self._output_ids))
                    yield self._end_of_context()
                    return
                decoder = self._lease().instance
                if (not migratable(exc) or self._finished or migrations >= self._o.settings.migration_limit
                        or not self._may_continue_elsewhere()):
                    raise
                migrations += 1
                failed.add(decoder.instance_id)
                self._migrate(decoder, failed, exc)
                self._replay = self._held.replay()

    def usage(self) -> dict[str, int]:
        return usage(len(self.prompt_ids), len(self._output_ids) or 1)

    def close(self) -> None:
        """Abandon a KV handover the decode did not take (cancel it), release the decoder; idempotent,
        never awaits."""
        if self._handover is not None:
            ended = self.first is not None and not self.needs_decode
            self._abandon_kv("no decode needed: the first token ended the output" if ended
                             else "the request ended before its decode (client gone or an error)")
        self._free_taken_kv()
        self._remember_output()
        self._observe_reuse()
        if self._decoder is not None:
            self._decoder.release()
        self._record_timeline()

    def first_byte_written(self) -> None:
        """The first token's bytes reached a streaming client (its transport took them)."""
        if self.timeline.first_byte_s is None:
            self.timeline.first_byte_s = self._o.clock()

    # ---- the decode run by a relay worker (--workers N, see workers.py) ------------------------------
    #
    # The worker streams the decode and makes the client's text; these steps keep the rest here:
    # the KV wait, which decoder, the KV handover's end, load accounting and migration.

    @property
    def proxy_text(self) -> bool:
        """The proxy makes the client's text (it has the tokenizer) rather than the instances."""
        return self._text is not None

    @property
    def tokenizer_source(self) -> str | None:
        return self._tokenizer.source if self._tokenizer is not None else None

    async def plan_decode(self) -> DecodeTarget:
        """Wait for the KV (retrying or recomputing per policy), then where the first decode goes."""
        await self._settle_kv()
        if self.decoder_regenerates_first:
            self._output_ids = []
        return self._target()

    def decode_unreachable(self, failed: set[str], exc: UpstreamConnectError) -> DecodeTarget | None:
        """The target refused the connection (nothing was sent): another decoder recomputes; None when none."""
        decoder = self._lease().instance
        failed.add(decoder.instance_id)
        self._connect_failed(decoder, exc)
        self._free_taken_kv()
        try:
            self._next_decoder(failed, exc)
        except UpstreamConnectError:
            return None
        return self._target()

    def decode_started(self, decode_sent_s: float | None = None, first_decoded_s: float | None = None) -> None:
        """The target sent its first output: it has loaded the request's KV. The worker's stamps (same
        machine, same monotonic clock) of its decode request and that first output, when it sent them."""
        if self._handover_observed:
            return
        self._handover_observed = True
        if decode_sent_s is not None:
            self.timeline.decode_sent_s = decode_sent_s  # the worker sent it (this one planned it earlier)
        self._o.registry.note_connected(self._lease().instance)
        self._on_first_output(first_decoded_s)
        self._free_taken_kv()

    def decode_broken(self, output_ids: list[int], finished: bool, failed: set[str], migrations: int,
                      exc: UpstreamError) -> DecodeTarget | None:
        """The stream broke after ``output_ids``: where it continues; None when it may not (the limit)."""
        self._output_ids = list(output_ids)
        self._finished = finished
        if finished or migrations >= self._o.settings.migration_limit or not self._may_continue_elsewhere():
            return None
        decoder = self._lease().instance
        failed.add(decoder.instance_id)
        try:
            self._migrate(decoder, failed, exc)
        except UpstreamError:
            return None
        return self._target()

    def decode_ended(self, output_ids: list[int]) -> None:
        """The output is complete (before the client's [DONE]: its next turn may follow at once)."""
        self._output_ids = list(output_ids)
        self._remember_output()

    def _target(self) -> DecodeTarget:
        """The current decoder and the decode request that continues after ``self._output_ids``. The
        decoder holding the KV takes the handover now (as a decode stream that connected does)."""
        body = decode_body(self.req, self.prompt_ids, self._output_ids, proxy_text=self._text is not None)
        if self.timeline.decode_sent_s is None:
            self.timeline.decode_sent_s = self._o.clock()
        if self._handover is not None:
            self._handover.waiter.drop()
            self._taken, self._handover = self._handover, None
        return DecodeTarget(self._lease().instance.http_url, body)

    # ---- internals -------------------------------------------------------------------------------

    def _record_timeline(self) -> None:
        """Once, for a request that prefilled on a prefiller (a colocated one has no phases to show)."""
        if self._timeline_recorded or self.colocated is not None or self.timeline.prefill_sent_s is None:
            return
        self._timeline_recorded = True
        self._o.metrics.record_timeline(self.timeline)

    def _first_or_raise(self) -> FirstToken:
        if self.first is None:
            raise RuntimeError("prefill() first")
        return self.first

    def _lease(self) -> Lease:
        if self._decoder is None:
            raise RuntimeError("no decoder leased: prefill() first")
        return self._decoder

    # ---- routing and prefill (see the module doc) --------------------------------------------------

    async def _prefill_alone(self, cost: RequestCost) -> FirstToken:
        """max_tokens 1: the prefill's answer is the whole output and no KV goes anywhere. A prefiller
        answers it, else a decoder; a refused connection goes to the next instance, a broken one is
        retried once."""
        req = self.req
        body = prefill_body(req, None)
        failed: set[str] = set()
        broken = 0
        last: UpstreamUnreachable | None = None
        while True:
            inst = self._pick_any(cost, failed)
            if inst is None:
                raise last or _nothing_routable()
            if last is not None:
                self._o.metrics.failovers.labels("prefill").inc()
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
            self._note_colocated(inst, ColocatedReason.NO_PREFILLER)
        first = first_token(req, answer)
        self.prompt_ids = first.prompt_ids or list(req.prompt_ids or ()) or await self._tokenize(inst)
        return first

    async def _prefill_routed(self, cost: RequestCost) -> FirstToken:
        """Disaggregated when a compatible pair has room (after waiting for it), else colocated."""
        o = self._o
        _, reason = self._pairable()
        if reason is None and reads_output_tokens(self.req):
            reason = ColocatedReason.OUTPUT_AWARE_SAMPLING
        if reason is not None:
            return await self._colocate(cost, reason)
        admission = await o.admission.admit(lambda: self._grant_decoder(cost))
        self._count_admission(admission)
        if admission.granted is None:
            reason = (admission.refusal.reason if admission.refusal is not None
                      else _ADMISSION_REASONS[admission.outcome])
            logger.info("request %s: no decoder buffer credit for ~%d prompt tokens (%s after %.2f s): %s",
                        self.response_id, cost.prompt_tokens, admission.outcome.value, admission.wait_s,
                        admission.message)
            return await self._colocate(cost, reason)
        self._take_lease(admission.granted)
        return await self._prefill_disaggregated(cost)

    async def _prefill_disaggregated(self, cost: RequestCost) -> FirstToken:
        """Prefill on a prefiller compatible with the leased decoder, KV to that decoder."""
        req = self.req
        decoder = self._lease().instance
        if not self._compatible_prefillers(decoder):  # gone while the request waited for admission
            return await self._colocate_on(decoder, cost, ColocatedReason.NO_PREFILLER)
        prefiller = self._pick_prefiller(exclude=(), decoder=decoder)
        broken = 0
        while True:
            try:
                prefiller, answer = await self._send_prefill(prefiller, req.endpoint.value,
                                                             lambda kv: prefill_body(req, kv), cost.prompt_tokens)
                break
            except UpstreamConnectError as exc:  # every compatible prefiller refused: nothing was sent
                logger.warning("request %s: no prefiller reachable (%s); decoder %s computes the prompt",
                               self.response_id, exc, decoder.instance_id)
                return await self._colocate_on(decoder, cost, ColocatedReason.NO_PREFILLER)
            except _PrefillBroken as broke:  # sent, then the connection broke: nothing reached the client
                broken += 1
                self._abandon_kv(f"the prefill on {broke.prefiller.instance_id} broke: {broke.cause}")
                if broken > _RETRIES_AFTER_BROKEN_PREFILL:
                    raise broke.cause from None
                retry_on = self._untried_prefiller(decoder)
                if retry_on is None:
                    logger.warning("request %s: the prefill on %s broke before its first token (%s); decoder %s "
                                   "computes the prompt", self.response_id, broke.prefiller.instance_id, broke.cause,
                                   decoder.instance_id)
                    return await self._colocate_on(decoder, cost, ColocatedReason.PREFILL_FAILED)
                logger.warning("request %s: the prefill on %s broke before its first token (%s); retrying on %s",
                               self.response_id, broke.prefiller.instance_id, broke.cause, retry_on.instance_id)
                self._o.metrics.failovers.labels("prefill").inc()
                self._hold_decoder(decoder, cost.decode_tokens, self._lease().chunks)  # credit for the new KV
                prefiller = retry_on
        first = first_token(req, answer)
        self.prompt_ids = first.prompt_ids or list(req.prompt_ids or ()) or await self._tokenize(prefiller)
        self._lease().resize_commit(chunks_needed(len(self.prompt_ids), decoder.chunk_tokens))
        self._note_prefill(prefiller, decoder, answer)
        return first

    def _pairable(self) -> tuple[list[Instance], ColocatedReason | None]:
        """Routable decoders whose KV fingerprint matches a routable prefiller's; else why none."""
        o = self._o
        prefillers, decoders = o.registry.routable(Role.SENDER), o.registry.routable(Role.RECEIVER)
        if not decoders:
            return [], ColocatedReason.NO_DECODER
        if not prefillers:
            return [], ColocatedReason.NO_PREFILLER
        pairable = [d for d in decoders if any([o.registry.compatible(p, d) for p in prefillers])]  # logs every pair
        return pairable, None if pairable else ColocatedReason.NO_COMPATIBLE_DECODER

    def _grant_decoder(self, cost: RequestCost) -> Lease | None:
        """Admission's grant: a lease with credit for the KV on a pairable decoder, None while none has
        room; raises CannotAdmit when none ever will. Never awaits."""
        o = self._o
        decoders, reason = self._pairable()
        if reason is not None:
            raise CannotAdmit(reason, f"no decoder to pair with a prefiller any more ({reason.value})")
        decoder = o.router.decoder_with_room(decoders, cost, prefix=self._prefix)
        if decoder is not None:
            chunks = chunks_needed(cost.prompt_tokens, decoder.chunk_tokens)
            return o.registry.lease(decoder, cost.decode_tokens, chunks)
        if exceeds_every_buffer(decoders, cost.prompt_tokens):
            raise CannotAdmit(ColocatedReason.TOO_LARGE, str(no_capacity(decoders, cost.prompt_tokens)))
        return None

    async def _colocate(self, cost: RequestCost, reason: ColocatedReason) -> FirstToken:
        """One instance serves the whole request: a prefiller when decoders are missing or incompatible,
        else a decoder (it computes the prompt); the other role when the preferred one has none."""
        failed: set[str] = set()
        on_prefiller = reason in (ColocatedReason.NO_DECODER, ColocatedReason.NO_COMPATIBLE_DECODER)
        roles = (Role.SENDER, Role.RECEIVER) if on_prefiller else (Role.RECEIVER, Role.SENDER)
        while True:
            inst = self._pick_any(cost, failed, roles)
            if inst is None:
                raise _nothing_routable()
            try:
                return await self._colocate_on(inst, cost, reason)
            except UpstreamUnreachable as exc:  # /tokenize failed: that instance is gone
                self._connect_failed(inst, exc)
                failed.add(inst.instance_id)

    async def _colocate_on(self, inst: Instance, cost: RequestCost, reason: ColocatedReason) -> FirstToken:
        """Lease ``inst`` for the whole request and learn the prompt ids; the output comes in ``decode()``."""
        self._abandon_kv(f"the request is served colocated instead ({reason.value})")
        self._hold_decoder(inst, cost.decode_tokens, chunks=0)
        req = self.req
        self.prompt_ids = list(req.prompt_ids) if req.prompt_ids is not None else await self._tokenize(inst)
        self.colocated = reason
        self._note_colocated(inst, reason)
        self._reuse = RequestReuse(self.response_id, len(self.prompt_ids), decoder=inst.instance_id, kv_bytes=0)
        return FirstToken(token_id=-1, text="", finish_reason=None, stop_reason=None, logprobs=None,
                          prompt_ids=self.prompt_ids, model=str(req.body.get("model") or ""), created=int(time.time()))

    def _pick_any(self, cost: RequestCost, failed: Collection[str],
                  roles: tuple[Role, Role] = (Role.SENDER, Role.RECEIVER)) -> Instance | None:
        """The best routable instance not in ``failed``, of the first of ``roles`` that has one."""
        o = self._o
        for role in roles:
            left = [i for i in o.registry.routable(role) if i.instance_id not in failed]
            if not left:
                continue
            if role is Role.SENDER:
                inst = o.router.pick_prefiller(left, exclude=self._tried)
            else:
                inst = o.router.pick_decoder(left, cost, exclude=self._tried, needs_kv=False)
            self._tried.add(inst.instance_id)
            return inst
        return None

    def _note_colocated(self, inst: Instance, reason: ColocatedReason) -> None:
        self._o.metrics.colocated.labels(reason.value, inst.role.value).inc()
        logger.info("request %s: served colocated on %s %s, no KV transfer (%s)", self.response_id, inst.role_name,
                    inst.instance_id, reason.value)

    def _count_admission(self, admission: Admission[Lease]) -> None:
        m = self._o.metrics
        m.admission.labels(admission.outcome.value).inc()
        if admission.outcome is not Outcome.IMMEDIATE:
            m.admission_wait.observe(admission.wait_s)

    def _lease_decoder(self, cost: RequestCost, exclude: Collection[str]) -> Instance:
        """A pairable decoder with credit now, leased (no waiting: a retry); raises when none."""
        decoders, reason = self._pairable()
        if reason is not None:
            raise NoInstanceAvailable(f"no decoder to pair with a prefiller ({reason.value})")
        decoder = self._o.router.pick_decoder(decoders, cost, exclude, prefix=self._prefix)
        self._hold_decoder(decoder, cost.decode_tokens, chunks_needed(cost.prompt_tokens, decoder.chunk_tokens))
        return decoder

    def _hold_decoder(self, decoder: Instance, tokens: int, chunks: int) -> None:
        self._take_lease(self._o.registry.lease(decoder, tokens, chunks))

    def _take_lease(self, lease: Lease) -> None:
        if self._decoder is not None:
            self._decoder.release()
        self._decoder = lease
        self._tried.add(lease.instance.instance_id)

    def _compatible_prefillers(self, decoder: Instance | None) -> list[Instance]:
        o = self._o
        prefillers = o.registry.routable(Role.SENDER)
        return prefillers if decoder is None else [p for p in prefillers if o.registry.compatible(p, decoder)]

    def _pick_prefiller(self, exclude: Collection[str], decoder: Instance | None = None) -> Instance:
        prefiller = self._o.router.pick_prefiller(self._compatible_prefillers(decoder), exclude, prefix=self._prefix)
        self._tried.add(prefiller.instance_id)
        return prefiller

    def _untried_prefiller(self, decoder: Instance) -> Instance | None:
        untried = [p for p in self._compatible_prefillers(decoder) if p.instance_id not in self._tried]
        if not untried:
            return None
        prefiller = self._o.router.pick_prefiller(untried)
        self._tried.add(prefiller.instance_id)
        return prefiller

    async def _send_prefill(self, prefiller: Instance, path: str, build: Callable[[dict[str, Any]], dict[str, Any]],
                            prompt_tokens: int) -> tuple[Instance, dict[str, Any]]:
        """Register a fresh waiter for a fresh req_id, THEN send the prefill."""
        lease = self._lease()
        decoder = lease.instance
        self._abandon_kv("superseded by a new prefill")
        req_id = uuid.uuid4().hex
        handover = self._handover = _Handover(self._o.waiters.register(req_id, decoder.tp_size), lease)
        self.timeline.req_id, self.timeline.tp_size = req_id, decoder.tp_size
        body = build(kv_transfer_params(req_id, decoder))
        logger.debug("prefill %s on %s, KV to %s", req_id, prefiller.http_url, decoder.instance_id)
        try:
            return await self._post_prefill(prefiller, path, body, prompt_tokens, decoder)
        except UpstreamConnectError:
            handover.prefill_sent = False
            raise

    async def _post_prefill(self, prefiller: Instance, path: str, body: dict[str, Any], prompt_tokens: int,
                            decoder: Instance) -> tuple[Instance, dict[str, Any]]:
        """POST the prefill; on a refused connection, to the next compatible prefiller. Returns who
        answered; raises _PrefillBroken when a connection broke after the prefill was sent."""
        failed: set[str] = set()
        while True:
            try:
                return prefiller, await self._post(prefiller, path, body, prompt_tokens)
            except UpstreamConnectError as exc:
                failed.add(prefiller.instance_id)
                prefiller = self._next_prefiller(failed, exc, decoder)
            except UpstreamUnreachable as exc:
                raise _PrefillBroken(prefiller, exc) from exc

    async def _post(self, inst: Instance, path: str, body: dict[str, Any], prompt_tokens: int) -> dict[str, Any]:
        """One POST to ``inst`` under a lease of its load; failed connections are counted against it."""
        o = self._o
        self.timeline.prefill_sent_s = o.clock()
        try:
            with o.registry.lease(inst, prompt_tokens):
                answer = await o.upstream.post_json(inst.http_url, path, body, timeout_s=o.settings.prefill_timeout_s,
                                                    headers=self._headers)
        except UpstreamUnreachable as exc:
            self._connect_failed(inst, exc)
            raise
        self.timeline.prefill_answered_s = o.clock()
        o.registry.note_connected(inst)
        return answer

    def _next_prefiller(self, failed: Collection[str], exc: UpstreamConnectError, decoder: Instance) -> Instance:
        """Another compatible routable prefiller (untried ones first); re-raises ``exc`` when there is none."""
        o = self._o
        others = [p for p in self._compatible_prefillers(decoder) if p.instance_id not in failed]
        if not others:
            raise exc
        prefiller = o.router.pick_prefiller(others, exclude=self._tried)
        self._tried.add(prefiller.instance_id)
        o.metrics.failovers.labels("prefill").inc()
        logger.info("request %s: prefilling on %s instead", self.response_id, prefiller.instance_id)
        return prefiller

    def _on_first_output(self, at_s: float | None = None) -> None:
        """The decoding instance sent its first output (now, or at ``at_s``), so it has loaded the request's
        KV: its receive slots are free again (the buffer credit returns now, not at the next heartbeat)."""
        o = self._o
        now_s = self.timeline.first_decoded_s = o.clock() if at_s is None else at_s
        if self.colocated is not None:
            o.metrics.observe_ttft(self.req.endpoint.value, now_s - self._received_s)
        else:
            o.metrics.observe_handover(now_s - self._prefill_done_s)
        if self._decoder is not None:
            self._decoder.return_credit()

    async def _open_decode(self, stack: contextlib.AsyncExitStack, body: dict[str, Any]
                           ) -> AsyncIterator[dict[str, Any]]:
        """Open the decode stream; on a failed connection, on the next routable decoder (it recomputes)."""
        o = self._o
        failed: set[str] = set()
        while True:
            decoder = self._lease().instance
            if self.timeline.decode_sent_s is None:
                self.timeline.decode_sent_s = o.clock()
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
                self._taken, self._handover = self._handover, None
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

    # ---- decode side: output text, streams, migration ------------------------------------------------

    async def _measure(self, req: ClientRequest) -> ClientRequest:
        """``req`` with its exact prompt token count when the proxy has the tokenizer (kept for the text).

        A text completion's ids go to the prefiller in place of its text (``prefill_body``): the
        prompt is then tokenized once per request, here, not again in the prefiller's API server.
        """
        o = self._o
        registry = o.registry
        instances = [] if o.tokenizers.settled else registry.routable(Role.SENDER) + registry.routable(Role.RECEIVER)
        self._tokenizer = await o.tokenizers.get(instances, o.settings.tokenizer_wait_s)
        ids = await self._prompt_ids(req)
        if ids and o.router.uses_prefix:
            self._prefix = o.router.prompt_prefix(ids)
        if ids is None or req.prompt_ids is not None:
            return req
        return dataclasses.replace(req, exact_prompt_tokens=len(ids),
                                   tokenized_ids=None if req.is_chat else tuple(ids))

    async def _prompt_ids(self, req: ClientRequest) -> list[int] | None:
        """The prompt's ids: the client's, else as the proxy's tokenizer makes them (None: no tokenizer,
        or a prompt it cannot render). A short prompt is tokenized on the event loop: its encoding
        (~0.1 ms per 1000 characters) costs less than the hop to a thread and back (0.2-0.6 ms on 2
        busy cores); a long one in a thread, so that the loop keeps serving other requests."""
        if req.prompt_ids is not None:
            return list(req.prompt_ids)
        if self._tokenizer is None:
            return None
        if req.prompt_tokens_estimate <= _INLINE_TOKENIZE_MAX_TOKENS:
            return self._tokenizer.prompt_ids(req)
        return await asyncio.to_thread(self._tokenizer.prompt_ids, req)

    def _note_prefill(self, prefiller: Instance, decoder: Instance, answer: dict[str, Any]) -> None:
        """The prefill answered: both instances now hold the prompt; note what the prefiller reused."""
        router = self._o.router
        router.remember(prefiller, self._prefix)
        router.remember(decoder, self._prefix)
        self._reuse = RequestReuse(self.response_id, len(self.prompt_ids), prefiller=prefiller.instance_id,
                                   decoder=decoder.instance_id, cached_tokens=_cached_tokens(answer))

    def _remember_output(self) -> None:
        """The decoding instance's prefix cache now holds prompt + output: a next turn finds it there."""
        router = self._o.router
        if self._output_remembered or not router.uses_prefix or self._decoder is None or not self.prompt_ids:
            return
        self._output_remembered = True
        router.remember(self._decoder.instance, router.prompt_prefix(self.prompt_ids + self._output_ids))

    def _observe_reuse(self) -> None:
        reuse, self._reuse = self._reuse, None
        if reuse is None:
            return
        kv = self._kv
        if kv is not None and kv.status is KvStatus.READY:
            known = kv.chunks_held > 0 or kv.bytes_received > 0  # a decoder that reports the new fields
            chunk_tokens = self._decoder.instance.chunk_tokens if self._decoder is not None else 0
            reuse = dataclasses.replace(
                reuse, kv_bytes=kv.bytes_received if known else kv.nbytes,
                chunks_held=kv.chunks_held if known else None,
                decoder_hit_tokens=min(kv.chunks_held * chunk_tokens, reuse.prompt_tokens) if known else None)
        self._o.metrics.reuse.observe_request(reuse)

    def _shape_first(self, first: FirstToken) -> FirstToken:
        """The first token as the client sees it: its finish reason (the prefill's ``length`` only means
        max_tokens 1 there), and its text made here when the proxy has the tokenizer and a decode follows.
        Colocated, there is no first token yet: the serving instance generates the whole output."""
        if self.colocated is not None:
            self._output_ids = []
            if self._tokenizer is not None:
                self._text = self._tokenizer.output_text(self.prompt_ids, TextParams.from_body(self.req.body))
            return first
        self._output_ids = [first.token_id]
        if not self._needs_decode_after(first):
            return first  # the prefiller's text and finish are final (it had the whole context)
        limit = self._o.tokenizers.max_model_len
        if limit is not None and len(self.prompt_ids) + 1 >= limit:
            self._context_full = True  # vLLM would refuse a decode of max_tokens 0
            return dataclasses.replace(first, finish_reason="length")
        first = dataclasses.replace(first, finish_reason=None, stop_reason=None)
        if self._tokenizer is None:
            return first
        self._text = self._tokenizer.output_text(self.prompt_ids, TextParams.from_body(self.req.body))
        step = self._text.update([first.token_id], stop_terminated=False)
        if step.stop_string is not None:
            return dataclasses.replace(first, text=self._text.next_delta(finished=True), finish_reason="stop",
                                       stop_reason=step.stop_string)
        return dataclasses.replace(first, text=self._text.next_delta(finished=False))

    def _needs_decode_after(self, first: FirstToken) -> bool:
        more_allowed = self.req.max_tokens is None or self.req.max_tokens > 1
        return more_allowed and first.finish_reason in (None, "length") and not self._context_full

    async def _decode_stream(self) -> AsyncIterator[Delta]:
        """One decode stream from the current decoder, continuing after ``self._output_ids``."""
        done = len(self._output_ids) - self._replay.rewound  # the next instance generates the replayed ones again
        body = decode_body(self.req, self.prompt_ids, self._output_ids[:done], proxy_text=self._text is not None)
        async with contextlib.AsyncExitStack() as stack:
            events = await self._open_decode(stack, body)
            async for event in events:
                if not self._handover_observed:
                    self._handover_observed = True
                    self._on_first_output()
                raw = decode_delta(event)
                if raw is None:
                    continue
                self._free_taken_kv()
                raw = self._replay.filter(raw)
                if raw is None:
                    continue
                delta = self._shape_delta(raw)
                self._held.observe(delta)
                self._output_ids.extend(delta.token_ids)
                self._finished = delta.finish_reason is not None
                yield delta
                if self._finished:
                    return  # a stop string the proxy found: closing the stream aborts the decoder's request

    def _shape_delta(self, delta: Delta) -> Delta:
        return shape_delta(self._text, delta)

    def _end_of_context(self) -> Delta:
        self._finished = True
        return end_of_context(self._text)

    def _free_taken_kv(self) -> None:
        """The decode produced output: its engine loaded what it will load; free what is left of the KV."""
        taken, self._taken = self._taken, None
        if taken is not None and taken.prefill_sent:
            self._o.canceller.cancel(taken.decoder.instance, taken.req_id,
                                     "the decode is running: free the KV its engine did not load")

    def _migrate(self, broken: Instance, failed: Collection[str], exc: UpstreamError) -> None:
        """Lease another instance to continue the output on: a decoder, else a prefiller (colocated)."""
        o = self._o
        self._free_taken_kv()
        logger.warning("request %s: the decode stream on %s broke after %d output token(s) (%s): continuing elsewhere",
                       self.response_id, broken.instance_id, len(self._output_ids), exc)
        if not isinstance(exc, UpstreamConnectError):  # connect failures are counted where they happen
            o.metrics.connect_failures.labels(broken.role.value).inc()
            o.registry.note_connect_failure(broken)
        candidates = [d for d in o.registry.routable(Role.RECEIVER) if d.instance_id not in failed]
        if not candidates:
            candidates = [p for p in o.registry.routable(Role.SENDER) if p.instance_id not in failed]
        if not candidates:
            raise exc
        cost = RequestCost(len(self.prompt_ids) + len(self._output_ids), self.req.output_tokens_estimate)
        target = (o.router.pick_decoder(candidates, cost, exclude=(), needs_kv=False) if candidates[0].role is
                  Role.RECEIVER else o.router.pick_prefiller(candidates))
        self._hold_decoder(target, cost.decode_tokens, chunks=0)
        o.metrics.failovers.labels("migrate").inc()
        logger.info("request %s: decoding continues on %s %s (it recomputes the prompt)", self.response_id,
                    target.role_name, target.instance_id)

    def _may_continue_elsewhere(self) -> bool:
        """Another instance prompted with prompt + output so far would decode as this one did."""
        if self._output_ids and reads_output_tokens(self.req):
            logger.warning("request %s: its sampling (penalties / bad_words) reads the %d output token(s) so far, "
                           "which another instance would take as prompt: the output ends here with an error",
                           self.response_id, len(self._output_ids))
            return False
        return True

    def _connect_failed(self, inst: Instance, exc: UpstreamUnreachable) -> None:
        refused = isinstance(exc, UpstreamConnectError)
        logger.info("request %s: %s %s %s: %s", self.response_id, "cannot connect to" if refused else "lost",
                    inst.role_name, inst.instance_id, exc)
        if refused:
            self._o.metrics.connect_failures.labels(inst.role.value).inc()
        self._o.registry.note_connect_failure(inst)


    def _abandon_kv(self, reason: str) -> None:
        """The decode will not take this handover's KV: stop waiting, and tell its decoder to free it."""
        handover, self._handover = self._handover, None
        if handover is None:
            return
        handover.waiter.drop()
        handover.decoder.return_credit()
        if handover.prefill_sent:
            self._o.canceller.cancel(handover.decoder.instance, handover.req_id, reason)

    async def _tokenize(self, inst: Instance) -> list[int]:
        answer = await self._o.upstream.post_json(inst.http_url, "/tokenize", tokenize_body(self.req),
                                                  timeout_s=self._o.settings.prefill_timeout_s, headers=self._headers)
        tokens = answer.get("tokens")
        if not isinstance(tokens, list) or not tokens:
            raise UpstreamMalformed(f"{inst.http_url}/tokenize answered without tokens")
        return tokens

    async def _settle_kv(self) -> None:
        if self._handover is None:  # colocated: no KV comes
            return
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
            self.timeline.kv_ready_s = self._handover.waiter.ready_at_s
        self._kv = outcome
        return outcome

    async def _retry_prefill(self) -> None:
        cost = RequestCost(len(self.prompt_ids), self.req.output_tokens_estimate)
        exclude = set(self._tried)
        decoder = self._lease_decoder(cost, exclude)
        prefiller = self._pick_prefiller(exclude, decoder)
        try:
            await self._send_prefill(prefiller, Endpoint.COMPLETIONS.value,
                                     lambda kv: retry_prefill_body(self.req, self.prompt_ids, kv), cost.prompt_tokens)
        except _PrefillBroken as broke:
            raise broke.cause from None

    def _give_up_kv(self, outcome: KvOutcome, action: str) -> None:
        handover = self._handover
        logger.warning("request %s: KV %s (req_id %s, decoder %s): %s; %s", self.response_id, outcome.status.value,
                       handover.req_id if handover else "?", handover.decoder.instance.instance_id if handover else "?",
                       outcome.reason, action)
        self._abandon_kv(f"KV {outcome.status.value}: {outcome.reason}")


def shape_delta(text: OutputText | None, delta: Delta) -> Delta:
    """The client's text for the decoder's tokens (the decoder's own text starts mid-context)."""
    if text is None:
        return delta
    # The decoder has no stop strings (the proxy applies them), so "stop" means an EOS / stop token id.
    step = text.update(delta.token_ids, stop_terminated=delta.finish_reason == "stop")
    finish_reason, stop_reason = delta.finish_reason, delta.stop_reason
    if step.stop_string is not None:
        finish_reason, stop_reason = "stop", step.stop_string
    return Delta(text.next_delta(finished=finish_reason is not None), delta.token_ids[:step.kept],
                 _first_logprobs(delta.logprobs, step.kept), finish_reason, stop_reason)


def end_of_context(text: OutputText | None) -> Delta:
    """The output ends because prompt + output fill the context (as one instance's ``length``)."""
    return Delta(text.next_delta(finished=True) if text is not None else "", [], None, "length", None)


def _cached_tokens(answer: dict[str, Any]) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a vLLM answer (``--enable-prompt-tokens-details``)."""
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and cached >= 0 else None


def reads_output_tokens(req: ClientRequest) -> bool:
    """Sampling that reads the request's own output tokens, not its prompt's (vLLM 0.32: presence and
    frequency penalties, ``apply_penalties``; multi-token ``bad_words``, ``apply_bad_words``), so only
    the instance that output a token takes it into account."""
    penalties = (req.body.get("presence_penalty"), req.body.get("frequency_penalty"))
    return any(isinstance(v, (int, float)) and v != 0 for v in penalties) or bool(req.body.get("bad_words"))


def migratable(exc: UpstreamError) -> bool:
    """A broken, silent or failing (5xx) decode stream; a 4xx is the request's own fault."""
    return isinstance(exc, (UpstreamUnreachable, UpstreamTimeout)) or (
        isinstance(exc, UpstreamStatus) and exc.status_code >= 500)


def context_full(exc: UpstreamError) -> bool:
    """vLLM's refusal of a decode whose prompt fills the context (max_tokens computed as 0)."""
    return (isinstance(exc, UpstreamStatus) and exc.status_code == 400
            and "max_tokens must be at least 1, got 0" in str(exc))


def _first_logprobs(logprobs: dict[str, Any] | None, n: int) -> dict[str, Any] | None:
    """Completion-format logprobs of the first ``n`` tokens."""
    if not logprobs:
        return logprobs
    return {k: v[:n] if isinstance(v, list) else v for k, v in logprobs.items()}
