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

The decoder always gets the prompt ids + the first token, so it loads the whole prompt's KV. With
the model's tokenizer (``tokenizer.py``) the proxy makes the client's text from token ids as one
vLLM instance would (``detokenize.py``); without one the text comes from the instances, and a
text prompt whose first token has no text of its own (an incomplete UTF-8 character) falls back
to "the decoder regenerates the first token" (prompt alone; its last chunk is recomputed).

A decode stream that breaks (the decoder died, answered 5xx, or went silent) continues on another
decoder, else on a prefiller serving colocated, prompted with prompt ids + every token the client
already has (remaining ``max_tokens``, same sampling params: with greedy sampling the output
equals one instance's), at most ``--migration-limit`` times per request; nothing is sent twice.

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
from lmcache_p2p.proxy.cancel import KvCanceller
from lmcache_p2p.proxy.detokenize import OutputText, TextParams
from lmcache_p2p.proxy.errors import (
    KvNotReady,
    ProxyError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamMalformed,
    UpstreamStatus,
    UpstreamTimeout,
    UpstreamUnreachable,
)
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
from lmcache_p2p.proxy.tokenizer import ProxyTokenizer, TokenizerProvider
from lmcache_p2p.proxy.upstream import Upstream
from lmcache_p2p.proxy.waiters import KvOutcome, KvStatus, KvWaiter, KvWaiters

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class FlowSettings:
    kv_timeout_s: float = 10.0
    prefill_timeout_s: float = 120.0
    decode_idle_timeout_s: float = 120.0
    on_kv_failure: KvFailurePolicy = KvFailurePolicy.RETRY
    migration_limit: int = 2  # mid-stream moves of one request's decode to another instance


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
        self.tokenizers = tokenizers or TokenizerProvider.fixed(None)

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
        self._tokenizer: ProxyTokenizer | None = None
        self._text: OutputText | None = None  # None: the text comes from the instances
        self._output_ids: list[int] = []  # the output's token ids the client has (or will get with ``first``)
        self._finished = False
        self._context_full = False
        self._handover_observed = False
        self._taken: _Handover | None = None  # the handover the running decode took: cancelled after its 1st token

    # ---- phase 1: prefill ----------------------------------------------------------------------

    async def prefill(self) -> FirstToken:
        """Route, prefill on the client's endpoint, learn the prompt ids; returns the first token."""
        req = self.req = await self._measure(self.req)
        cost = RequestCost(req.prompt_tokens, req.output_tokens_estimate)
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
        self.first = self._shape_first(first)
        self._prefill_done_s = self._o.clock()
        ttft_s = self._prefill_done_s - self._received_s
        self._o.metrics.observe_ttft(req.endpoint.value, ttft_s)
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
        first = self._first_or_raise()
        return self.needs_decode and self._text is None and self.req.prompt_ids is None and not first.text

    @property
    def needs_decode(self) -> bool:
        """False when the first token already ended the output (max_tokens 1, EOS, a stop string, or the
        prompt + first token fill the context: ``max_model_len`` from the instances' /v1/models)."""
        return self._needs_decode_after(self._first_or_raise())

    # ---- phase 2: KV, then decode ----------------------------------------------------------------

    async def decode(self) -> AsyncIterator[Delta]:
        """Wait for the KV (retrying or recomputing per policy), then stream the output after the first
        token; a stream that breaks continues elsewhere (``--migration-limit``)."""
        await self._settle_kv()
        if self.decoder_regenerates_first:
            self._output_ids = []
        failed: set[str] = set()
        migrations = 0
        while True:
            try:
                async for delta in self._decode_stream():
                    yield delta
                return
            except UpstreamError as exc:
                if _context_full(exc):
                    logger.info("request %s: the context is full after %d output token(s): the output ends there",
                                self.response_id, len(self._output_ids))
                    yield self._end_of_context()
                    return
                decoder = self._lease().instance
                if not _migratable(exc) or self._finished or migrations >= self._o.settings.migration_limit:
                    raise
                migrations += 1
                failed.add(decoder.instance_id)
                self._migrate(decoder, failed, exc)

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
        """``req`` with its exact prompt token count when the proxy has the tokenizer (kept for the text)."""
        o = self._o
        registry = o.registry
        instances = [] if o.tokenizers.settled else registry.routable(Role.SENDER) + registry.routable(Role.RECEIVER)
        self._tokenizer = await o.tokenizers.get(instances)
        if self._tokenizer is None or req.exact_prompt_tokens is not None:
            return req
        count = await asyncio.to_thread(self._tokenizer.prompt_tokens, req)
        return req if count is None else dataclasses.replace(req, exact_prompt_tokens=count)

    def _shape_first(self, first: FirstToken) -> FirstToken:
        """The first token as the client sees it: its finish reason (the prefill's ``length`` only means
        max_tokens 1 there), and its text made here when the proxy has the tokenizer and a decode follows."""
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
        o = self._o
        body = decode_body(self.req, self.prompt_ids, self._output_ids, proxy_text=self._text is not None)
        async with contextlib.AsyncExitStack() as stack:
            events = await self._open_decode(stack, body)
            async for event in events:
                if not self._handover_observed:
                    self._handover_observed = True
                    o.metrics.observe_handover(o.clock() - self._prefill_done_s)
                raw = decode_delta(event)
                if raw is None:
                    continue
                self._free_taken_kv()
                delta = self._shape_delta(raw)
                self._output_ids.extend(delta.token_ids)
                self._finished = delta.finish_reason is not None
                yield delta
                if self._finished:
                    return  # a stop string the proxy found: closing the stream aborts the decoder's request

    def _shape_delta(self, delta: Delta) -> Delta:
        """The client's text for the decoder's tokens (the decoder's own text starts mid-context)."""
        if self._text is None:
            return delta
        # The decoder has no stop strings (the proxy applies them), so "stop" means an EOS / stop token id.
        step = self._text.update(delta.token_ids, stop_terminated=delta.finish_reason == "stop")
        finish_reason, stop_reason = delta.finish_reason, delta.stop_reason
        if step.stop_string is not None:
            finish_reason, stop_reason = "stop", step.stop_string
        return Delta(self._text.next_delta(finished=finish_reason is not None), delta.token_ids[:step.kept],
                     _first_logprobs(delta.logprobs, step.kept), finish_reason, stop_reason)

    def _end_of_context(self) -> Delta:
        """The output ends because prompt + output fill the context (as one instance's ``length``)."""
        self._finished = True
        text = self._text.next_delta(finished=True) if self._text is not None else ""
        return Delta(text, [], None, "length", None)

    def _free_taken_kv(self) -> None:
        """The decode produced output: its engine loaded what it will load; free what is left of the KV."""
        taken, self._taken = self._taken, None
        if taken is not None and taken.prefill_sent:
            self._o.canceller.cancel(taken.decoder, taken.req_id,
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


def _migratable(exc: UpstreamError) -> bool:
    """A broken, silent or failing (5xx) decode stream; a 4xx is the request's own fault."""
    return isinstance(exc, (UpstreamUnreachable, UpstreamTimeout)) or (
        isinstance(exc, UpstreamStatus) and exc.status_code >= 500)


def _context_full(exc: UpstreamError) -> bool:
    """vLLM's refusal of a decode whose prompt fills the context (max_tokens computed as 0)."""
    return (isinstance(exc, UpstreamStatus) and exc.status_code == 400
            and "max_tokens must be at least 1, got 0" in str(exc))


def _first_logprobs(logprobs: dict[str, Any] | None, n: int) -> dict[str, Any] | None:
    """Completion-format logprobs of the first ``n`` tokens."""
    if not logprobs:
        return logprobs
    return {k: v[:n] if isinstance(v, list) else v for k, v in logprobs.items()}
