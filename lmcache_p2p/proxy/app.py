"""The proxy's HTTP endpoints (Starlette).

    POST /v1/completions, /v1/chat/completions   disaggregated generation, streamed (SSE) or not
    GET  /v1/models                              from the first healthy decoder (else prefiller)
    GET  /health                                 200 while the proxy runs; counts routable instances
    GET  /instances                              routable instances (?all=1: every registered one)   [admin]
    POST /instances/drain                        {"instance_id"}: no new work; forgotten once idle   [admin]
    POST /instances/register                     {"role", "url", "backend", "ttl_s"?}: an instance that cannot
                                                 announce itself (vLLM's NixlConnector: backend "vllm-nixl");
                                                 with ttl_s it expires unless registered again within it [admin]
    GET  /metrics                                Prometheus
    GET  /stats                                  TTFT / handover / kv_wait count, mean, p50, p99 (ms) since
                                                 start or the last reset, per-phase timeline_ms and the
                                                 last requests' phases (recent; see observe/timeline.py); read-only
    POST /stats/reset                            start a new stats window; answers the one that ended [admin]

[admin]: with a shared secret (``--shared-secret``) these need ``Authorization: Bearer <secret>``
(compared in constant time): 401 without the header, 403 with a wrong one. They show the
registry's internals (control addresses) or change it.

A stream's decode (KV wait, decode request, the decoder's first output) starts as soon as the
prefill answered, while the first token is written to the client (``EarlyDecode``): a slow client
delays its own later output only, never the handover.

Errors are OpenAI-style JSON (``errors.py``). Once a stream has started (after the first token),
a later failure is sent in the stream as ``data: {"error": ...}`` followed by ``data: [DONE]``.
A client that disconnects cancels the request's upstream calls and drops its KV waiter.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from lmcache_p2p.config import Role
from lmcache_p2p.errors import ConfigError
from lmcache_p2p.proxy.flow.client import ClientFlow
from lmcache_p2p.proxy.errors import BadRequest, ClientDisconnected, NoInstanceAvailable, ProxyError
from lmcache_p2p.proxy.flow.flow import Orchestrator
from lmcache_p2p.proxy.router.registry import Instance
from lmcache_p2p.proxy.flow.steps import Count, RequestOwner
from lmcache_p2p.proxy.http.responses import SSE_DONE, Delta, Renderer, renderer_for, sse
from lmcache_p2p.proxy.http.shaping import ClientRequest, Endpoint, parse_client_request
from lmcache_p2p.proxy.settings import registration, registration_ttl
from lmcache_p2p.proxy.upstream import Upstream, forwarded_headers

logger = logging.getLogger(__name__)

T = TypeVar("T")
_CANCEL_WAIT_S = 2.0
_current: contextvars.ContextVar[ClientFlow | None] = contextvars.ContextVar("proxy_flow", default=None)


class ProxyApp:
    """The endpoints; a generation request runs as a :class:`ClientFlow` whose steps ``owner`` opens (this
    process's orchestrator, or a relay worker's coordinator link), so both serve it on one path.
    ``orchestrator``: for the other endpoints (a relay worker has none: it passes them through)."""

    def __init__(self, orchestrator: Orchestrator | None, owner: RequestOwner, upstream: Upstream,
                 chars_per_token: float,
                 models_timeout_s: float, admin_secret: str | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._o = orchestrator  # type: ignore[assignment]
        self.owner = owner
        self.upstream = upstream
        self._clock = clock
        self._chars_per_token = chars_per_token
        self._models_timeout_s = models_timeout_s
        self._admin_token = f"Bearer {admin_secret}".encode() if admin_secret else None

    def build(self) -> Starlette:
        return Starlette(routes=[
            Route(Endpoint.COMPLETIONS.value, self.completions, methods=["POST"]),
            Route(Endpoint.CHAT.value, self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/instances", self._admin(self.instances), methods=["GET"]),
            Route("/instances/drain", self._admin(self.drain), methods=["POST"]),
            Route("/instances/register", self._admin(self.register), methods=["POST"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/stats", self.stats, methods=["GET"]),
            Route("/stats/reset", self._admin(self.reset_stats), methods=["POST"]),
        ])

    def _admin(self, handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """``handler`` behind the admin secret (open when the proxy has none: loopback or --insecure)."""

        @functools.wraps(handler)
        async def guarded(request: Request) -> Response:
            if self._admin_token is None:
                return await handler(request)
            given = request.headers.get("authorization")
            if given is None:
                return _auth_error(401, f"{request.url.path} is an admin endpoint: send 'Authorization: Bearer "
                                        "<secret>' with the proxy's --shared-secret")
            if not hmac.compare_digest(given.encode(), self._admin_token):
                logger.warning("admin call %s %s from %s refused: wrong secret", request.method, request.url.path,
                               request.client.host if request.client else "?")
                return _auth_error(403, f"{request.url.path}: wrong admin secret (the proxy's --shared-secret)")
            return await handler(request)

        return guarded

    # ---- generation ------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, Endpoint.COMPLETIONS)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, Endpoint.CHAT)

    async def _generate(self, request: Request, endpoint: Endpoint) -> Response:
        received_s = self._clock()
        _current.set(None)
        try:
            req = parse_client_request(endpoint, await _read_json(request), self._chars_per_token)
        except ProxyError as exc:
            return self._error(endpoint, exc)
        flow = ClientFlow(self.owner, self.upstream, req, forwarded_headers(request.headers), received_s, self._clock)
        _current.set(flow)
        response = await self._answer(request, flow)
        if not isinstance(response, StreamingResponse):
            await flow.closing()  # the answer goes out once the request is closed (its load released)
        return response

    async def _answer(self, request: Request, flow: ClientFlow) -> Response:
        req, endpoint = flow.req, flow.req.endpoint
        streaming = False
        try:
            first = await unless_disconnected(request, flow.prefill(), flow.close)
            renderer = renderer_for(req, _response_id(req, flow), first, flow.prompt_ids,
                                    include_first=not flow.decoder_regenerates_first)
            if req.stream:
                streaming = True
                self._count(endpoint, 200)
                decode = EarlyDecode(flow.decode()) if flow.needs_decode else None  # before the first byte
                return _FlowStreamingResponse(flow, self._stream(flow, renderer, decode), decode)
            answer = await unless_disconnected(request, _collect(flow, renderer), flow.close)
            self._count(endpoint, 200)
            return Response(msgspec.json.encode(answer), media_type="application/json")
        except ProxyError as exc:
            return self._error(endpoint, exc)
        except ClientDisconnected:
            logger.info("client disconnected from %s request %s: upstream work cancelled", endpoint.value,
                        flow.response_id)
            self._count(endpoint, 499)
            return Response(status_code=499)
        except Exception as exc:  # a bug: still answer in the API's shape, and say where
            logger.exception("%s request %s failed unexpectedly", endpoint.value, flow.response_id)
            return self._error(endpoint, ProxyError(f"internal proxy error: {type(exc).__name__}: {exc}"))
        finally:
            if not streaming:
                flow.close()

    async def _stream(self, flow: ClientFlow, renderer: Renderer, decode: EarlyDecode | None
                      ) -> AsyncIterator[bytes]:
        """The client's events; ``decode`` (started before the first byte) gives the output after the first token."""
        req = flow.req
        try:
            for chunk in renderer.first_chunks():
                yield sse(chunk)
            flow.first_byte_written()  # resumed: the server has handed the first token to the client
            if decode is not None:
                async for delta in decode:
                    chunk = renderer.delta_chunk(delta)
                    if chunk is not None:
                        yield sse(chunk)
            if req.include_usage:
                yield sse(renderer.usage_chunk(flow.usage()))
        except Exception as exc:  # after the first token the status is sent: report in the stream
            error = exc if isinstance(exc, ProxyError) else ProxyError(f"internal proxy error: {exc!r}")
            self._count_error(req.endpoint, error_name(error))
            logger.warning("%s request %s failed mid-stream: %s", req.endpoint.value, flow.response_id, exc,
                           exc_info=not isinstance(exc, ProxyError))
            yield sse(error.to_body())
        await flow.end()  # the request is closed before the client's [DONE]: its next turn may follow at once
        yield SSE_DONE

    # ---- other endpoints -------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        registry = self._o.registry
        last: ProxyError = NoInstanceAvailable("no decoder or prefiller registered to list models from")
        for inst in registry.routable(Role.RECEIVER) + registry.routable(Role.SENDER):
            try:
                return JSONResponse(await self._o.upstream.get_json(inst.http_url, "/v1/models",
                                                                    timeout_s=self._models_timeout_s))
            except ProxyError as exc:
                last = exc
        return JSONResponse(last.to_body(), status_code=503 if last.status_code >= 500 else last.status_code)

    async def health(self, request: Request) -> Response:
        registry = self._o.registry
        prefillers, decoders = len(registry.routable(Role.SENDER)), len(registry.routable(Role.RECEIVER))
        # ready: some instance can serve (one alone serves requests colocated, see router/routing.py)
        return JSONResponse({"status": "ok", "ready": bool(prefillers or decoders), "prefillers": prefillers,
                             "decoders": decoders})

    async def instances(self, request: Request) -> Response:
        registry = self._o.registry
        if request.query_params.get("all", "").lower() in ("1", "true", "yes"):
            listed = registry.instances()
        else:
            listed = registry.routable(Role.SENDER) + registry.routable(Role.RECEIVER)
        return JSONResponse([_describe(inst) for inst in listed])

    async def drain(self, request: Request) -> Response:
        """Take an instance out of rotation: ``{"instance_id": ...}``; in-flight work finishes."""
        try:
            body = await request.json()
            instance_id = body["instance_id"]
        except (ValueError, KeyError, TypeError):
            return JSONResponse({"error": {"message": 'body must be {"instance_id": "<id from GET /instances>"}',
                                           "type": "invalid_request_error", "code": 400}}, status_code=400)
        inst = self._o.registry.drain(str(instance_id))
        if inst is None:
            return JSONResponse({"error": {"message": f"no instance {instance_id!r} is registered",
                                           "type": "not_found_error", "code": 404}}, status_code=404)
        return JSONResponse(_describe(inst))

    async def register(self, request: Request) -> Response:
        """Register an instance by URL: ``{"role": "prefiller"|"decoder", "url": ..., "backend": "vllm-nixl",
        "ttl_s": 30}``. It takes traffic once its ``GET /health`` answers 200. With ``ttl_s`` (seconds) it expires
        unless registered again within that time (``Registry.register``); without, it stays until drained.
        Registering it again refreshes it (and sets its ``ttl_s``)."""
        try:
            body = await request.json()
            spec = registration(str(body["role"]), str(body["url"]), str(body.get("backend", "vllm-nixl")))
            ttl_s = registration_ttl(body.get("ttl_s"))
        except (ValueError, KeyError, TypeError, ConfigError) as exc:
            detail = str(exc) if isinstance(exc, ConfigError) else "body must be a JSON object"
            return JSONResponse({"error": {"message": f'{detail}: send {{"role": "prefiller" or "decoder", "url": '
                                                      f'"http://host:port", "backend": "vllm-nixl"}} and optionally '
                                                      f'"ttl_s": <seconds>',
                                           "type": "invalid_request_error", "code": 400}}, status_code=400)
        return JSONResponse(_describe(self._o.registry.register(spec, ttl_s)))

    async def metrics(self, request: Request) -> Response:
        body, content_type = self._o.metrics.render()
        return Response(body, media_type=content_type)

    async def stats(self, request: Request) -> Response:
        return JSONResponse(self._o.metrics.stats())

    async def reset_stats(self, request: Request) -> Response:
        return JSONResponse(self._o.metrics.reset_stats())

    # ---- helpers ---------------------------------------------------------------------------------

    def _error(self, endpoint: Endpoint, exc: ProxyError) -> Response:
        level = logging.WARNING if exc.status_code >= 500 else logging.INFO
        logger.log(level, "%s answered %d: %s", endpoint.value, exc.status_code, exc)
        self._count(endpoint, exc.status_code)
        self._count_error(endpoint, error_name(exc))
        return JSONResponse(exc.to_body(), status_code=exc.status_code)

    def _count(self, endpoint: Endpoint, status: int) -> None:
        self._tell_count(Count(endpoint.value, status=status))

    def _count_error(self, endpoint: Endpoint, name: str) -> None:
        self._tell_count(Count(endpoint.value, error=name))

    def _tell_count(self, count: Count) -> None:
        flow = _current.get()
        if flow is not None:
            flow.add_count(count)  # with its "closed"
        else:
            self.owner.count(count)


class EarlyDecode:
    """A flow's decode (its ``decode()`` iterator), started now: the KV wait, the decode request and the
    decoder's first output run in a task while the first token is written to the client, so nothing
    on the handover waits for the client (a slow client holds back the later output alone: one delta
    is read ahead, the rest as the client takes them). Iterate it once; ``cancel`` never awaits."""

    def __init__(self, deltas: AsyncIterator[Delta]) -> None:
        self._deltas = deltas
        self._ahead: asyncio.Task[Delta | None] | None = asyncio.get_running_loop().create_task(
            self._next(), name="proxy-early-decode")

    async def _next(self) -> Delta | None:
        try:
            return await self._deltas.__anext__()
        except StopAsyncIteration:
            return None

    def __aiter__(self) -> EarlyDecode:
        return self

    async def __anext__(self) -> Delta:
        ahead, self._ahead = self._ahead, None
        delta = await ahead if ahead is not None else await self._next()
        if delta is None:
            raise StopAsyncIteration
        return delta

    def cancel(self) -> None:
        """The stream ended before its output was read (client gone): stop the decode's first step."""
        if self._ahead is not None and not self._ahead.done():
            self._ahead.cancel()
        elif self._ahead is not None and not self._ahead.cancelled() and self._ahead.exception() is not None:
            logger.debug("the early decode failed before the stream read it: %r", self._ahead.exception())


class _FlowStreamingResponse(StreamingResponse):
    """Closes the flow however the stream ends, even if it never started (early disconnect)."""

    def __init__(self, flow: ClientFlow, content: AsyncIterator[bytes], decode: EarlyDecode | None) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        self._flow = flow
        self._decode = decode

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._decode is not None:
                self._decode.cancel()
            self._flow.close()


async def _collect(flow: Any, renderer: Renderer) -> dict[str, Any]:
    if flow.needs_decode:
        async for delta in flow.decode():
            renderer.add(delta)
    return renderer.response(flow.usage())


async def _read_json(request: Request) -> Any:
    try:
        return msgspec.json.decode(await request.body())
    except msgspec.DecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from exc


async def unless_disconnected(request: Request, work: Awaitable[T], on_late_end: Callable[[], None]) -> T:
    """Run ``work`` unless the client disconnects first (then cancel it and raise ClientDisconnected).

    A cancelled ``work`` gets ``_CANCEL_WAIT_S`` to stop. One still running then (it did not stop at its
    cancel) is left to end on its own and the handler answers now; ``on_late_end`` runs when it ends,
    so what it took after the caller's clean-up (a lease, a KV waiter) is released then (the caller's
    ``flow.close``: idempotent)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await _wait_cancelled(task, on_late_end)
    if task.cancelled() or not task.done():
        raise ClientDisconnected()
    return task.result()


async def _wait_cancelled(task: asyncio.Future[Any], on_late_end: Callable[[], None]) -> None:
    try:
        await asyncio.wait({task}, timeout=_CANCEL_WAIT_S)
    finally:  # also when this wait itself is cancelled (server shutdown)
        if not task.done():
            logger.warning("cancelled work %r did not stop within %.1f s: what it takes is released when it ends",
                           task, _CANCEL_WAIT_S)
            task.add_done_callback(functools.partial(_ended_late, on_late_end))


def _ended_late(on_late_end: Callable[[], None], task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:  # retrieved: nobody awaits it any more
        logger.debug("cancelled work ended late with %r", task.exception())
    on_late_end()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def error_name(exc: ProxyError) -> str:
    """The ``errors_total{type}`` label of ``exc`` (a relay worker's copy of an error keeps its name)."""
    return getattr(exc, "relayed_name", None) or type(exc).__name__


def _auth_error(status: int, message: str) -> Response:
    headers = {"www-authenticate": "Bearer"} if status == 401 else None
    return JSONResponse({"error": {"message": message, "type": "authentication_error", "code": status}},
                        status_code=status, headers=headers)


def _response_id(req: ClientRequest, flow: ClientFlow) -> str:
    return ("chatcmpl-" if req.is_chat else "cmpl-") + flow.response_id


def _describe(inst: Instance) -> dict[str, Any]:
    return {
        "instance_id": inst.instance_id, "role": inst.role.value, "http_url": inst.http_url,
        "state": inst.state.value, "complete": inst.complete, "health": inst.health.value,
        "routable": inst.routable, "static": inst.static, "tp_size": inst.tp_size, "backend": inst.backend.value,
        "ttl_s": inst.registration_ttl_s,
        "control_host": inst.control_host, "inflight_requests": inst.inflight_requests,
        "inflight_tokens": inst.inflight_tokens, "capacity_slots": inst.capacity_slots,
        "free_slots": inst.free_slots(), "chunk_tokens": inst.chunk_tokens,
        "fingerprint": msgspec.to_builtins(inst.fingerprint) if inst.fingerprint is not None else None,
    }
