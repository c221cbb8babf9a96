"""The proxy as a process: starts from flags, answers, and exits cleanly on SIGTERM / SIGINT."""

from __future__ import annotations

import signal

import httpx
import pytest

from .conftest import ProxyProcess

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_process_serves_and_exits_cleanly_on_signal(sig):
    proxy = ProxyProcess("--prefill", "http://127.0.0.1:1", "--summary-interval-s", "0")
    proc, url = proxy.proc, proxy.url
    try:
        health = httpx.get(url + "/health", timeout=5, trust_env=False).json()
        assert health["prefillers"] == 0 and health["decoders"] == 0  # nothing listens on :1: never healthy
        assert httpx.get(url + "/instances", timeout=5, trust_env=False).json() == []
        static, = httpx.get(url + "/instances?all=1", timeout=5, trust_env=False).json()
        assert static["http_url"] == "http://127.0.0.1:1" and static["health"] == "pending"
        assert static["routable"] is False
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0
        rest = proxy.rest_of_stderr()
        assert "shutting down" in rest and "Traceback" not in rest
    finally:
        proxy.kill()


@pytest.mark.anyio
async def test_accepted_http_connections_have_tcp_nodelay():
    """Small writes go out at once: without TCP_NODELAY a streamed chunk written after the response
    headers waited for the client's delayed ACK (~40 ms of TTFT). asyncio sets the option only on
    sockets accepted from a listener made with proto IPPROTO_TCP."""
    import asyncio
    import socket

    from lmcache_p2p.proxy.server import _bind

    accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    class Record(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            sock = transport.get_extra_info("socket")
            accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    listener = _bind("127.0.0.1", 0)
    server = await asyncio.get_running_loop().create_server(Record, sock=listener)
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", listener.getsockname()[1])
        assert await asyncio.wait_for(accepted, 5) != 0
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
