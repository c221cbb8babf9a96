"""One relay worker process of ``--workers N`` (started by ``relay/workers.py``, never by hand).

It serves the proxy's public HTTP port (its own SO_REUSEPORT listener, next to the other workers')
with the same app and request path as one process (``app.py``, ``flow/client.py``); only its link
differs: the coordinator prefills (routing, admission, KV wait) and names the decoder, reached over
its Unix socket (``relay/link.py``, ``relay/messages.py``); this process streams the decode, makes
the client's text (its own copy of the tokenizer) and renders the client's events. Other endpoints (``/health``, ``/metrics``,
``/stats``, admin) are passed through to the coordinator.

The worker exits when the coordinator does (its parent pid changes) and on SIGTERM (graceful:
in-flight requests get ``--graceful-shutdown-s``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from lmcache_p2p.proxy.app import ProxyApp
from lmcache_p2p.proxy.listener import bind_http, warm_up
from lmcache_p2p.proxy.errors import ProxyError
from lmcache_p2p.proxy.relay.link import CoordinatorLink
from lmcache_p2p.proxy.relay.tokenizers import Tokenizers
from lmcache_p2p.proxy.relay.messages import PREFIX, Hello, TokenizerSource
from lmcache_p2p.proxy.http.shaping import Endpoint
from lmcache_p2p.proxy.http.tokenizer import NONE
from lmcache_p2p.proxy.upstream import Upstream

logger = logging.getLogger(__name__)

_PARENT_POLL_S = 1.0
_TOKENIZER_POLL_S = 0.5


class WorkerApp(ProxyApp):
    """``ProxyApp`` over the coordinator's link (its requests' flows are there); other endpoints pass through."""

    def __init__(self, link: CoordinatorLink, upstream: Upstream, chars_per_token: float) -> None:
        super().__init__(None, link, upstream, chars_per_token, 0.0)
        self.link: CoordinatorLink = link
        self.tokenizers = link.tokenizers

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


# ---- the process -------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lmcache_p2p.proxy.relay.worker", description=__doc__)
    p.add_argument("--host", required=True, help="the proxy's HTTP address (SO_REUSEPORT: shared with the others)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--uds", required=True, help="the coordinator's Unix socket")
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--chars-per-token", type=float, required=True)
    p.add_argument("--connect-timeout-s", type=float, required=True)
    p.add_argument("--dead-peer-timeout-s", type=float, default=None)
    p.add_argument("--coordinator-timeout-s", type=float, required=True,
                   help="deadline of one call to the coordinator (it covers a prefill and a KV wait)")
    p.add_argument("--graceful-shutdown-s", type=float, required=True)
    p.add_argument("--tokenizer", default=NONE, help="the proxy's --tokenizer: a folder is loaded at start; 'auto': "
                   "transformers is imported before it listens and the coordinator's folder loaded once it knows it")
    p.add_argument("--tokenizer-load-timeout-s", type=float, required=True,
                   help="longest a request waits for this worker's load of the tokenizer")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    import uvicorn

    tokenizers = Tokenizers(args.tokenizer_load_timeout_s)
    if args.tokenizer != NONE:  # before it listens: the kernel hands a listening worker its share of connections
        await tokenizers.import_before_serving()
    await warm_up()
    sock = bind_http(args.host, args.port, reuse_port=True)
    link = CoordinatorLink(args.uds, args.index, args.coordinator_timeout_s, tokenizers)
    upstream = Upstream(args.connect_timeout_s, args.dead_peer_timeout_s)
    worker_app = WorkerApp(link, upstream, args.chars_per_token)
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
            answer = await link.ask("tokenizer", Hello(link.worker, os.getpid()), TokenizerSource)
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
