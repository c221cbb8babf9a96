"""The proxy as a process: starts from flags, answers, and exits cleanly on SIGTERM / SIGINT."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

pytestmark = pytest.mark.timeout(30)

_MAIN = """
import argparse, logging, sys
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
from lmcache_p2p.proxy.server import add_arguments, run
parser = argparse.ArgumentParser()
add_arguments(parser)
run(parser.parse_args(sys.argv[1:]))
"""


def start_proxy(*flags: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-c", _MAIN, "--port", "0", "--control-port", "0", *flags],
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    assert proc.stderr is not None
    for line in proc.stderr:
        if m := re.search(r"proxy on (http://127\.0\.0\.1:\d+), control tcp://127\.0\.0\.1:\d+", line):
            return proc, m.group(1)
        assert time.monotonic() < deadline, "proxy did not start"
    raise AssertionError(f"proxy exited with {proc.wait()}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_process_serves_and_exits_cleanly_on_signal(sig):
    proc, url = start_proxy("--prefill", "http://127.0.0.1:1", "--summary-interval-s", "0")
    try:
        health = httpx.get(url + "/health", timeout=5, trust_env=False).json()
        assert health["prefillers"] == 0 and health["decoders"] == 0  # nothing listens on :1: never healthy
        assert httpx.get(url + "/instances", timeout=5, trust_env=False).json() == []
        static, = httpx.get(url + "/instances?all=1", timeout=5, trust_env=False).json()
        assert static["http_url"] == "http://127.0.0.1:1" and static["health"] == "pending"
        assert static["routable"] is False
        proc.send_signal(sig)
        assert proc.wait(timeout=10) == 0
        rest = proc.stderr.read()
        assert "shutting down" in rest and "Traceback" not in rest
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()


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
