"""One request's output as the client gets it, and what the proxy learns from it: the client's
text (made here with the proxy's tokenizer, else the instances'), the output's token ids, the
prefix-cache bookkeeping (which instance now holds prompt + output), and the metrics observed on
the way (TTFT, handover, reuse, the request's timeline).

It owns the output text and ids and these observations. It must not send anything or choose
instances; the decode session (``flow/decode.py``) feeds it deltas, the flow tells it when
the first output came and when the request ends.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lmcache_p2p.proxy.http.detokenize import OutputText, TextParams
from lmcache_p2p.proxy.flow.context import RequestContext, Services
from lmcache_p2p.proxy.router.registry import Lease
from lmcache_p2p.proxy.http.responses import Delta, FirstToken, usage
from lmcache_p2p.proxy.http.tokenizer import ProxyTokenizer
from lmcache_p2p.proxy.handover.waiters import KvOutcome, KvStatus


class RequestOutput:
    def __init__(self, services: Services, ctx: RequestContext) -> None:
        self._s = services
        self._ctx = ctx
        self.tokenizer: ProxyTokenizer | None = None
        self.text: OutputText | None = None  # None: the text comes from the instances
        self.ids: list[int] = []  # the output's token ids the client has (or will get with the first token)
        self.context_full = False  # the prompt + first token fill the context: nothing to decode

    @property
    def tokenizer_source(self) -> str | None:
        return self.tokenizer.source if self.tokenizer is not None else None

    def usage(self) -> dict[str, int]:
        return usage(len(self._ctx.prompt_ids), len(self.ids) or 1)

    # ---- the first token -------------------------------------------------------------------------

    def shape_first(self, first: FirstToken) -> FirstToken:
        """The first token as the client sees it: its finish reason (the prefill's ``length`` only means
        max_tokens 1 there), and its text made here when the proxy has the tokenizer and a decode follows.
        Colocated, there is no first token yet: the serving instance generates the whole output.

        A text completion without stop strings keeps the prefiller's text: the same vLLM made it from the
        same prompt ids and params, and with no stop string to hold characters back its finished answer
        equals a stream's first delta (a chat answer's content may be a reasoning or tool parser's). An
        empty text is kept too from a prefiller known to make text with the proxy's tokenizer
        (``Instance.makes_text``): a token that does not end a character has none, while an instance
        without a tokenizer (``--skip-tokenizer-init``) answers "" for every token. The text here then replays the first token
        at its first use, so a prompt whose text ends in U+FFFD (its stream has no prefix to subtract:
        the whole prompt is decoded) is not detokenized before the first byte (as on the streaming side)."""
        ctx = self._ctx
        if ctx.colocated is not None:
            self.ids = []
            if self.tokenizer is not None:
                self.text = self.tokenizer.output_text(ctx.prompt_ids, TextParams.from_body(ctx.req.body))
            return first
        self.ids = [first.token_id]
        if not self.needs_decode_after(first):
            return first  # the prefiller's text and finish are final (it had the whole context)
        limit = self._s.tokenizers.max_model_len
        if limit is not None and len(ctx.prompt_ids) + 1 >= limit:
            self.context_full = True  # vLLM would refuse a decode of max_tokens 0
            return dataclasses.replace(first, finish_reason="length")
        first = dataclasses.replace(first, finish_reason=None, stop_reason=None)
        if self.tokenizer is None:
            return first
        params = TextParams.from_body(ctx.req.body)
        if (first.text or ctx.first_text_final) and not ctx.req.is_chat and not params.stop \
                and not ctx.req.body.get("echo"):
            self.text = self.tokenizer.output_text(ctx.prompt_ids, params, replay=[first.token_id])
            return first
        self.text = self.tokenizer.output_text(ctx.prompt_ids, params)
        step = self.text.update([first.token_id], stop_terminated=False)
        if step.stop_string is not None:
            return dataclasses.replace(first, text=self.text.next_delta(finished=True), finish_reason="stop",
                                       stop_reason=step.stop_string)
        return dataclasses.replace(first, text=self.text.next_delta(finished=False))

    def needs_decode_after(self, first: FirstToken) -> bool:
        req = self._ctx.req
        more_allowed = req.max_tokens is None or req.max_tokens > 1
        return more_allowed and first.finish_reason in (None, "length") and not self.context_full

    # ---- observations ----------------------------------------------------------------------------

    def first_output(self, at_s: float, lease: Lease | None) -> None:
        """The decoding instance sent its first output at ``at_s``, so it has loaded the request's KV:
        its commit stops counting against the buffer credit (the decoder announces the freed slots itself)."""
        ctx, m = self._ctx, self._s.metrics
        ctx.timeline.first_decoded_s = at_s
        if ctx.colocated is not None:
            m.observe_ttft(ctx.req.endpoint.value, at_s - ctx.received_s)
        else:
            m.observe_handover(at_s - ctx.prefill_done_s)
        if lease is not None:
            lease.return_credit()

    def remember(self, lease: Lease | None) -> None:
        """The decoding instance's prefix cache now holds prompt + output: a next turn finds it there."""
        router, ctx = self._s.router, self._ctx
        if not router.uses_prefix or lease is None or not ctx.prompt_ids:
            return
        router.remember(lease.instance, router.prompt_prefix(ctx.prompt_ids + self.ids))

    def observe_reuse(self, kv: KvOutcome | None, lease: Lease | None) -> None:
        reuse, self._ctx.reuse = self._ctx.reuse, None
        if reuse is None:
            return
        if kv is not None and kv.status is KvStatus.READY:
            known = kv.chunks_held > 0 or kv.bytes_received > 0  # a decoder that reports the new fields
            chunk_tokens = lease.instance.chunk_tokens if lease is not None else 0
            held_tokens = min(kv.chunks_held * chunk_tokens, reuse.prompt_tokens)
            ready_tokens = min((kv.chunks + kv.chunks_held) * chunk_tokens, reuse.prompt_tokens)
            reuse = dataclasses.replace(
                reuse, kv_bytes=kv.bytes_received if known else kv.nbytes,
                chunks_held=kv.chunks_held if known else None,
                decoder_hit_tokens=held_tokens if known else None,
                kv_moved_tokens=ready_tokens - held_tokens, decoder_kv_tokens=ready_tokens)
        self._s.metrics.reuse.observe_request(reuse)

    def record_timeline(self) -> None:
        """For a request that prefilled on a prefiller (a colocated one has no phases to show)."""
        ctx = self._ctx
        if ctx.colocated is None and ctx.timeline.prefill_sent_s is not None:
            self._s.metrics.record_timeline(ctx.timeline)


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


def _first_logprobs(logprobs: dict[str, Any] | None, n: int) -> dict[str, Any] | None:
    """Completion-format logprobs of the first ``n`` tokens."""
    if not logprobs:
        return logprobs
    return {k: v[:n] if isinstance(v, list) else v for k, v in logprobs.items()}
