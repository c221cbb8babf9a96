"""The proxy's control socket: a ZMQ PULL where instances push Announce, Goodbye, KvReady, KvFailed,
KvSent (a prefiller's times for the request timeline).

Frames are checked and decoded by :class:`lmcache_p2p.protocol.Codec` (shared secret optional).
Under a secret an instance addresses every frame to this socket's address as it dials it
(``host:port`` of its ``p2p.proxy_url``); the names answered to are ``--advertise-host`` /
``--control-host`` with the bound port, so a frame captured on its way to another proxy is refused
(``misaddressed``), and frames stamped before this proxy started are refused (``stale``: an earlier
incarnation's). The name each instance uses is remembered: the proxy signs its Cancels to that
instance with it (:meth:`ControlListener.name_for`), the only name the receiver accepts them from.

A frame that fails authentication (wrong tag, replayed, stale, misaddressed), is oversized, or fails
decoding or validation is dropped, counted in ``lmcache_p2p_proxy_control_rejected_total{reason}``
and logged (WARNING at most every ``_WARN_EVERY_S`` per reason, with the count since). PUSH/PULL has
no replies.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

import zmq
import zmq.asyncio

from lmcache_p2p.errors import ClosedError, ProtocolError
from lmcache_p2p.protocol import (MAX_MESSAGE_BYTES, Announce, Codec, Goodbye, KvFailed, KvReady, KvSent, Rejection,
                                  rejection_of)
from lmcache_p2p.proxy.observe.metrics import ProxyMetrics
from lmcache_p2p.proxy.router.registry import Registry
from lmcache_p2p.proxy.handover.waiters import KvWaiters
from lmcache_p2p.rejection_log import RejectionLog

logger = logging.getLogger(__name__)

_WARN_EVERY_S = 10.0
_CLOSE_TIMEOUT_S = 2.0
_NAMES_REMEMBERED = 4096  # instances whose name for us is kept (ids change with restarts; oldest forgotten)


class ControlListener:
    def __init__(self, host: str, port: int, codec: Codec, registry: Registry, waiters: KvWaiters,
                 metrics: ProxyMetrics, name_hosts: tuple[str, ...] = ()) -> None:
        self._host = host
        self._name_hosts = name_hosts or (host,)  # the hosts instances dial us by; the port is known once bound
        self._requested_port = port
        self._codec = codec
        self._registry = registry
        self._waiters = waiters
        self._metrics = metrics
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._rejections = RejectionLog(logger, "proxy control socket", _WARN_EVERY_S)
        self._used_names: collections.OrderedDict[str, str] = collections.OrderedDict()  # instance_id -> name
        self.port = 0

    @property
    def address(self) -> str:
        return f"tcp://{self._host}:{self.port}"

    @property
    def names(self) -> tuple[str, ...]:
        """The names instances may address us by (``host:port``; empty before start)."""
        return tuple(f"{host}:{self.port}" for host in self._name_hosts) if self.port else ()

    def name_for(self, instance_id: str) -> str | None:
        """The name ``instance_id`` addresses us by (our first name until we heard from it; None
        before start: the codec's identity)."""
        return self._used_names.get(instance_id) or next(iter(self.names), None)

    def start(self) -> None:
        """Bind (port 0: an ephemeral port, see ``.port``) and start receiving."""
        if self._closed:
            raise ClosedError("control listener is closed")
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._sock = sock
        try:
            if self._requested_port == 0:
                self.port = sock.bind_to_random_port(f"tcp://{self._host}")
            else:
                sock.bind(f"tcp://{self._host}:{self._requested_port}")
                self.port = self._requested_port
        except zmq.ZMQError as exc:
            self._close_socket()
            raise OSError(f"cannot bind the control socket tcp://{self._host}:{self._requested_port} "
                          f"(--control-host/--control-port): {exc}") from exc
        # Shared with the canceller, which signs as one of them: set before any frame is read or sent.
        self._codec.names = frozenset(self.names)
        # Frames stamped before now were meant for an earlier incarnation on this address.
        self._codec.refuse_stamped_before(time.time())
        self._task = asyncio.get_running_loop().create_task(self._run(), name="proxy-control")
        logger.info("control socket listening on %s", self.address)

    async def close(self) -> None:
        """Idempotent; safe after a failed start."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=_CLOSE_TIMEOUT_S)
        self._close_socket()

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def _run(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart(copy=True)
            try:
                self.handle(frames)
            except Exception:  # one bad message must not stop the listener
                logger.exception("control message handling failed")

    def handle(self, frames: list[bytes]) -> None:
        """Authenticate, decode and dispatch one message (public for tests)."""
        try:
            env = self._codec.open(frames)
            self._dispatch(env.msg)
            if isinstance(env.msg, Announce) and env.recipient:
                self._remember_name(env.msg.instance_id, env.recipient)
        except ProtocolError as exc:
            self._reject(rejection_of(exc), exc)

    def _remember_name(self, instance_id: str, name: str) -> None:
        self._used_names[instance_id] = name
        self._used_names.move_to_end(instance_id)
        while len(self._used_names) > _NAMES_REMEMBERED:
            self._used_names.popitem(last=False)

    def _dispatch(self, msg: object) -> None:
        match msg:
            case Announce():
                self._registry.announce(msg)
            case Goodbye():
                self._registry.goodbye(msg)
            case KvReady() | KvFailed():
                self._waiters.deliver(msg)
            case KvSent():
                self._metrics.report_prefiller(msg)
            case _:
                raise ProtocolError(f"{type(msg).__name__} is not a message for the proxy's control port")
        self._metrics.control_messages.labels(type(msg).__name__).inc()

    def _reject(self, reason: Rejection, exc: Exception) -> None:
        self._metrics.control_rejected.labels(reason.value).inc()
        self._rejections.log(reason, exc)
