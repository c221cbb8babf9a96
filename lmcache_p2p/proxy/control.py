"""The proxy's control socket: a ZMQ PULL where instances push Announce, Goodbye, KvReady, KvFailed,
KvSent (a prefiller's times for the request timeline).

Frames are checked and decoded by :class:`lmcache_p2p.protocol.Codec` (shared secret optional).
A frame that fails authentication (wrong tag, replayed, stale), is oversized, or fails decoding
or validation is dropped, counted in ``lmcache_p2p_proxy_control_rejected_total{reason}`` (reason:
auth, replay, stale, oversized, malformed, version) and logged (WARNING at most every
``_WARN_EVERY_S`` per reason, with the count since). PUSH/PULL has no replies.
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from lmcache_p2p.errors import ClosedError, ProtocolError
from lmcache_p2p.protocol import (MAX_MESSAGE_BYTES, Announce, Codec, Goodbye, KvFailed, KvReady, KvSent, Rejection,
                                  RejectionLog, rejection_of)
from lmcache_p2p.proxy.observe.metrics import ProxyMetrics
from lmcache_p2p.proxy.router.registry import Registry
from lmcache_p2p.proxy.handover.waiters import KvWaiters

logger = logging.getLogger(__name__)

_WARN_EVERY_S = 10.0
_CLOSE_TIMEOUT_S = 2.0


class ControlListener:
    def __init__(self, host: str, port: int, codec: Codec, registry: Registry, waiters: KvWaiters,
                 metrics: ProxyMetrics) -> None:
        self._host = host
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
        self.port = 0

    @property
    def address(self) -> str:
        return f"tcp://{self._host}:{self.port}"

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
            msg = self._codec.unpack(frames)
            self._dispatch(msg)
        except ProtocolError as exc:
            self._reject(rejection_of(exc), exc)

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
