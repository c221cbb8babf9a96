"""The coordinator's side of ``--workers N``: the relay API its workers call (``relay_messages.py``).

The coordinator keeps everything that is one per proxy: the registry, routing, admission credit,
the KV waiters, the control socket, metrics. For a request a worker received, the coordinator
runs the :class:`RequestFlow` as it would in one process (tokenize, route, admit, prefill, wait
for the KV), except the decode stream itself: the worker streams it from the decoder and makes
the client's text, and reports the steps that matter here (first output, a broken stream, the
end). ``open`` answers the first token at once and, on the same answer, where the decode goes once
the KV is ready, so the worker's decode waits for no call of its own. Each open request is held under the worker's handle until the worker closes it, or the
worker dies (then every request it held is closed here: no leaked load). A "closed" whose answer the
worker did not get is sent again (``relay_link.CoordinatorLink.tell``); a second one is ignored here.

The public endpoints (``/health``, ``/metrics``, ``/stats``, ``/instances``...) are served here
too, on the same socket: workers pass them through.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send
from starlette.routing import Route

from lmcache_p2p.proxy.app import ProxyApp, error_name, unless_disconnected
from lmcache_p2p.proxy.errors import ClientDisconnected, ProxyError, UpstreamConnectError, UpstreamUnreachable
from lmcache_p2p.proxy.flow import Orchestrator, RequestFlow
from lmcache_p2p.proxy.relay_messages import (
    PREFIX,
    Count,
    Failed,
    Hello,
    Open,
    Opened,
    PlanFailed,
    Planned,
    Step,
    Target,
    TokenizerSource,
)
from lmcache_p2p.proxy.shaping import Endpoint, parse_client_request

logger = logging.getLogger(__name__)

_CLOSED_REMEMBERED = 4096  # handles closed here lately: an open still running, a "closed" sent again


@dataclasses.dataclass(eq=False)
class _Relayed:
    flow: RequestFlow
    worker: int
    planning: asyncio.Task[Target] | None = None  # the KV wait and choice of decoder after the open


class RelayCoordinator:
    def __init__(self, orchestrator: Orchestrator, app: ProxyApp, chars_per_token: float,
                 on_hello: Callable[[Hello], None]) -> None:
        self._o = orchestrator
        self._app = app
        self._chars_per_token = chars_per_token
        self._on_hello = on_hello
        self._flows: dict[str, _Relayed] = {}
        self._closed: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.opened_by_worker: collections.Counter[int] = collections.Counter()  # requests each worker opened
        self.calls: collections.Counter[str] = collections.Counter()  # the calls taken, per step

    def routes(self) -> list[Route]:
        steps: dict[str, Callable[[Request], Any]] = {
            "open": self._open, "started": self._started, "unreachable": self._unreachable,
            "broken": self._broken, "closed": self._closed_step, "count": self._count,
            "hello": self._hello, "tokenizer": self._tokenizer}
        return [Route(f"{PREFIX}/{name}", self._counted(name, handler), methods=["POST"])
                for name, handler in steps.items()]

    def _counted(self, name: str, handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        async def counted(request: Request) -> Any:
            self.calls[name] += 1
            return await handler(request)

        return counted

    def __len__(self) -> int:
        """Requests open on workers."""
        return len(self._flows)

    def open_on(self, worker: int) -> int:
        """Requests open on worker ``worker``."""
        return sum(relayed.worker == worker for relayed in self._flows.values())

    def forget_worker(self, worker: int) -> None:
        """Worker ``worker`` is gone: close every request it held (its clients' connections went with it)."""
        gone = [handle for handle, relayed in self._flows.items() if relayed.worker == worker]
        for handle in gone:
            self._close(handle, None)
        if gone:
            logger.warning("relay worker %d died holding %d request(s): closed", worker, len(gone))

    def close_all(self) -> None:
        for handle in list(self._flows):
            self._close(handle, None)

    # ---- the steps ---------------------------------------------------------------------------------

    async def _open(self, request: Request) -> Response | _JsonLines:
        msg = msgspec.json.decode(await request.body(), type=Open)
        try:
            req = parse_client_request(Endpoint(msg.endpoint), msgspec.json.decode(msg.body), self._chars_per_token)
        except ProxyError as exc:
            return _failed(exc)
        flow = self._o.open(req, msg.headers, msg.received_s)
        kept = False
        try:
            first = await unless_disconnected(request, flow.prefill(), flow.close)
            if msg.handle in self._closed:
                return Response(status_code=499)
            relayed = self._flows[msg.handle] = _Relayed(flow, msg.worker)
            self.opened_by_worker[msg.worker] += 1
            kept = True
            opened = Opened(
                flow.response_id, first, flow.prompt_ids, flow.needs_decode, flow.decoder_regenerates_first,
                flow.colocated is not None, flow.proxy_text, flow.tokenizer_source,
                self._o.settings.decode_idle_timeout_s)
            return _JsonLines(self._open_answer(msg.handle, relayed, opened))
        except ProxyError as exc:
            return _failed(exc)
        except ClientDisconnected:
            logger.info("relay worker %d gave up %s request %s (client gone)", msg.worker, msg.endpoint,
                        flow.response_id)
            return Response(status_code=499)
        except Exception as exc:  # a bug: still answer, and say where
            logger.exception("%s request %s failed unexpectedly", msg.endpoint, flow.response_id)
            return _failed(ProxyError(f"internal proxy error: {type(exc).__name__}: {exc}"))
        finally:
            if not kept:
                flow.close()

    async def _open_answer(self, handle: str, relayed: _Relayed, opened: Opened) -> AsyncIterator[bytes]:
        """``open``'s answer: the first token at once, then (no call from the worker needed) where the decode
        goes once the KV is ready. A request closed meanwhile stops its KV wait (``_close``)."""
        yield msgspec.json.encode(opened) + b"\n"
        if not opened.needs_decode or self._flows.get(handle) is not relayed:
            return
        task = relayed.planning = asyncio.get_running_loop().create_task(relayed.flow.plan_decode(),
                                                                        name="relay-plan")
        try:
            await asyncio.wait({task})
        finally:
            if not task.done():
                task.cancel()
        if task.cancelled():
            return
        yield msgspec.json.encode(_plan_line(relayed, task)) + b"\n"

    async def _unreachable(self, request: Request) -> Response:
        step, relayed = await self._step(request)
        if relayed is None:
            return _gone(step)
        return _planned(relayed.flow.decode_unreachable(UpstreamConnectError(step.message)))

    async def _broken(self, request: Request) -> Response:
        step, relayed = await self._step(request)
        if relayed is None:
            return _gone(step)
        exc = UpstreamConnectError(step.message) if step.connect_failed else UpstreamUnreachable(step.message)
        return _planned(relayed.flow.decode_broken(step.output_ids, step.finished, exc, step.rewound))

    async def _started(self, request: Request) -> Response:
        step, relayed = await self._step(request)
        if relayed is not None:
            relayed.flow.decode_started(step.decode_sent_s, step.first_decoded_s)
        return Response(status_code=204)

    async def _closed_step(self, request: Request) -> Response:
        """The request is over: its counts, then close it. A worker that lost the answer sends "closed" again
        (``relay_link.CLOSED_ATTEMPTS``); one for a handle closed here already is ignored, so the
        counts of a first send that did arrive are not applied twice."""
        step = msgspec.json.decode(await request.body(), type=Step)
        if step.handle in self._closed:
            return Response(status_code=204)
        relayed = self._flows.get(step.handle)
        if relayed is not None:
            _note_first_byte(relayed.flow, step)
        for count in step.counts:
            self._apply_count(count)
        self._close(step.handle, step.output_ids)
        return Response(status_code=204)

    async def _count(self, request: Request) -> Response:
        self._apply_count(msgspec.json.decode(await request.body(), type=Count))
        return Response(status_code=204)

    def _apply_count(self, count: Count) -> None:
        endpoint = Endpoint(count.endpoint)
        metrics = self._o.metrics
        if count.status is not None:
            metrics.requests.labels(endpoint.value, str(count.status)).inc()
        if count.error is not None:
            metrics.errors.labels(endpoint.value, count.error).inc()

    async def _tokenizer(self, request: Request) -> Response:
        tokenizers = self._o.tokenizers
        return _answer(TokenizerSource(tokenizers.settled, tokenizers.loaded_source))

    async def _hello(self, request: Request) -> Response:
        self._on_hello(msgspec.json.decode(await request.body(), type=Hello))
        return Response(status_code=204)

    # ---- helpers -----------------------------------------------------------------------------------

    async def _step(self, request: Request) -> tuple[Step, _Relayed | None]:
        step = msgspec.json.decode(await request.body(), type=Step)
        return step, self._flows.get(step.handle)

    def _close(self, handle: str, output_ids: list[int] | None) -> None:
        self._closed[handle] = None  # an open still running answers 499 and closes; a "closed" again is ignored
        while len(self._closed) > _CLOSED_REMEMBERED:
            self._closed.popitem(last=False)
        relayed = self._flows.pop(handle, None)
        if relayed is None:
            return
        if relayed.planning is not None and not relayed.planning.done():
            relayed.planning.cancel()  # its KV wait: the request is over
        if output_ids is not None:
            relayed.flow.decode_ended(output_ids)  # as one process: close() remembers the output so far
        relayed.flow.close()


class _JsonLines:
    """A chunked answer of JSON lines, each sent as it comes. Unlike Starlette's StreamingResponse it does
    not watch for a disconnect in a second task (a task group per request): a worker always closes its
    requests (``closed``), and a dead worker's are closed by ``forget_worker``; both stop the lines."""

    def __init__(self, lines: AsyncIterator[bytes]) -> None:
        self._lines = lines

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/jsonl")]})
        async for line in self._lines:
            await send({"type": "http.response.body", "body": line, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _note_first_byte(flow: RequestFlow, step: Step) -> None:
    if step.first_byte_s is not None and flow.timeline.first_byte_s is None:
        flow.timeline.first_byte_s = step.first_byte_s


def _plan_line(relayed: _Relayed, task: asyncio.Task[Target]) -> Planned | PlanFailed:
    exc = task.exception()
    if exc is None:
        return Planned(task.result())
    if not isinstance(exc, ProxyError):  # a bug: still answer, and say where
        logger.error("request %s: planning its decode failed unexpectedly", relayed.flow.response_id, exc_info=exc)
        exc = ProxyError(f"internal proxy error: {type(exc).__name__}: {exc}")
    return PlanFailed(exc.status_code, Failed(error_name(exc), exc.to_body()))


def _answer(msg: msgspec.Struct, status: int = 200) -> Response:
    return Response(msgspec.json.encode(msg), status_code=status, media_type="application/json")


def _planned(target: Target | None) -> Response:
    return _answer(Planned(target))


def _failed(exc: ProxyError) -> Response:
    return _answer(Failed(error_name(exc), exc.to_body()), status=exc.status_code)


def _gone(step: Step) -> Response:
    return _failed(ProxyError(f"request {step.handle} is not open on the coordinator (closed, or its worker was "
                              "declared dead)"))
