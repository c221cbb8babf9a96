"""One request's decode, in the process that serves the client: the decode stream from the instance
the request's owner names, the client's text, and migration when a stream breaks.

    target = plan()                         the KV wait is over: where the first decode goes
    stream from target ----------------->   started(): the first output (the KV is loaded)
      refused connection -> unreachable()   nothing was sent: another decoder recomputes
      broken / silent / 5xx -> broken()     continue after the output so far, elsewhere
    the output ends (finish, a stop string, or the context is full)

A target sent before its KV was ready (``Target.kv_pending``, ``--early-decode``) races its connection and
first output against ``settled()``, the KV's outcome: an output that comes first is reported (``started``) and
held until ``settled()`` answers; a target it names instead (the KV failed first) closes this stream, drops
what it sent and goes on there; a refused or broken stream waits for that answer before its own step. While
``settled()`` is pending no other step is called, so the owner decides each of these once.

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
from lmcache_p2p.proxy.http.responses import Delta, decode_delta, held_back
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
        # a decode on the decoder's chat endpoint (it renders the answer): the usage it reported, and whether the
        # client has output of it
        self.rendered_usage: dict[str, Any] | None = None
        self._rendered_output = False

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
                if not migratable(exc) or self.finished or self._rendered_output:
                    raise  # a rendered answer's parsers cannot go on elsewhere (its ids may be hidden: this side knows)
                replay = self._held.replay()
                moved = await self._steps.broken(list(self.output_ids), self.finished, replay.rewound, exc)
                if moved is None:
                    raise
                target, self._replay = moved, replay

    async def _stream(self, target: Target) -> AsyncIterator[Delta]:
        """One decode stream; a refused connection goes where the steps say, and so does an early decode whose
        KV failed before its first output."""
        while True:
            try:
                opened = await (self._open_early(target) if target.kv_pending else self._open(target))
            except UpstreamConnectError as exc:
                moved = await self._steps.unreachable(exc)
                if moved is None:
                    raise
                target = moved
                continue
            if isinstance(opened, Target):  # the early decode's KV failed first: its stream was closed
                target = opened
                continue
            rendered = target.path == Endpoint.CHAT.value
            async with opened.stack:
                async for event in opened.events():
                    if not self._started:
                        self._report_first(opened.first_s or self._clock(), target.kv_pending)
                    if rendered and isinstance(event.get("usage"), dict):
                        self.rendered_usage = dict(event["usage"])
                    delta = self._take(decode_delta(event))
                    if delta is None:
                        continue
                    self._rendered_output |= rendered and not held_back(delta, self._req.return_token_ids)
                    yield delta
                    if self.finished and not rendered:
                        return  # a stop string the proxy found: closing the stream aborts the decoder's request
                    # a rendered answer is read to its end: the decoder's usage follows its last chunk
            return

    async def _open(self, target: Target, read_first: bool = False) -> _Opened:
        """The decode request, to its response headers (and its first event when ``read_first``). A decode that pulls
        its KV first must have its headers and first event within ``target.first_output_timeout_s``: a decoder
        whose pull stalls may hold either."""
        timeout_s = target.first_output_timeout_s
        if timeout_s is None:
            return await self._open_now(target, read_first)
        try:
            return await asyncio.wait_for(self._open_now(target, read_first=True), timeout_s)
        except TimeoutError:
            raise UpstreamTimeout(f"POST {target.url}: no output within {timeout_s:.1f} s: its KV pull did not "
                                  "complete (--kv-timeout-s)") from None

    async def _open_now(self, target: Target, read_first: bool) -> _Opened:
        stack = contextlib.AsyncExitStack()
        try:
            if self._decode_sent_s is None:
                self._decode_sent_s = self._clock()
            events = await stack.enter_async_context(self._upstream.stream_events(
                target.url, target.path, target.body, idle_timeout_s=self._idle_timeout_s,
                headers=with_request_id(self._headers, target.request_id)))
            if self._decode_accepted_s is None:
                self._decode_accepted_s = self._clock()
            if self._text is not None:
                self._text.prime()  # while the decoder loads the KV (O(prompt) for some prompts)
            opened = _Opened(stack, events)
            if read_first:
                opened.first = await anext(events, None)
                opened.first_s = self._clock()
            return opened
        except BaseException:
            await stack.aclose()
            raise

    async def _open_early(self, target: Target) -> _Opened | Target:
        """A ``kv_pending`` target, opened while its KV's outcome comes (``settled``): the stream with its first
        event held, or the target the steps name instead (this one's stream closed); raises the stream's error
        once the KV's outcome let the decode go on."""
        settled = asyncio.ensure_future(self._steps.settled())
        opening = asyncio.ensure_future(self._open(target, read_first=True))
        keep = False
        try:
            done, _ = await asyncio.wait({settled, opening}, return_when=asyncio.FIRST_COMPLETED)
            if settled not in done:
                opened = _opened(opening)
                if opened is not None and opened.first is not None and opened.first_s is not None:
                    self._report_first(opened.first_s, kv_pending=True)  # the owner decides what came first
                await asyncio.wait({settled})  # bounded: the KV wait's deadline, or the output just reported
            moved = settled.result()
            if moved is not None:
                self._started = False  # that output was not the request's: the next stream's first is
                return moved
            keep = True
            return await opening
        finally:
            if not settled.done():
                settled.cancel()
            if not keep:
                await _discard(opening)

    def _report_first(self, first_s: float, kv_pending: bool) -> None:
        self._started = True
        sent_s = first_s if self._decode_sent_s is None else self._decode_sent_s
        self._steps.started(sent_s, first_s, self._decode_accepted_s, kv_pending)

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


class _Opened:
    """A decode stream to its response headers: what closes it and its events (the first maybe read already)."""

    def __init__(self, stack: contextlib.AsyncExitStack, events: AsyncIterator[dict[str, Any]]) -> None:
        self.stack = stack
        self._events = events
        self.first: dict[str, Any] | None = None  # read by ``_open_early``, not yet taken
        self.first_s: float | None = None  # when it was read

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        first, self.first = self.first, None
        if first is not None:
            yield first
        async for event in self._events:
            yield event


def _opened(task: asyncio.Future[_Opened]) -> _Opened | None:
    """A finished open's stream (None: it failed, its error stays in the task)."""
    return task.result() if not task.cancelled() and task.exception() is None else None


async def _discard(task: asyncio.Future[_Opened]) -> None:
    """An open whose decode is given up: cancelled, or its stream closed (vLLM aborts the request)."""
    if not task.done():
        task.cancel()
        await asyncio.wait({task})  # it closes what it opened as it ends
    opened = _opened(task)
    if opened is not None:
        await opened.stack.aclose()


def migratable(exc: UpstreamError) -> bool:
    """A broken, silent or failing (5xx) decode stream; a 4xx is the request's own fault."""
    return isinstance(exc, (UpstreamUnreachable, UpstreamTimeout)) or (
        isinstance(exc, UpstreamStatus) and exc.status_code >= 500)


def context_full(exc: UpstreamError) -> bool:
    """vLLM's refusal of a decode whose prompt fills the context (max_tokens computed as 0)."""
    return (isinstance(exc, UpstreamStatus) and exc.status_code == 400
            and "max_tokens must be at least 1, got 0" in str(exc))
