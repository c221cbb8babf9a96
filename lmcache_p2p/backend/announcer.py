"""Reports to the proxy: Announce (start + heartbeat), KvReady / KvFailed, Goodbye.

Owned and called by exactly one thread (the backend's service thread): ZMQ sockets are not
thread-safe. Sends never block: a proxy that is down or slow costs a dropped heartbeat, never a
stuck engine. A dropped heartbeat is tried again soon (50 ms, doubling up to the interval), not a
whole interval later: the first one races the TCP connect (the socket queues nothing until the
proxy is connected), and an instance whose start announcement is lost stays unknown to the proxy.

Every frame is addressed to the proxy's control address as we dial it (``host:port`` of
``p2p.proxy_url``): under a shared secret a frame captured on its way to this proxy is refused by
any other, and a restarted proxy on the same address still takes ours.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq

from lmcache_p2p import protocol
from lmcache_p2p.config import ZMQ_HEARTBEAT_IVL_MS, ZMQ_HEARTBEAT_TIMEOUT_MS

_RETRY_FIRST_S = 0.05  # a dropped heartbeat is tried again this soon, the gap doubling up to the interval

logger = logging.getLogger(__name__)


class Announcer:
    def __init__(self, proxy_url: str | None, codec: protocol.Codec, interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._url = proxy_url
        self._clock = clock
        self.proxy_name = protocol.dialled_name(proxy_url) if proxy_url else ""  # the name we address it by
        self._codec = codec
        self._interval_s = interval_s
        self._next_heartbeat = 0.0
        self._last_heartbeat = -float("inf")
        self._retry_s = _RETRY_FIRST_S
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._dropped = 0
        if proxy_url:
            self._ctx = zmq.Context()
            self._sock = self._ctx.socket(zmq.PUSH)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)  # PUSH reads nothing; bound anyway
            self._sock.setsockopt(zmq.SNDHWM, 1000)
            self._sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing until the proxy is connected
            self._sock.setsockopt(zmq.HEARTBEAT_IVL, ZMQ_HEARTBEAT_IVL_MS)
            self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMQ_HEARTBEAT_TIMEOUT_MS)
            self._sock.connect(proxy_url)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, msg: protocol.Message) -> bool:
        if self._sock is None:
            return False
        try:
            self._sock.send_multipart(self._codec.pack(msg, self.proxy_name), flags=zmq.DONTWAIT)
            return True
        except zmq.Again:
            self._dropped += 1
            if self._dropped in (1, 10, 100) or self._dropped % 1000 == 0:
                logger.warning("proxy %s is not reachable: %d report(s) dropped so far", self._url, self._dropped)
            return False

    def heartbeat_due(self) -> bool:
        return self._sock is not None and self._clock() >= self._next_heartbeat

    def expedite(self, min_gap_s: float) -> None:
        """Make the next heartbeat due ``min_gap_s`` after the last one instead of a whole interval:
        news the proxy waits for (freed buffer credit) leaves at once, at most one per gap."""
        self._next_heartbeat = min(self._next_heartbeat, self._last_heartbeat + min_gap_s)

    def heartbeat(self, announce: protocol.Announce) -> bool:
        """Send ``announce`` and schedule the next one: an interval on, or soon if it was dropped."""
        self._last_heartbeat = self._clock()
        if self.send(announce):
            self._retry_s = _RETRY_FIRST_S
            self._next_heartbeat = self._last_heartbeat + self._interval_s
            return True
        self._next_heartbeat = self._last_heartbeat + min(self._retry_s, self._interval_s)
        self._retry_s = min(2 * self._retry_s, self._interval_s)
        return False

    def close(self, goodbye: protocol.Goodbye | None = None) -> None:
        if self._sock is None:
            return
        if goodbye is not None:
            self.send(goodbye)
            self._sock.setsockopt(zmq.LINGER, 200)  # give the goodbye a moment to leave
        self._sock.close()
        self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
