"""One request, end to end, as its owner (the proxy process that routes it) runs it: pick decoder D
and prefiller P, prefill on P (its KV goes to D), wait until every TP rank of D reports the KV
ready, then name the decode on D and follow it (migration) until the request closes.

    flow = orchestrator.open(req, headers, received_s)
    try:
        opened = await flow.prefill()        # the first token (the client side sends it at once)
        target = await flow.plan()           # KV ready (or retried / recomputed): where the decode goes
        ...                                  # the client side streams it (flow/decode.py), reporting
                                             # started / unreachable / broken
    finally:
        flow.close(answer)                   # never awaits: safe in a cancelled task

The waiter for "KV ready" is registered before the prefill is sent. With ``--early-decode`` an lmcache_p2p
pair's decode is named at once, carrying the marker its decoder holds it by until the KV arrived, and the
wait runs beside it (``flow/early.py``): a KV failure before the decode's first output gives that decode
up (``settled``) and takes the path below, as a wait before the decode would. On a KV failure or timeout
(``--kv-timeout-s``) the policy decides: ``retry`` prefills once more (token ids, another pair
when there is one) and then recomputes, ``recompute`` sends the decode at once (the decoder
recomputes what it lacks), ``fail`` answers 502/504. A handover that cannot happen ends its wait as
soon as that is known (a KvFailed, the decoder taken out by the registry, or not answering its probe
while the KV is overdue, ``--kv-probe-after-s``); a decoder known down or unreachable is then left
out: the retry goes to another decoder, else the prefiller that computed the prompt continues the
decode (``flow/handover.py``). Nothing waits without a deadline.

The parts, each in its module: where the request runs and where it moves on a failure
(``flow/placement.py``), the prefill attempts (``flow/prefill.py``), the KV handover (``flow/handover.py``), the
decode stream and migration (``flow/decode.py``, the same loop for relay workers), the output's
text and what it teaches the router and the metrics (``flow/output.py``), the request's phase
(``flow/phase.py``). This module holds them together and implements the step API the client side
drives (``flow/steps.py``): in this process the client side calls these methods; a relay worker's
steps arrive through the coordinator (``relay/host.py``), which calls the same methods.

The pair's KV backend (ours, or vLLM's own NixlConnector) changes only what ``flow/backends.py`` says: how
the prefill asks for the KV and what its answer hands over (a KvReady wait, or the prefiller's pull
parameters), what the decode carries (prompt + first token, or the prefill's prompt with those parameters,
its first token generated again and dropped), how long the decoder holds the KV's credit, and how a broken
decode continues (recomputed, or a prefill of prompt + output that the next decoder pulls).

Routing (``router/routing.py`` has the policy): a disaggregated request first waits in the admission
queue (``router/admission.py``) for buffer credit on a decoder whose KV fingerprint matches a prefiller's,
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
the model's tokenizer (``http/tokenizer.py``) the proxy makes the client's text from token ids as one
vLLM instance would (``http/detokenize.py``); without one the text comes from the instances, and a
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

A chat whose answer vLLM's output parsers make (``RequestContext.instance_renders``: tools with a ``tool_choice``
other than "none", or every chat under ``--chat-parsers``) is decoded on the decoder's chat endpoint, where
alone they run: the client's request, prompted with the prefill's ids (``shaping.chat_decode_body``; colocated,
the instance renders the messages itself), generating the whole answer, whose chat deltas (content,
reasoning, tool_calls) go to the client as they come. The prefill stays a chat (a push connector pairs the two
by their ``chatcmpl-`` ids). Its parsers' state cannot move to another instance, so a stream of it that breaks
after its first output ends with an error; one that breaks before goes elsewhere.

A request's KV handover (its ``req_id`` on decoder D) ends in one of two ways: the decode request
reaches D (once D produced its first token the proxy cancels the ``req_id``, so that slots the
engine did not load, e.g. an unused partial last chunk, are freed now rather than at lease
expiry), or the proxy abandons it (KV failed or timed out, the decode moved elsewhere, the first
token ended the output, the client left, an error) and tells every rank of D to free it
(``handover/cancel.py``), unless the prefill never reached a prefiller.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Mapping

from lmcache_p2p.proxy.errors import ProxyError

from lmcache_p2p.config import Role
from lmcache_p2p.proxy.router.admission import AdmissionQueue
from lmcache_p2p.proxy.handover.cancel import KvCanceller
from lmcache_p2p.proxy.errors import UpstreamConnectError, UpstreamError
from lmcache_p2p.proxy.flow.backends import backend_of
from lmcache_p2p.proxy.flow.context import FlowSettings, RequestContext, Services
from lmcache_p2p.proxy.flow.phase import FlowPhase, Phases
from lmcache_p2p.proxy.flow.handover import KvHandover
from lmcache_p2p.proxy.observe.metrics import ProxyMetrics
from lmcache_p2p.proxy.flow.output import RequestOutput
from lmcache_p2p.proxy.flow.placement import Placement
from lmcache_p2p.proxy.flow.prefill import PrefillAttempts
from lmcache_p2p.proxy.flow.prompt import measure
from lmcache_p2p.proxy.router.registry import Registry
from lmcache_p2p.proxy.flow.steps import Answer, Count, Opened, Target
from lmcache_p2p.proxy.http.responses import FirstToken
from lmcache_p2p.proxy.router.routing import ColocatedReason, RequestCost, Router
from lmcache_p2p.proxy.http.shaping import (ClientRequest, Endpoint, calls_tools, chat_decode_body, decode_body,
                                            reads_output_tokens)
from lmcache_p2p.proxy.observe.timeline import DecodePart, Timeline
from lmcache_p2p.proxy.http.tokenizer import ProxyTokenizer, TokenizerProvider
from lmcache_p2p.proxy.upstream import Upstream
from lmcache_p2p.proxy.handover.waiters import KvWaiters

__all__ = ["FlowSettings", "Orchestrator", "RequestFlow", "apply_count"]

logger = logging.getLogger(__name__)

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
        # A decoder forgotten, down, restarted or moved will not report the KV awaited there: those waits end now.
        registry.on_forgotten.append(lambda inst: waiters.decoder_down(inst.instance_id, f"{inst.role_name} "
                                                                       f"{inst.instance_id} was forgotten"))
        registry.on_pending.append(lambda inst: waiters.decoder_down(inst.instance_id, f"{inst.role_name} "
                                                                     f"{inst.instance_id} is out of rotation "
                                                                     f"({inst.health.value})"))
        router.on_prefix_decision.append(lambda role, d: metrics.reuse.observe_decision(role.value, d.value))
        self.tokenizers = tokenizers or TokenizerProvider.fixed(None)
        self._open: set[RequestFlow] = set()  # closed at shutdown (their leases, their KV on decoders)

    def __len__(self) -> int:
        """Requests open."""
        return len(self._open)

    def services(self) -> Services:
        return Services(self.registry, self.router, self.waiters, self.upstream, self.canceller, self.metrics,
                        self.settings, self.clock, self.admission, self.tokenizers)

    def open(self, req: ClientRequest, headers: Mapping[str, str], received_s: float) -> RequestFlow:
        flow = RequestFlow(self.services(), req, headers, received_s, on_closed=self._open.discard)
        self._open.add(flow)
        return flow

    def count(self, count: Count) -> None:
        apply_count(self.metrics, count)

    def close_all(self) -> None:
        for flow in list(self._open):
            flow.close()


class RequestFlow:
    def __init__(self, services: Services, req: ClientRequest, headers: Mapping[str, str], received_s: float,
                 on_closed: Callable[[RequestFlow], None] = lambda flow: None) -> None:
        self._s = services
        self._on_closed = on_closed
        ctx = self._ctx = RequestContext(req, headers, received_s, uuid.uuid4().hex, Timeline(received_s))
        ctx.instance_renders = req.is_chat and (services.settings.chat_parsers or calls_tools(req))
        self._phases = Phases(ctx.response_id)
        self._placement = Placement(services, ctx)
        self._handover = KvHandover(services, ctx, self._placement)
        self._prefill = PrefillAttempts(services, ctx, self._placement, self._handover)
        self._output = RequestOutput(services, ctx)
        self.first: FirstToken | None = None
        self._finished = False  # the output ended (a finish reason) before its stream broke
        self._rewound = 0  # the last output tokens a continuation generates again (http/held_text.py)
        self._connect_failed: set[str] = set()  # decoders that refused this stream's connection
        self._migrated_from: set[str] = set()  # decoders whose stream broke
        self._migrations = 0

    # ---- the request's facts ---------------------------------------------------------------------

    @property
    def req(self) -> ClientRequest:
        return self._ctx.req

    @property
    def response_id(self) -> str:
        return self._ctx.response_id

    @property
    def prompt_ids(self) -> list[int]:
        return self._ctx.prompt_ids

    @property
    def colocated(self) -> ColocatedReason | None:
        return self._ctx.colocated

    @property
    def timeline(self) -> Timeline:
        return self._ctx.timeline

    @property
    def phase(self) -> FlowPhase:
        return self._phases.now

    @property
    def proxy_text(self) -> bool:
        """The proxy makes the client's text (it has the tokenizer) rather than the instances."""
        return self._output.text is not None

    @property
    def tokenizer_source(self) -> str | None:
        return self._output.tokenizer_source

    @property
    def decoder_regenerates_first(self) -> bool:
        """The proxy has no tokenizer, the prompt is text and the first token has no text of its own.

        A decoder prompted with prompt ids + such a token starts detokenizing mid-character and emits
        the prompt's text with its first output (a byte-level BPE). Without a tokenizer the proxy cannot
        make the text itself, so the decoder gets the prompt alone and generates the whole output,
        first token included (its last chunk is recomputed). Token-id prompts (``--skip-tokenizer-init``
        instances have no text at all) always get prompt + first.
        """
        if self.colocated is not None or self._ctx.instance_renders:
            return True  # the serving instance generates the whole output
        first = self._first_or_raise()
        if not self.needs_decode:
            return False
        no_text = self._output.text is None and self.req.prompt_ids is None and not first.text
        return no_text or not self._handover.backend.first_from_prefill(self.req)

    @property
    def needs_decode(self) -> bool:
        """False when the first token already ended the output (max_tokens 1, EOS, a stop string, or the
        prompt + first token fill the context: ``max_model_len`` from the instances' /v1/models)."""
        if self.colocated is not None or self._ctx.instance_renders:
            return True  # the serving instance generates the whole output
        return self._output.needs_decode_after(self._first_or_raise())

    # ---- the steps (flow/steps.py: the client side's, in this process or through the coordinator) -------

    async def prefill(self) -> Opened:
        """Route, prefill on the client's endpoint, learn the prompt ids; the first token and what serving the
        rest needs. Colocated (``self.colocated``), no prefill runs: the first token is empty and the serving
        instance generates the whole output in the decode."""
        first = await self._prefill_first()
        return Opened(self.response_id, dataclasses.replace(first, prompt_ids=None), self.prompt_ids,
                      self.needs_decode, self.decoder_regenerates_first, self.colocated is not None, self.proxy_text,
                      self.tokenizer_source, self._s.settings.decode_idle_timeout_s)

    async def tokenizer(self) -> ProxyTokenizer:
        tokenizer = self._output.tokenizer
        if tokenizer is None:
            raise ProxyError(f"request {self.response_id}: no tokenizer loaded from {self.tokenizer_source}")
        return tokenizer

    async def plan(self) -> Target:
        """Wait for the KV (retrying or recomputing per policy), then where the first decode goes. With
        ``--early-decode`` an lmcache_p2p pair's decode goes at once (``Target.kv_pending``), its KV wait beside
        it (``settled``)."""
        early = self._handover.go_early()
        if not early:
            await self._handover.settle(self._prefill.retry)
        if self.decoder_regenerates_first:
            self._output.ids.clear()
        self._phases.advance(FlowPhase.PLANNED)
        return self._target(kv_pending=early)

    async def settled(self) -> Target | None:
        """An early decode's KV outcome against its first output (``flow/early.py``): None when the decode goes
        on; when the KV failed first, the decode is given up and the failure goes where ``--on-kv-failure``
        says, as for a wait before the decode: where the decode goes instead."""
        failed = await self._handover.early_failure()
        if failed is None or self._phases.now is not FlowPhase.PLANNED:
            return None
        if self.timeline.decode_parts:
            self.timeline.decode_parts.pop()  # it served nothing: the next target continues at the same token
        await self._handover.fail_over(failed, self._prefill.retry)
        return self._target()

    async def unreachable(self, exc: UpstreamConnectError) -> Target | None:
        """The target refused the connection (nothing was sent): another decoder recomputes; None when none."""
        decoder = self._placement.lease().instance
        if self.timeline.decode_parts:
            self.timeline.decode_parts.pop()  # it served nothing: the next target continues at the same token
        self._handover.decode_left()
        self._connect_failed.add(decoder.instance_id)
        self._placement.connect_failed(decoder, exc)
        self._handover.moved()
        try:
            self._placement.next_decoder(self._connect_failed, exc)
        except UpstreamConnectError:
            return None
        return self._target()

    def started(self, decode_sent_s: float | None = None, first_decoded_s: float | None = None,
                decode_accepted_s: float | None = None, kv_pending: bool = False) -> None:
        """The target sent its first output: it has loaded the request's KV. The stamps (same machine,
        same monotonic clock) of its decode request, its response headers and that first output, when the
        caller has them; ``kv_pending``: of a target sent before its KV was ready."""
        if self._phases.now is not FlowPhase.PLANNED:
            return  # its first output was seen already (or the request is over)
        if kv_pending and not self._handover.decode_first():
            return  # the KV failed first: that decode was given up (settled() named where it goes)
        self._phases.advance(FlowPhase.DECODING)
        if decode_sent_s is not None:
            self.timeline.decode_sent_s = decode_sent_s
        self.timeline.decode_accepted_s = decode_accepted_s
        lease = self._placement.lease()
        self._s.registry.note_connected(lease.instance)
        keeps_kv = backend_of(lease.instance).decoder_keeps_kv
        if keeps_kv:
            lease.settle()  # its blocks are allocated: the decoder's next reading counts them
        self._output.first_output(self._s.clock() if first_decoded_s is None else first_decoded_s,
                                  None if keeps_kv else lease)
        self._handover.free_taken()

    async def broken(self, output_ids: list[int], finished: bool, rewound: int, exc: UpstreamError) -> Target | None:
        """The stream broke after ``output_ids``: where it continues (its last ``rewound`` generated again);
        None when it may not (finished, the migration limit, sampling that reads the output)."""
        self._output.ids[:] = output_ids
        self._finished, self._rewound = finished, rewound
        if finished or self._migrations >= self._s.settings.migration_limit or not self._may_continue_elsewhere():
            return None
        decoder = self._placement.lease().instance
        self._migrated_from.add(decoder.instance_id)
        self._handover.decode_left()
        self._handover.free_taken()
        try:
            self._placement.migrate(decoder, self._migrated_from, exc, len(output_ids))
        except UpstreamError:
            return None
        target = self._placement.lease().instance
        if target.role is Role.RECEIVER and backend_of(target).continues_with_kv:
            await self._prefill.continuation(output_ids[:len(output_ids) - rewound])
        self._migrations += 1
        self._connect_failed = set()
        return self._target()

    async def end(self, answer: Answer) -> None:
        """The answer is complete (before the client's [DONE]: its next turn may follow at once)."""
        self.close(answer)

    def close(self, answer: Answer | None = None) -> None:
        """Abandon a KV handover the decode did not take (cancel it), release the decoder; never awaits.
        ``answer``: the client side's (its counts, the output it got), taken once. Called again (a prefill
        that ended after its handler gave up), it releases what was taken since."""
        if answer is not None and self._phases.now is not FlowPhase.CLOSED:
            self._take(answer)
        self._handover.stop_early()
        if self._handover.pending:
            ended = self.first is not None and not self.needs_decode
            self._handover.abandon("no decode needed: the first token ended the output" if ended
                                   else "the request ended before its decode (client gone or an error)")
        self._handover.free_taken()
        lease = self._placement.leased
        if self._phases.now is not FlowPhase.CLOSED:
            if self._phases.now is not FlowPhase.ENDED:
                self._output.remember(lease)
            self._output.observe_reuse(self._handover.outcome, lease)
            self._output.record_timeline()
            self._s.metrics.record_decode(self.response_id, self.timeline.decode_parts)
            self._phases.advance(FlowPhase.CLOSED)
            self._on_closed(self)
        self._placement.release()

    async def closing(self) -> None:
        """Nothing to wait for: ``close`` closed it."""

    # ---- internals -------------------------------------------------------------------------------

    async def _prefill_first(self) -> FirstToken:
        ctx = self._ctx
        req, self._output.tokenizer = await measure(self._s, ctx, ctx.req)
        ctx.req = req
        if ctx.instance_renders:
            self._output.tokenizer = None  # the decoder makes the text (its parsers read it)
        first = await self._prefill.run(RequestCost(req.prompt_tokens, req.output_tokens_estimate))
        self.first = self._output.shape_first(first)
        ctx.prefill_done_s = self._s.clock()
        if self._phases.now is FlowPhase.CLOSED:  # its handler gave up (client gone): close() frees what it took
            return self.first
        self._phases.advance(FlowPhase.PREFILLED)
        if ctx.colocated is None:
            self._s.metrics.observe_ttft(req.endpoint.value, ctx.prefill_done_s - ctx.received_s)
        return self.first

    def _take(self, answer: Answer) -> None:
        """The client side's answer: its counts, when its first byte went out, the output it got."""
        for one in answer.counts:
            apply_count(self._s.metrics, one)
        if answer.first_byte_s is not None and self.timeline.first_byte_s is None:
            self.timeline.first_byte_s = answer.first_byte_s
        self._output.ids[:] = answer.output_ids
        if self._phases.may(FlowPhase.ENDED):  # the output is complete, or as complete as it will be
            self._phases.advance(FlowPhase.ENDED)
            self._output.remember(self._placement.leased)

    def _target(self, kv_pending: bool = False) -> Target:
        """The current decoder and the decode request that continues after the output so far. The decoder
        holding the KV takes the handover now (the decode goes to it); ``kv_pending``: before its KV is ready."""
        ids = self._output.ids
        continues_at = len(ids) - self._rewound
        kv = self._handover.take()
        instance = self._placement.lease().instance
        if kv is not None and (kv.params is None or kv.backend is not instance.backend):
            kv = None  # the decoder computes what it lacks
        # a decoder that pulls the prefill's KV is prompted with exactly that prompt: it generates the output
        # tokens after it again, which the client has (``replays``)
        upto = min(kv.output_tokens, continues_at) if kv is not None and kv.prompt_fixed else continues_at
        kv_params = kv.params if kv is not None else None
        path = Endpoint.COMPLETIONS.value
        if self._ctx.instance_renders:  # the whole answer, from the prompt: nothing is output before it
            # the prefill's ids, as its chat endpoint rendered them; colocated, the instance renders the messages
            body = chat_decode_body(self.req, self.prompt_ids if self.colocated is None else None, kv_params)
            path = Endpoint.CHAT.value
        else:
            body = decode_body(self.req, self.prompt_ids, ids[:upto], proxy_text=self.proxy_text, kv_params=kv_params)
        if self.timeline.decode_sent_s is None:
            self.timeline.decode_sent_s = self._s.clock()
        self.timeline.decode_parts.append(DecodePart(instance.instance_id, continues_at))
        # a decoder that pulls the KV first outputs nothing until the pull is done: --kv-timeout-s bounds that
        # as it bounds our KvReady wait (a pull that hangs then moves the decode elsewhere); an early decode's
        # wait is bounded by the KV wait beside it
        first_output_timeout_s = self._s.settings.kv_timeout_s if kv is not None and kv.portable else None
        return Target(instance.http_url, body, continues_at - upto, first_output_timeout_s,
                      request_id=kv.request_id if kv is not None else None, kv_pending=kv_pending, path=path)

    def _may_continue_elsewhere(self) -> bool:
        """Another instance prompted with prompt + output so far would decode as this one did."""
        if self._output.ids and self._ctx.instance_renders:
            logger.warning("request %s: its answer is rendered by the decoder's chat endpoint, whose parsers would "
                           "start afresh after the %d output token(s) so far: the output ends here with an error",
                           self.response_id, len(self._output.ids))
            return False
        if self._output.ids and reads_output_tokens(self.req):
            logger.warning("request %s: its sampling (penalties / bad_words) reads the %d output token(s) so far, "
                           "which another instance would take as prompt: the output ends here with an error",
                           self.response_id, len(self._output.ids))
            return False
        return True

    def _first_or_raise(self) -> FirstToken:
        if self.first is None:
            raise RuntimeError("prefill() first")
        return self.first


def apply_count(metrics: ProxyMetrics, count: Count) -> None:
    endpoint = Endpoint(count.endpoint)
    if count.status is not None:
        metrics.requests.labels(endpoint.value, str(count.status)).inc()
    if count.error is not None:
        metrics.errors.labels(endpoint.value, count.error).inc()
