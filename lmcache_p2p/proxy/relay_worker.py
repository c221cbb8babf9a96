"""One relay worker process of ``--workers N`` (started by ``workers.py``, never by hand).

It serves the proxy's public HTTP port (its own SO_REUSEPORT listener, next to the other workers')
with the same app as one process (``app.py``), but its request flow is :class:`RemoteFlow`: the
coordinator prefills (routing, admission, KV wait) and names the decoder; this process runs the
decode session (``decode_session.py``, the same loop as one process) whose steps go to the
coordinator (``relay_link.py``, ``relay_messages.py``), makes the client's text (its own copy of the
tokenizer) and renders the client's events. Other endpoints (``/health``, ``/metrics``,
``/stats``, admin) are passed through to the coordinator.

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
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from lmcache_p2p.proxy.app import EarlyDecode, ProxyApp
from lmcache_p2p.proxy.decode_session import DecodeSession
from lmcache_p2p.proxy.detokenize import OutputText, TextParams
from lmcache_p2p.proxy.errors import ProxyError, UpstreamConnectError, UpstreamError
from lmcache_p2p.proxy.relay_link import CLOSED_ATTEMPTS, CoordinatorLink, OpenAnswer
from lmcache_p2p.proxy.relay_messages import PREFIX, Count, Hello, Open, Opened, Planned, Step, Target, TokenizerSource
from lmcache_p2p.proxy.responses import SSE_DONE, Delta, FirstToken, Renderer, usage
from lmcache_p2p.proxy.shaping import ClientRequest, Endpoint
from lmcache_p2p.proxy.tokenizer import NONE, ProxyTokenizer, load_tokenizer
from lmcache_p2p.proxy.upstream import Upstream

logger = logging.getLogger(__name__)

_current: contextvars.ContextVar[RemoteFlow | None] = contextvars.ContextVar("relay_flow", default=None)
_PARENT_POLL_S = 1.0
_TOKENIZER_POLL_S = 0.5


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
        self.prompt_ids: list[int] = []
        self._output_ids: list[int] = []
        self._text: OutputText | None = None
        self._session: DecodeSession | None = None
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
        opened = self._open()
        self._session = DecodeSession(self, self._w.upstream, self.req, self._headers, opened.decode_idle_timeout_s,
                                      self._text, self._output_ids)
        async for delta in self._session.deltas(opened.regenerates_first, opened.first.text):
            yield delta

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
        await self._w.link.tell("closed", self._closed_step(), CLOSED_ATTEMPTS)

    def close(self) -> None:
        """Tell the coordinator the request is over (in a task: never awaits); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._closing = self._w.link.tell_later("closed", self._closed_step, after=self._before_close,
                                                answer=self._answer, attempts=CLOSED_ATTEMPTS)

    async def closing(self) -> None:
        """Until the coordinator has closed the request (after ``close``)."""
        if self._closing is not None:
            await asyncio.wait({self._closing})

    # ---- the decode session's steps, through the coordinator (decode_session.DecodeSteps) ------------

    async def plan(self) -> Target:
        if self._answer is None:
            raise RuntimeError("prefill() first")
        return await self._answer.plan()  # the coordinator sends it once the KV is ready: no call from here

    async def unreachable(self, exc: UpstreamConnectError) -> Target | None:
        return await self._call("unreachable", message=str(exc))

    async def broken(self, output_ids: list[int], finished: bool, rewound: int, exc: UpstreamError) -> Target | None:
        return await self._call("broken", output_ids=output_ids, finished=finished, rewound=rewound,
                                connect_failed=isinstance(exc, UpstreamConnectError), message=str(exc))

    def started(self, decode_sent_s: float, first_decoded_s: float) -> None:
        self._started = self._w.link.tell_later("started", self._step(decode_sent_s=decode_sent_s,
                                                                      first_decoded_s=first_decoded_s))
        self._before_close.append(self._started)

    # ---- internals ---------------------------------------------------------------------------------

    def _open(self) -> Opened:
        if self._opened is None:
            raise RuntimeError("prefill() first")
        return self._opened

    def _step(self, **fields: Any) -> Step:
        fields.setdefault("output_ids", list(self._output_ids))
        fields.setdefault("finished", self._session is not None and self._session.finished)
        return Step(self.handle, first_byte_s=self._first_byte_s, **fields)

    def _closed_step(self) -> Step:
        return self._step(counts=list(self._counts))

    async def _call(self, step: str, **fields: Any) -> Target | None:
        if self._started is not None:
            await asyncio.wait({self._started})  # the coordinator learns the steps in order
        planned = await self._w.link.call(step, self._step(**fields), Planned)
        return planned.target


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
