"""The proxy's control PULL socket, as a backend service test sees it: what the service reports."""

from __future__ import annotations

import time
from typing import Any

import zmq

from lmcache_p2p import protocol


class FakeProxy:
    """The proxy's control PULL socket: what the service reports."""

    def __init__(self, port: int = 0) -> None:
        """Bind ``port`` on loopback, or any free one."""
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        if port:
            self._sock.bind(f"tcp://127.0.0.1:{port}")
        else:
            port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.url = f"tcp://127.0.0.1:{port}"
        self._codec = protocol.Codec()

    def recv(self, kind: type, timeout_s: float = 10.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self._sock.poll(left_ms):
                raise AssertionError(f"the proxy got no {kind.__name__} within {timeout_s}s")
            msg = self._codec.unpack(self._sock.recv_multipart())
            if isinstance(msg, kind):
                return msg

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()
