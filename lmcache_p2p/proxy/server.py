"""Build and run one proxy: ``lmcache-p2p proxy --host 127.0.0.1 --port 9100 --control-port 9101 ...``.

:class:`Proxy` owns every component and its lifetime: the control socket, the upstream HTTP
client, the registry, the health probes, the decoders' cancel sockets, and its background tasks
(TTL eviction, the periodic summary). Shutdown is graceful, then cancels: uvicorn stops accepting,
lets in-flight requests finish for ``--graceful-shutdown-s`` (the control socket keeps delivering
"KV ready" meanwhile), cancels what is left; then the proxy's own tasks and probes are cancelled
and its sockets closed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import uvicorn

from lmcache_p2p.config import Role
from lmcache_p2p.errors import ConfigError
from lmcache_p2p.protocol import Codec
from lmcache_p2p.proxy.app import ProxyApp
from lmcache_p2p.proxy.listener import bind_http, warm_up
from lmcache_p2p.proxy.relay.host import FlowHost
from lmcache_p2p.proxy.handover.cancel import KvCanceller
from lmcache_p2p.proxy.control import ControlListener
from lmcache_p2p.proxy.relay.coordinator import RelayCoordinator
from lmcache_p2p.proxy.flow.flow import FlowSettings, Orchestrator
from lmcache_p2p.proxy.http.tokenizer import TokenizerProvider
from lmcache_p2p.proxy.router.health import HealthProber
from lmcache_p2p.proxy.router.kv_metrics import KvMetricsPoller
from lmcache_p2p.proxy.observe.metrics import ProxyMetrics
from lmcache_p2p.proxy.router.registry import Registry
from lmcache_p2p.proxy.router.routing import Router
from lmcache_p2p.proxy.settings import ProxySettings, add_arguments
from lmcache_p2p.proxy.upstream import Upstream
from lmcache_p2p.proxy.handover.waiters import KvWaiters
from lmcache_p2p.proxy.relay.workers import WorkerFailure, WorkerPool

logger = logging.getLogger(__name__)

__all__ = ["Proxy", "add_arguments", "run", "serve"]

_TASK_CANCEL_TIMEOUT_S = 2.0


class Proxy:
    """Every component of one proxy; ``start()`` binds, ``close()`` (idempotent) releases all."""

    def __init__(self, settings: ProxySettings) -> None:
        self.settings = settings
        self.registry = Registry(settings.instance_ttl_s, max_connect_failures=settings.max_connect_failures)
        for spec in settings.static_instances:
            self.registry.add_static(spec)
        for spec in settings.registered_instances:
            self.registry.register(spec)
        self.waiters = KvWaiters()
        self.metrics = ProxyMetrics(self.registry.instances)
        self.upstream = Upstream(settings.connect_timeout_s, settings.dead_peer_timeout_s)
        codec = Codec(settings.shared_secret, identity=settings.identity, window_s=settings.auth_window_s)
        self.control = ControlListener(settings.control_host, settings.control_port, codec,
                                       self.registry, self.waiters, self.metrics, settings.control_name_hosts)
        self.canceller = KvCanceller(codec, self.metrics, signer_for=self.control.name_for)
        tokenizers = TokenizerProvider(settings.tokenizer, self.upstream, settings.connect_timeout_s,
                                       load_timeout_s=settings.tokenizer_load_timeout_s)
        self.prober = HealthProber(self.registry, self.upstream, settings.health_probe_interval_s,
                                   settings.health_probe_timeout_s, on_up=tokenizers.check_instance)
        self.kv_metrics = KvMetricsPoller(self.registry, self.upstream, settings.kv_metrics_interval_s,
                                          settings.health_probe_timeout_s)
        self.registry.on_pending.append(self.prober.watch)
        self.registry.on_forgotten.append(self.prober.forget)
        self.registry.on_forgotten.append(self.canceller.forget)
        self.registry.on_announced.append(self.canceller.heard)
        self.orchestrator = Orchestrator(
            self.registry, Router(settings.policy, settings.prefix), self.waiters, self.upstream, self.canceller,
            self.metrics,
            FlowSettings.of(settings),
            tokenizers=tokenizers,
        )
        self.flows = FlowHost(self.orchestrator)  # the requests relay workers serve the clients of (--workers N)
        self.proxy_app = ProxyApp(self.orchestrator, self.orchestrator, self.upstream, settings.chars_per_token,
                                  settings.connect_timeout_s,
                                  admin_secret=settings.shared_secret, clock=self.orchestrator.clock)
        self.app = self.proxy_app.build()
        self._tasks: set[asyncio.Task[None]] = set()
        self.workers: WorkerPool | None = None  # --workers N > 1
        self.coordinator: RelayCoordinator | None = None
        self._relay_dir: str | None = None
        self._http_socket: socket.socket | None = None
        self.failure: str | None = None  # why the proxy stopped on its own (relay workers kept dying)
        self._http: uvicorn.Server | None = None
        self._http_task: asyncio.Task[None] | None = None
        self._closed = False
        self._stopping: asyncio.Task[None] | None = None
        self.port = 0

    async def start(self) -> None:
        """Import the tokenizer library (``http/tokenizer.wait_imported``) and what the loop's first uses would import
        (``listener.warm_up``) before anything runs on the loop, bind the control socket and start the background
        tasks (not the HTTP server)."""
        await self.orchestrator.tokenizers.import_before_serving()
        await warm_up()
        exposed = self.settings.exposed_ports()
        if exposed and not self.settings.shared_secret:
            logger.warning("INSECURE (--insecure): %s reachable beyond loopback WITHOUT a shared secret: anyone who "
                           "reaches them can register a decoder (and receive prompts, KV and clients' Authorization "
                           "headers) or drain instances", " and ".join(exposed))
        self.control.start()
        self.prober.start()
        self.kv_metrics.start()
        registry = self.registry
        self._spawn(self.orchestrator.tokenizers.load_in_background(
            lambda: registry.routable(Role.SENDER) + registry.routable(Role.RECEIVER)), "proxy-tokenizer-load")
        self._spawn(self._evict_loop(), "proxy-evict")
        if self.settings.summary_interval_s > 0:
            self._spawn(self._summary_loop(), "proxy-summary")

    async def start_http(self) -> None:
        """Serve HTTP in a task (``.port`` is the bound port, useful with --port 0)."""
        workers = self.settings.workers > 1
        sock = bind_http(self.settings.host, self.settings.port, listen=not workers, reuse_port=workers)
        self.port = sock.getsockname()[1]
        if workers:
            await self._start_workers(sock)
            return
        await self._serve_on(self.app, sock, f"{self.settings.host}:{self.port}")

    async def _serve_on(self, app: Any, sock: socket.socket, where: str) -> None:
        self._http = _uvicorn_server(app, self.settings)
        self._http_task = asyncio.get_running_loop().create_task(self._http.serve(sockets=[sock]), name="proxy-http")
        while not self._http.started:
            if self._http_task.done():
                await self._http_task  # raises the start-up error
                raise OSError(f"the HTTP server on {where} stopped while starting")
            await asyncio.sleep(0.01)

    async def _start_workers(self, sock: socket.socket) -> None:
        """The coordinator serves its workers (and the public endpoints they pass through) on a Unix socket
        in a 0700 folder; the workers listen on the port ``sock`` holds (SO_REUSEPORT)."""
        from starlette.applications import Starlette

        self._http_socket = sock
        self._relay_dir = tempfile.mkdtemp(prefix="lmcache_p2p_relay_")  # mode 0700
        uds_path = os.path.join(self._relay_dir, "coordinator.sock")
        usock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        usock.bind(uds_path)
        usock.listen(2048)
        usock.setblocking(False)
        pool = self.workers = WorkerPool(self.settings, self.port, uds_path, on_dead=self._worker_died,
                                         on_give_up=self._give_up)
        self.coordinator = RelayCoordinator(self.flows, self.orchestrator, self.settings.chars_per_token,
                                            on_hello=pool.hello)
        await self._serve_on(Starlette(routes=[*self.coordinator.routes(), *self.app.routes]), usock, uds_path)
        await pool.start()

    def _worker_died(self, index: int) -> None:
        if self.coordinator is not None:
            self.coordinator.forget_worker(index)

    def _give_up(self, reason: str) -> None:
        self.failure = reason
        self.request_exit()

    def request_exit(self, sig: signal.Signals | None = None) -> None:
        """Graceful shutdown; a second request cancels in-flight requests at once."""
        if self._http is None:
            return
        if self.workers is not None:
            self._stop_workers()
            return
        if self._http.should_exit:
            self._http.force_exit = True
        self._http.should_exit = True
        logger.info("%s: shutting down (%s)", sig.name if sig else "exit requested",
                    "now" if self._http.force_exit else f"in-flight requests get {self.settings.graceful_shutdown_s} s")

    def _stop_workers(self) -> None:
        """Workers first (graceful; the coordinator keeps answering them meanwhile), then the coordinator's
        server; a second request kills the workers at once."""
        pool = self.workers
        if pool is None:
            return
        if self._stopping is not None:
            pool.kill()
            return
        logger.info("shutting down: in-flight requests get %s s", self.settings.graceful_shutdown_s)

        async def stop() -> None:
            await pool.stop(self.settings.graceful_shutdown_s)
            if self._http is not None:
                self._http.should_exit = True

        self._stopping = asyncio.get_running_loop().create_task(stop(), name="proxy-stop-workers")

    async def wait_http(self) -> None:
        """Until the HTTP server exits (uvicorn turns SIGINT/SIGTERM into a graceful exit)."""
        if self._http_task is not None:
            await asyncio.shield(self._http_task)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.workers is not None:
            await self.workers.stop(self.settings.graceful_shutdown_s)
        self.flows.close_all()
        self.orchestrator.close_all()
        if self._http is not None and self._http_task is not None:
            self._http.should_exit = True
            await asyncio.wait({self._http_task}, timeout=self.settings.graceful_shutdown_s + 1.0)
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=_TASK_CANCEL_TIMEOUT_S)
        await self.prober.close()
        await self.kv_metrics.close()
        await self.control.close()
        self.canceller.close()
        await self.upstream.aclose()
        if self._http_socket is not None:
            self._http_socket.close()
        if self._relay_dir is not None:
            shutil.rmtree(self._relay_dir, ignore_errors=True)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("background task %s died", task.get_name(), exc_info=task.exception())

    async def _evict_loop(self) -> None:
        interval_s = max(0.05, self.settings.instance_ttl_s / 4)
        while True:
            await asyncio.sleep(interval_s)
            self.registry.evict_expired()

    async def _summary_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.summary_interval_s)
            line = self.metrics.take_summary()
            if line is not None:
                logger.info("last %.0f s: %s", self.settings.summary_interval_s, line)


async def serve(args: argparse.Namespace) -> None:
    """Run the proxy until SIGINT/SIGTERM (a second one skips the graceful wait), then shut down."""
    proxy = Proxy(ProxySettings.from_args(args))
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    try:
        await proxy.start()
        await proxy.start_http()
        for sig in signals:
            loop.add_signal_handler(sig, proxy.request_exit, sig)
        s = proxy.settings
        logger.info("proxy on http://%s:%d, control %s, policy %s, on KV failure %s%s", s.host, proxy.port,
                    proxy.control.address, s.policy.value, s.on_kv_failure.value,
                    f", {s.workers} relay workers" if s.workers > 1 else "")
        await proxy.wait_http()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        await proxy.close()
    if proxy.failure is not None:
        raise WorkerFailure(proxy.failure)


def run(args: argparse.Namespace) -> None:
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(serve(args))
    except ConfigError as exc:
        logger.error("proxy not started: %s", exc)
        raise SystemExit(2) from exc
    except WorkerFailure as exc:
        logger.error("proxy stopped: %s", exc)
        raise SystemExit(1) from exc
    except KeyboardInterrupt:
        pass


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when it is installed (uvicorn's ``loop="auto"`` choice; ``Server.serve`` alone
    does not apply it): every relayed token costs the proxy one socket read and one write, and uvloop's
    C transports take markedly less CPU per wakeup than asyncio's selector loop (``bench/proxy_relay.py``)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the proxy owns SIGINT/SIGTERM (``serve``), so that its
    own ``close()`` still runs after the graceful exit (uvicorn would re-raise the signal and die)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _uvicorn_server(app: Any, settings: ProxySettings) -> uvicorn.Server:
    config = uvicorn.Config(
        app,
        log_config=None,  # only the cli configures logging
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=settings.graceful_shutdown_s,
        timeout_keep_alive=30,
    )
    return _Server(config)
