"""The coordinator's side of ``--workers N``: the relay API its workers call (``relay/messages.py``).

The coordinator keeps everything that is one per proxy: the registry, routing, admission credit,
the KV waiters, the control socket, metrics, and the open requests (``relay/host.py``: the same
steps one process's own requests take, as calls of their ``RequestFlow``). This module is their HTTP side:
it decodes a worker's step, calls the host, and answers (an error as a ``Failed`` body). ``open``
answers the first token at once and, on the same answer, where the decode goes once the KV is
ready, so the worker's decode waits for no call of its own. A dead worker's requests are closed
(``forget_worker``: no leaked load). A "closed" whose answer the worker did not get is sent again
(``relay/link.py``, ``CoordinatorLink.tell``); a second one is ignored by the host.

The public endpoints (``/health``, ``/metrics``, ``/stats``, ``/instances``...) are served here
too, on the same socket: workers pass them through.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from lmcache_p2p.proxy.app import error_name, unless_disconnected
from lmcache_p2p.proxy.errors import ClientDisconnected, ProxyError
from lmcache_p2p.proxy.flow.flow import Orchestrator
from lmcache_p2p.proxy.relay.host import FlowHost
from lmcache_p2p.proxy.relay.messages import (
    PREFIX,
    Count,
    Failed,
    Hello,
    Open,
    Opened,
    PlanFailed,
    Planned,
    Step,
    TokenizerSource,
)
from lmcache_p2p.proxy.http.shaping import Endpoint, parse_client_request

logger = logging.getLogger(__name__)


class RelayCoordinator:
    def __init__(self, host: FlowHost, orchestrator: Orchestrator, chars_per_token: float,
                 on_hello: Callable[[Hello], None]) -> None:
        self._host = host
        self._o = orchestrator
        self._chars_per_token = chars_per_token
        self._on_hello = on_hello
        self.calls: collections.Counter[str] = collections.Counter()  # the calls taken, per step

    @property
    def opened_by_worker(self) -> collections.Counter[int]:
        """Requests each worker opened."""
        return self._host.opened_by_worker

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
        """Requests open (on workers)."""
        return len(self._host)

    def open_on(self, worker: int) -> int:
        """Requests open on worker ``worker``."""
        return self._host.open_on(worker)

    def forget_worker(self, worker: int) -> None:
        """Worker ``worker`` is gone: close every request it held (its clients' connections went with it)."""
        self._host.forget_worker(worker)

    def close_all(self) -> None:
        self._host.close_all()

    # ---- the steps ---------------------------------------------------------------------------------

    async def _open(self, request: Request) -> Response | _JsonLines:
        msg = msgspec.json.decode(await request.body(), type=Open)
        try:
            req = parse_client_request(Endpoint(msg.endpoint), msgspec.json.decode(msg.body), self._chars_per_token)
            opened = await unless_disconnected(
                request, self._host.open(msg.handle, msg.worker, req, msg.headers, msg.received_s), _nothing)
        except ProxyError as exc:
            return _failed(exc)
        except ClientDisconnected:
            logger.info("relay worker %d gave up a %s request (client gone)", msg.worker, msg.endpoint)
            return Response(status_code=499)
        except Exception as exc:  # a bug: still answer, and say where
            logger.exception("%s request of worker %d failed unexpectedly", msg.endpoint, msg.worker)
            return _failed(ProxyError(f"internal proxy error: {type(exc).__name__}: {exc}"))
        return _JsonLines(self._open_answer(msg.handle, opened))

    async def _open_answer(self, handle: str, opened: Opened) -> AsyncIterator[bytes]:
        """``open``'s answer: the first token at once, then (no call from the worker needed) where the decode
        goes once the KV is ready, and after a target sent before it (``--early-decode``) the KV's outcome. A
        request closed meanwhile stops its KV wait (``FlowHost.closed``)."""
        yield msgspec.json.encode(opened) + b"\n"
        if not opened.needs_decode:
            return
        try:
            target = await self._host.plan(handle)
        except Exception as exc:
            yield msgspec.json.encode(_plan_failed(opened, exc)) + b"\n"
            return
        if target is None:
            return
        yield msgspec.json.encode(Planned(target)) + b"\n"
        if target.kv_pending:  # sent before its KV was ready: what came first decides where it goes
            try:
                settled = await self._host.settled(handle)
            except Exception as exc:
                yield msgspec.json.encode(_plan_failed(opened, exc)) + b"\n"
                return
            if settled is not None:
                yield msgspec.json.encode(settled) + b"\n"

    async def _unreachable(self, request: Request) -> Response:
        return await self._target_step(self._host.unreachable(await self._step(request)))

    async def _broken(self, request: Request) -> Response:
        return await self._target_step(self._host.broken(await self._step(request)))

    async def _started(self, request: Request) -> Response:
        self._host.started(await self._step(request))
        return Response(status_code=204)

    async def _closed_step(self, request: Request) -> Response:
        self._host.closed(await self._step(request))
        return Response(status_code=204)

    async def _count(self, request: Request) -> Response:
        self._host.count(msgspec.json.decode(await request.body(), type=Count))
        return Response(status_code=204)

    async def _tokenizer(self, request: Request) -> Response:
        tokenizers = self._o.tokenizers
        return _answer(TokenizerSource(tokenizers.settled, tokenizers.loaded_source))

    async def _hello(self, request: Request) -> Response:
        self._on_hello(msgspec.json.decode(await request.body(), type=Hello))
        return Response(status_code=204)

    # ---- helpers -----------------------------------------------------------------------------------

    async def _step(self, request: Request) -> Step:
        return msgspec.json.decode(await request.body(), type=Step)

    async def _target_step(self, planned: Awaitable[Planned]) -> Response:
        try:
            return _answer(await planned)
        except ProxyError as exc:
            return _failed(exc)


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


def _nothing() -> None:
    """A late-ending open closes its flow itself (``FlowHost.open``)."""


def _plan_failed(opened: Opened, exc: Exception) -> PlanFailed:
    if not isinstance(exc, ProxyError):  # a bug: still answer, and say where
        logger.error("request %s: planning its decode failed unexpectedly", opened.response_id, exc_info=exc)
        exc = ProxyError(f"internal proxy error: {type(exc).__name__}: {exc}")
    return PlanFailed(exc.status_code, Failed(error_name(exc), exc.to_body()))


def _answer(msg: msgspec.Struct, status: int = 200) -> Response:
    return Response(msgspec.json.encode(msg), status_code=status, media_type="application/json")


def _failed(exc: ProxyError) -> Response:
    return _answer(Failed(error_name(exc), exc.to_body()), status=exc.status_code)
