"""One relay worker process of ``--workers N`` (started by ``workers.py``, never by hand).

It serves the proxy's public HTTP port (its own SO_REUSEPORT listener, next to the other workers')
with the same app as one process (``app.py``), but its request flow is :class:`RemoteFlow`: the
coordinator prefills (routing, admission, KV wait) and names the decoder; this process streams
the decode from it, makes the client's text (its own copy of the tokenizer), renders the client's
events, and reports the steps the coordinator needs (``relay_messages.py``). A broken decode
continues where the coordinator says (migration), exactly as in one process. Other endpoints
(``/health``, ``/metrics``, ``/stats``, admin) are passed through to the coordinator.

The worker exits when the coordinator does (its parent pid changes) and on SIGTERM (graceful:
in-flight requests get ``--graceful-shutdown-s``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import gc
import importlib
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Mapping
from typing import Any, TypeVar

import aiohttp
import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from lmcache_p2p.proxy.app import EarlyDecode, ProxyApp
from lmcache_p2p.proxy.detokenize import OutputText, TextParams
from lmcache_p2p.proxy.errors import ProxyError, UpstreamConnectError, UpstreamError
from lmcache_p2p.proxy.flow import context_full, end_of_context, migratable, shape_delta
from lmcache_p2p.proxy.held_text import HeldText, Replay
from lmcache_p2p.proxy.relay_messages import (
    PREFIX,
    VERSION_HEADER,
    PROTOCOL_VERSION,
    Count,
    Failed,
    Hello,
    Open,
    Opened,
    PlanFailed,
    Planned,
    PlanLine,
    Step,
    Target,
    TokenizerSource,
)
from lmcache_p2p.proxy.responses import SSE_DONE, Delta, FirstToken, Renderer, decode_delta, usage
from lmcache_p2p.proxy.shaping import ClientRequest, Endpoint
from lmcache_p2p.proxy.tokenizer import NONE, ProxyTokenizer, load_tokenizer
from lmcache_p2p.proxy.upstream import Upstream

logger = logging.getLogger(__name__)

M = TypeVar("M")
_current: contextvars.ContextVar[RemoteFlow | None] = contextvars.ContextVar("relay_flow", default=None)
_PARENT_POLL_S = 1.0
_TOKENIZER_POLL_S = 0.5
_PASSED_HEADERS = ("authorization", "content-type")
_ANSWER_HEADERS = ("content-type", "www-authenticate")
_LINK_ERRORS = (aiohttp.ClientError, TimeoutError)
_CLOSED_ATTEMPTS = 5  # "closed" returns the request's lease on the coordinator: sent again after a link error
_RETRY_BACKOFF_S = 0.1  # before the second attempt; doubled before each next one


class RelayedError(ProxyError):
    """An error the coordinator answered; keeps its status, body and class name (errors_total{type})."""

    def __init__(self, failed: Failed, status_code: int) -> None:
        error = failed.body.get("error") if isinstance(failed.body, dict) else None
        message = str(error.get("message")) if isinstance(error, dict) else str(failed.body)
        super().__init__(message, status_code=status_code, body=failed.body)
        self.relayed_name = failed.name


class CoordinatorLink:
    """HTTP to the coordinator's Unix socket; step reports that nothing waits for go in tasks, in order.

    On aiohttp, as the proxy's calls to instances: three calls per request (open, started, closed),
    and httpx's per-call cost (~0.35 ms more on loopback) was on every request's TTFT (open) and on
    the relay's CPU."""

    def __init__(self, uds_path: str, worker: int, timeout_s: float) -> None:
        self.worker = worker
        self._uds_path = uds_path
        self._timeout_s = timeout_s
        self._session: Any = None  # aiohttp.ClientSession, made on first use (it belongs to the running loop)
        self._tasks: set[asyncio.Task[Any]] = set()

    def _client(self) -> Any:
        if self._session is None:
            t = self._timeout_s  # to connect and between reads: an open answer waits for the KV between its lines
            self._session = aiohttp.ClientSession(
                base_url="http://coordinator", connector=aiohttp.UnixConnector(path=self._uds_path, limit=0),
                headers={VERSION_HEADER: str(PROTOCOL_VERSION)}, trust_env=False,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=t, sock_read=t))
        return self._session

    async def _post(self, step: str, msg: msgspec.Struct) -> tuple[int, bytes]:
        async with self._client().post(f"{PREFIX}/{step}", data=msgspec.json.encode(msg)) as resp:
            return resp.status, await resp.read()

    async def call(self, step: str, msg: msgspec.Struct, answer: type[M]) -> M:
        try:
            status, content = await self._post(step, msg)
        except _LINK_ERRORS as exc:  # the coordinator is gone or stuck: a worker cannot serve alone
            raise self._unanswered(step, exc) from exc
        if status != 200:
            raise _relayed(status, content)
        return msgspec.json.decode(content, type=answer)

    async def open(self, msg: Open) -> tuple[Opened, OpenAnswer]:
        """``open``: its first line (the prefill's first token) now; the rest of the answer (where the decode
        goes) stays to be read from the returned ``OpenAnswer``, which the caller closes."""
        try:
            resp = await self._client().post(f"{PREFIX}/open", data=msgspec.json.encode(msg))
        except _LINK_ERRORS as exc:
            raise self._unanswered("open", exc) from exc
        if resp.status != 200:
            try:
                content = await resp.read()
            except _LINK_ERRORS as exc:
                raise self._unanswered("open", exc) from exc
            finally:
                resp.release()
            raise _relayed(resp.status, content)
        answer = OpenAnswer(self, resp)
        try:
            return await answer.opened(), answer
        except BaseException:
            await answer.aclose()
            raise

    def _unanswered(self, step: str, exc: BaseException) -> ProxyError:
        return ProxyError(f"relay worker {self.worker}: the coordinator did not answer {step} "
                          f"({type(exc).__name__}: {exc})", status_code=503)

    async def tell(self, step: str, msg: msgspec.Struct, attempts: int = 1) -> None:
        """A report nothing waits on the answer of; a coordinator that does not take it is logged.

        A link error (no answer within --coordinator-timeout-s, a connection dropped) is sent again, up
        to ``attempts`` sends, after ``_RETRY_BACKOFF_S`` doubled each time: "closed" goes with
        ``_CLOSED_ATTEMPTS``, since until the coordinator takes it the request's lease (load, decoder
        credit) stays there. A send that did arrive (only its answer was lost) is harmless: the
        coordinator ignores a "closed" of a handle it already closed. A refusal (status >= 400) is
        final. After the last failed send the lease is returned when this worker exits (the coordinator
        closes a dead worker's requests): the coordinator has then not answered ``attempts`` times in a
        row, the judgement by which open fails requests with 503."""
        for attempt in range(1, attempts + 1):
            try:
                status, content = await self._post(step, msg)
            except _LINK_ERRORS as exc:
                logger.log(logging.ERROR if attempt == attempts else logging.WARNING,
                           "relay worker %d: the coordinator did not take %s (send %d of %d; %s: %s)",
                           self.worker, step, attempt, attempts, type(exc).__name__, exc)
                if attempt < attempts:
                    await asyncio.sleep(_RETRY_BACKOFF_S * 2 ** (attempt - 1))
                continue
            if status >= 400:
                logger.warning("the coordinator refused %s: %d %s", step, status, content[:300])
            return

    def tell_later(self, step: str, msg: msgspec.Struct | Callable[[], msgspec.Struct],
                   after: Collection[asyncio.Task[Any]] = (), answer: OpenAnswer | None = None,
                   attempts: int = 1) -> asyncio.Task[Any]:
        """Send in a task (never awaits here: safe in a cancelled task); after the tasks ``after`` (and
        after closing ``answer``); ``msg`` may be made when it goes; ``attempts``: as ``tell``."""
        task = asyncio.get_running_loop().create_task(self._tell_after(step, msg, after, answer, attempts),
                                                      name=f"relay-{step}")
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    async def _tell_after(self, step: str, msg: msgspec.Struct | Callable[[], msgspec.Struct],
                          after: Collection[asyncio.Task[Any]], answer: OpenAnswer | None, attempts: int) -> None:
        if answer is not None:
            await answer.aclose()
        if after:
            await asyncio.wait(after)
        await self.tell(step, msg if isinstance(msg, msgspec.Struct) else msg(), attempts)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("reporting to the coordinator failed: %r", task.exception())

    async def passthrough(self, request: Request) -> Response:
        headers = {k: v for k in _PASSED_HEADERS if (v := request.headers.get(k))}
        try:
            async with self._client().request(request.method, request.url.path,
                                              params=list(request.query_params.multi_items()),
                                              data=await request.body(), headers=headers) as resp:
                status, content, answer_headers = resp.status, await resp.read(), resp.headers
        except _LINK_ERRORS as exc:
            raise self._unanswered(request.url.path, exc) from exc
        return Response(content, status_code=status,
                        headers={k: v for k in _ANSWER_HEADERS if (v := answer_headers.get(k))})

    async def aclose(self) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5.0)
        if self._session is not None:
            await self._session.close()


class OpenAnswer:
    """The rest of an ``open`` answer (JSON lines): after ``Opened``, where the decode goes."""

    def __init__(self, link: CoordinatorLink, resp: Any) -> None:  # an aiohttp.ClientResponse
        self._link = link
        self._resp = resp
        self._chunks = resp.content.iter_any()
        self._buffer = b""
        self._closed = False

    async def opened(self) -> Opened:
        return msgspec.json.decode(await self._line("open"), type=Opened)

    async def plan(self) -> Target:
        """Where the first decode goes (the coordinator sends it once the KV is ready); raises its error."""
        try:
            line = msgspec.json.decode(await self._line("the decode's plan"), type=PlanLine)
        finally:
            await self.aclose()
        if isinstance(line, PlanFailed):
            raise RelayedError(line.failed, line.status)
        if line.target is None:
            raise ProxyError("the coordinator named no decoder")
        return line.target

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            if self._resp.content.at_eof():
                self._resp.release()  # read to its end: the connection goes back to the pool
            else:
                self._resp.close()  # the coordinator sees the request go (as with a client that left)

    async def _line(self, what: str) -> bytes:
        while b"\n" not in self._buffer:
            try:
                chunk = await self._chunks.__anext__()
            except StopAsyncIteration:
                raise ProxyError(f"relay worker {self._link.worker}: the coordinator ended its answer before "
                                 f"{what} (the request was closed there)", status_code=503) from None
            except _LINK_ERRORS as exc:
                raise self._link._unanswered(what, exc) from exc
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line


def _relayed(status: int, content: bytes) -> ProxyError:
    try:
        return RelayedError(msgspec.json.decode(content, type=Failed), status)
    except msgspec.DecodeError:
        return ProxyError(f"the coordinator answered {status}: {content[:300]!r}")


class Tokenizers:
    """The tokenizer the coordinator names, loaded once in this process (off the event loop)."""

    def __init__(self) -> None:
        self._loading: dict[str, asyncio.Task[ProxyTokenizer | None]] = {}
        self._import: asyncio.Task[Any] | None = None

    def prefetch(self) -> None:
        """Import ``transformers`` in a thread now (seconds): the first request then waits for the folder alone."""
        if self._import is None:
            self._import = asyncio.get_running_loop().create_task(
                asyncio.to_thread(importlib.import_module, "transformers"), name="relay-tokenizer-import")

    def preload(self, source: str) -> None:
        """Start loading ``source`` now (the proxy's --tokenizer folder), before the first request needs it."""
        if source not in self._loading:
            self._loading[source] = asyncio.get_running_loop().create_task(self._load(source), name="relay-tokenizer")

    async def get(self, source: str) -> ProxyTokenizer:
        self.preload(source)
        tokenizer = await asyncio.shield(self._loading[source])
        if tokenizer is None:
            raise ProxyError(f"this relay worker cannot load the coordinator's tokenizer {source}")
        return tokenizer

    async def _load(self, source: str) -> ProxyTokenizer | None:
        if self._import is not None:  # a second importing thread would see it half-initialized (tokenizer.py)
            await asyncio.wait({self._import})
        try:
            tokenizer = await asyncio.to_thread(load_tokenizer, source)
        except Exception as exc:
            logger.error("relay worker: cannot load the tokenizer from %s (%s: %s)", source, type(exc).__name__, exc)
            return None
        gc.freeze()  # as the coordinator does (tokenizer.py): full collections must not walk transformers' objects
        return tokenizer


class RemoteFlow:
    """One request of this worker: ``RequestFlow``'s interface (what ``app.py`` uses), its decode here."""

    def __init__(self, worker: WorkerApp, req: ClientRequest, headers: Mapping[str, str], received_s: float) -> None:
        self._w = worker
        self.req = req
        self.handle = uuid.uuid4().hex
        self.response_id = self.handle
        self._headers = dict(headers)
        self._received_s = received_s
        self._opened: Opened | None = None
        self._answer: OpenAnswer | None = None  # the rest of open's answer: where the decode goes
        self._counts: list[Count] = []  # this answer's requests_total / errors_total: they go with "closed"
        self._decode_sent_s: float | None = None
        self.prompt_ids: list[int] = []
        self._output_ids: list[int] = []
        self._held = HeldText(enabled=False)  # the last output as the client got it (set for the decode)
        self._replay = Replay((), "")  # what of the current stream's first output the client already has
        self._text: OutputText | None = None
        self._finished = False
        self._started: asyncio.Task[Any] | None = None
        self._first_byte_s: float | None = None
        self._closed = False
        self._closing: asyncio.Task[Any] | None = None
        self._before_close: list[asyncio.Task[Any]] = []  # reports the coordinator must have before "closed"

    async def prefill(self) -> FirstToken:
        link = self._w.link
        opened, self._answer = await link.open(Open(
            self.handle, link.worker, self.req.endpoint.value, msgspec.Raw(msgspec.json.encode(self.req.body)),
            self._headers, self._received_s))
        self._opened = opened
        if not opened.needs_decode:
            await self._answer.aclose()
        self.response_id, self.prompt_ids = opened.response_id, opened.prompt_ids
        first = opened.first
        self._output_ids = [] if opened.colocated else [first.token_id]
        if opened.proxy_text and opened.tokenizer is not None:
            tokenizer = await self._w.tokenizers.get(opened.tokenizer)
            self._text = tokenizer.output_text(self.prompt_ids, TextParams.from_body(self.req.body))
            if not opened.colocated:  # as the coordinator's copy did for the first token
                self._text.update([first.token_id], stop_terminated=False)
                self._text.next_delta(finished=False)
        return first

    @property
    def decoder_regenerates_first(self) -> bool:
        return self._open().regenerates_first

    @property
    def needs_decode(self) -> bool:
        return self._open().needs_decode

    def add_count(self, count: Count) -> None:
        """A count of this request's answer: it goes to the coordinator with "closed"."""
        self._counts.append(count)

    def first_byte_written(self) -> None:
        if self._first_byte_s is None:
            self._first_byte_s = time.perf_counter()

    def usage(self) -> dict[str, int]:
        return usage(len(self.prompt_ids), len(self._output_ids) or 1)

    async def decode(self) -> AsyncIterator[Delta]:
        if self._answer is None:
            raise RuntimeError("prefill() first")
        target = await self._answer.plan()  # the coordinator sends it once the KV is ready: no call from here
        self._held = HeldText.for_request(self.req, proxy_text=self._text is not None)
        if self.decoder_regenerates_first:
            self._output_ids = []
        else:
            self._held.observe(Delta(self._open().first.text, list(self._output_ids), None, None, None))
        while True:
            try:
                async for delta in self._decode_stream(target):
                    yield delta
                return
            except UpstreamError as exc:
                if context_full(exc):
                    self._finished = True
                    yield end_of_context(self._text)
                    return
                if not migratable(exc) or self._finished:
                    raise
                replay = self._held.replay()
                done = len(self._output_ids) - replay.rewound  # the next instance generates the replayed ones again
                target = await self._call("broken", Planned, connect_failed=isinstance(exc, UpstreamConnectError),
                                          message=str(exc), output_ids=self._output_ids[:done])
                if target is None:
                    raise
                self._replay = replay

    async def end(self) -> None:
        """The answer is complete (before the client's [DONE] or its body): the coordinator closes the
        request now (releases its load, remembers the output for the next turn), as one process would."""
        if self._closed:
            return
        self._closed = True
        if self._answer is not None:
            await self._answer.aclose()
        if self._before_close:
            await asyncio.wait(self._before_close)  # the coordinator learns the steps in order
        await self._w.link.tell("closed", self._closed_step(), _CLOSED_ATTEMPTS)

    def close(self) -> None:
        """Tell the coordinator the request is over (in a task: never awaits); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._closing = self._w.link.tell_later("closed", self._closed_step, after=self._before_close,
                                                answer=self._answer, attempts=_CLOSED_ATTEMPTS)

    async def closing(self) -> None:
        """Until the coordinator has closed the request (after ``close``)."""
        if self._closing is not None:
            await asyncio.wait({self._closing})

    # ---- internals ---------------------------------------------------------------------------------

    def _open(self) -> Opened:
        if self._opened is None:
            raise RuntimeError("prefill() first")
        return self._opened

    def _step(self, **fields: Any) -> Step:
        fields.setdefault("output_ids", list(self._output_ids))
        return Step(self.handle, finished=self._finished, first_byte_s=self._first_byte_s, **fields)

    def _closed_step(self) -> Step:
        return self._step(counts=list(self._counts))

    async def _call(self, step: str, answer: type[Planned], **fields: Any) -> Target | None:
        if self._started is not None:
            await asyncio.wait({self._started})  # the coordinator learns the steps in order
        planned = await self._w.link.call(step, self._step(**fields), answer)
        return planned.target

    async def _decode_stream(self, target: Target) -> AsyncIterator[Delta]:
        """One decode stream; a refused connection goes where the coordinator says."""
        async with contextlib.AsyncExitStack() as stack:
            while True:
                try:
                    if self._decode_sent_s is None:
                        self._decode_sent_s = time.perf_counter()
                    events = await stack.enter_async_context(self._w.upstream.stream_events(
                        target.url, Endpoint.COMPLETIONS.value, target.body,
                        idle_timeout_s=self._open().decode_idle_timeout_s, headers=self._headers))
                    break
                except UpstreamConnectError as exc:
                    moved = await self._call("unreachable", Planned, message=str(exc))
                    if moved is None:
                        raise
                    target = moved
            async for event in events:
                if self._started is None:
                    self._started = self._w.link.tell_later("started", self._step(
                        decode_sent_s=self._decode_sent_s, first_decoded_s=time.perf_counter()))
                    self._before_close.append(self._started)
                raw = decode_delta(event)
                if raw is None:
                    continue
                raw = self._replay.filter(raw)
                if raw is None:
                    continue
                delta = shape_delta(self._text, raw)
                self._held.observe(delta)
                self._output_ids.extend(delta.token_ids)
                self._finished = delta.finish_reason is not None
                yield delta
                if self._finished:
                    return


class WorkerApp(ProxyApp):
    """``ProxyApp`` with remote flows; counts go to the coordinator; other endpoints pass through."""

    def __init__(self, link: CoordinatorLink, upstream: Upstream, chars_per_token: float) -> None:
        super().__init__(None, chars_per_token, 0.0)  # type: ignore[arg-type]  # no orchestrator here
        self.link = link
        self.upstream = upstream
        self.tokenizers = Tokenizers()

    def build(self) -> Starlette:
        return Starlette(routes=[
            Route(Endpoint.COMPLETIONS.value, self.completions, methods=["POST"]),
            Route(Endpoint.CHAT.value, self.chat_completions, methods=["POST"]),
            Route("/{path:path}", self._pass, methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
        ])

    async def _pass(self, request: Request) -> Response:
        if request.url.path.startswith(PREFIX):
            return Response(status_code=404)
        return await self.link.passthrough(request)

    def _now(self) -> float:
        return time.perf_counter()

    def _open_flow(self, req: ClientRequest, headers: Mapping[str, str], received_s: float) -> Any:
        flow = RemoteFlow(self, req, headers, received_s)
        _current.set(flow)
        return flow

    async def _generate(self, request: Request, endpoint: Endpoint) -> Response:
        """As one process; an answer that is not a stream goes out once the coordinator closed its request."""
        _current.set(None)
        response = await super()._generate(request, endpoint)
        flow = _current.get()
        if flow is not None and not isinstance(response, StreamingResponse):
            await flow.closing()
        return response

    async def _stream(self, flow: Any, renderer: Renderer, decode: EarlyDecode | None) -> AsyncIterator[bytes]:
        async for chunk in super()._stream(flow, renderer, decode):
            if chunk is SSE_DONE:
                await flow.end()
            yield chunk

    def _count(self, endpoint: Endpoint, status: int) -> None:
        self._tell_count(Count(endpoint.value, status=status))

    def _count_error(self, endpoint: Endpoint, name: str) -> None:
        self._tell_count(Count(endpoint.value, error=name))

    def _tell_count(self, count: Count) -> None:
        flow = _current.get()
        if flow is not None:
            flow.add_count(count)  # with its "closed"
        else:
            self.link.tell_later("count", count)


# ---- the process -------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lmcache_p2p.proxy.relay_worker", description=__doc__)
    p.add_argument("--host", required=True, help="the proxy's HTTP address (SO_REUSEPORT: shared with the others)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--uds", required=True, help="the coordinator's Unix socket")
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--chars-per-token", type=float, required=True)
    p.add_argument("--connect-timeout-s", type=float, required=True)
    p.add_argument("--coordinator-timeout-s", type=float, required=True,
                   help="deadline of one call to the coordinator (it covers a prefill and a KV wait)")
    p.add_argument("--graceful-shutdown-s", type=float, required=True)
    p.add_argument("--tokenizer", default=NONE, help="the proxy's --tokenizer: a folder is loaded at start; 'auto': "
                   "transformers is imported at start and the coordinator's folder loaded once it knows it")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from lmcache_p2p.proxy.server import bind_http

    sock = bind_http(args.host, args.port, reuse_port=True)
    link = CoordinatorLink(args.uds, args.index, args.coordinator_timeout_s)
    upstream = Upstream(args.connect_timeout_s)
    worker_app = WorkerApp(link, upstream, args.chars_per_token)
    if args.tokenizer != NONE:
        worker_app.tokenizers.prefetch()
    if os.path.isdir(args.tokenizer):
        worker_app.tokenizers.preload(args.tokenizer)
    app = worker_app.build()
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                            timeout_graceful_shutdown=args.graceful_shutdown_s, timeout_keep_alive=30)
    server = _Server(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]), name="relay-worker-http")
    parent = os.getppid()
    follow: asyncio.Task[None] | None = None
    try:
        while not server.started:
            if task.done():
                await task
                return
            await asyncio.sleep(0.01)
        if os.path.isdir(args.tokenizer):  # serve once the text can be made: a first request must not wait
            with contextlib.suppress(ProxyError):
                await worker_app.tokenizers.get(args.tokenizer)
        await link.tell("hello", Hello(args.index, os.getpid()))
        follow = asyncio.get_running_loop().create_task(_follow_tokenizer(link, worker_app.tokenizers),
                                                        name="relay-tokenizer-follow")
        while not task.done():
            if os.getppid() != parent:
                logger.error("relay worker %d: the coordinator (pid %d) is gone: exiting", args.index, parent)
                server.should_exit = server.force_exit = True
            await asyncio.wait({task}, timeout=_PARENT_POLL_S)
        await task
    finally:
        if follow is not None:
            follow.cancel()
        await link.aclose()
        await upstream.aclose()


async def _follow_tokenizer(link: CoordinatorLink, tokenizers: Tokenizers) -> None:
    """Load the tokenizer the coordinator loaded (``--tokenizer auto``: once an instance told it the model
    folder), before a request needs it here; asks every ``_TOKENIZER_POLL_S`` until the coordinator settled."""
    while True:
        try:
            answer = await link.call("tokenizer", Hello(link.worker, os.getpid()), TokenizerSource)
        except ProxyError as exc:
            logger.debug("tokenizer source not known yet: %s", exc)
        else:
            if answer.settled:
                if answer.source is not None:
                    tokenizers.preload(answer.source)
                return
        await asyncio.sleep(_TOKENIZER_POLL_S)


class _Server:
    """uvicorn's server with SIGTERM as its only signal (the coordinator's; SIGINT of a terminal goes to
    the coordinator, which stops its workers)."""

    def __new__(cls, config: Any) -> Any:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                loop = asyncio.get_running_loop()
                loop.add_signal_handler(signal.SIGTERM, self.handle_exit, signal.SIGTERM, None)
                try:
                    yield
                finally:
                    loop.remove_signal_handler(signal.SIGTERM)

        return Server(config)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s %(levelname)s [relay {args.index}] %(name)s: "
                                                     "%(message)s")
    for noisy in ("httpx", "httpcore"):  # health probes: plumbing, not news
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().getEffectiveLevel()))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import uvloop

        loop_factory: Any = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve(args))


if __name__ == "__main__":
    main()
