"""One request's decode, in the process that serves the client: the decode stream from the instance
the request's owner names, the client's text, and migration when a stream breaks.

    target = plan()                         the KV wait is over: where the first decode goes
    stream from target ----------------->   started(): the first output (the KV is loaded)
      refused connection -> unreachable()   nothing was sent: another decoder recomputes
      broken / silent / 5xx -> broken()     continue after the output so far, elsewhere
    the output ends (finish, a stop string, or the context is full)

The steps are the request's step API (``flow/steps.py``): the request's ``RequestFlow`` itself in this
process, or the coordinator of ``--workers N`` through ``relay/link.py``. So the decode and migration
loop exists once, here. It owns the stream, the output ids the client has and its text
(``shape_delta``, ``http/held_text.py``). It must not choose instances, wait for the KV or account
load: those are the steps' owner's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from lmcache_p2p.proxy.http.detokenize import OutputText
from lmcache_p2p.proxy.errors import UpstreamConnectError, UpstreamError, UpstreamStatus, UpstreamTimeout, \
    UpstreamUnreachable
from lmcache_p2p.proxy.http.held_text import HeldText, Replay
from lmcache_p2p.proxy.flow.output import end_of_context, shape_delta
from lmcache_p2p.proxy.flow.steps import RequestSteps, Target
from lmcache_p2p.proxy.http.responses import Delta, decode_delta
from lmcache_p2p.proxy.http.shaping import ClientRequest, Endpoint
from lmcache_p2p.proxy.upstream import Upstream, with_request_id


class DecodeSession:
    def __init__(self, steps: RequestSteps, upstream: Upstream, req: ClientRequest, headers: Mapping[str, str],
                 idle_timeout_s: float, text: OutputText | None, output_ids: list[int],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._steps = steps
        self._upstream = upstream
        self._req = req
        self._headers = headers
        self._idle_timeout_s = idle_timeout_s
        self._text = text
        self.output_ids = output_ids  # the output's ids the client has: filled in place as it streams
        self._clock = clock
        self.finished = False
        self._held = HeldText.for_request(req, proxy_text=text is not None)
        self._replay = Replay((), "")  # what of the current stream's first output the client already has
        self._decode_sent_s: float | None = None
        self._decode_accepted_s: float | None = None
        self._started = False

    async def deltas(self, regenerates_first: bool, first_text: str) -> AsyncIterator[Delta]:
        """The output after the first token (all of it when ``regenerates_first``); a stream that breaks
        continues where the steps say."""
        target = await self._steps.plan()
        if regenerates_first:
            self.output_ids.clear()
        else:
            self._held.observe(Delta(first_text, list(self.output_ids), None, None, None))
        if target.replays:  # the decoder generates the first token again (its prompt is the prefill's)
            self._replay = Replay(self.output_ids[-target.replays:], first_text if self._text is None else None)
        while True:
            try:
                async for delta in self._stream(target):
                    yield delta
                return
            except UpstreamError as exc:
                if context_full(exc):
                    self.finished = True
                    yield end_of_context(self._text)
                    return
                if not migratable(exc) or self.finished:
                    raise
                replay = self._held.replay()
                moved = await self._steps.broken(list(self.output_ids), self.finished, replay.rewound, exc)
                if moved is None:
                    raise
                target, self._replay = moved, replay

    async def _stream(self, target: Target) -> AsyncIterator[Delta]:
        """One decode stream; a refused connection goes where the steps say."""
        async with contextlib.AsyncExitStack() as stack:
            while True:
                if self._decode_sent_s is None:
                    self._decode_sent_s = self._clock()
                try:
                    events = await stack.enter_async_context(self._upstream.stream_events(
                        target.url, Endpoint.COMPLETIONS.value, target.body, idle_timeout_s=self._idle_timeout_s,
                        headers=with_request_id(self._headers, target.request_id)))
                    if self._decode_accepted_s is None:
                        self._decode_accepted_s = self._clock()
                    if self._text is not None:
                        self._text.prime()  # while the decoder loads the KV (O(prompt) for some prompts)
                    break
                except UpstreamConnectError as exc:
                    moved = await self._steps.unreachable(exc)
                    if moved is None:
                        raise
                    target = moved
            async for event in _first_within(events, target):
                if not self._started:
                    self._started = True
                    self._steps.started(self._decode_sent_s, self._clock(), self._decode_accepted_s)
                delta = self._take(decode_delta(event))
                if delta is None:
                    continue
                yield delta
                if self.finished:
                    return  # a stop string the proxy found: closing the stream aborts the decoder's request

    def _take(self, raw: Delta | None) -> Delta | None:
        """The client's delta of one decode event (None: nothing for the client)."""
        if raw is None:
            return None
        raw = self._replay.filter(raw)
        if raw is None:
            return None
        delta = shape_delta(self._text, raw)
        self._held.observe(delta)
        self.output_ids.extend(delta.token_ids)
        self.finished = delta.finish_reason is not None
        return delta


async def _first_within(events: AsyncIterator[dict[str, Any]], target: Target) -> AsyncIterator[dict[str, Any]]:
    """``events``, the first within ``target.first_output_timeout_s`` (when it has one)."""
    timeout_s = target.first_output_timeout_s
    if timeout_s is not None:
        try:
            yield await asyncio.wait_for(anext(events), timeout_s)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise UpstreamTimeout(f"POST {target.url}: no output within {timeout_s:.1f} s: its KV pull did not "
                                  "complete (--kv-timeout-s)") from None
    async for event in events:
        yield event


def migratable(exc: UpstreamError) -> bool:
    """A broken, silent or failing (5xx) decode stream; a 4xx is the request's own fault."""
    return isinstance(exc, (UpstreamUnreachable, UpstreamTimeout)) or (
        isinstance(exc, UpstreamStatus) and exc.status_code >= 500)


def context_full(exc: UpstreamError) -> bool:
    """vLLM's refusal of a decode whose prompt fills the context (max_tokens computed as 0)."""
    return (isinstance(exc, UpstreamStatus) and exc.status_code == 400
            and "max_tokens must be at least 1, got 0" in str(exc))
