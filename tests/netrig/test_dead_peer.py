"""A decode stream from a host that falls off the network breaks at the proxy's dead-peer timeout
(``--dead-peer-timeout-s``: TCP keepalive + user timeout), as a broken stream that migrates, not
after ``--decode-idle-timeout-s`` of silence. The streaming server runs on rig host ``b``, the
proxy's upstream client on host ``a``; ``b``'s link is cut after a few events."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time

import pytest

from rig import NetRig, unavailable

REASON = unavailable()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.timeout(120)]

STREAMER = """
import asyncio, sys
async def handle(reader, writer):
    await reader.readuntil(b"\\r\\n\\r\\n")
    writer.write(b"HTTP/1.1 200 OK\\r\\ncontent-type: text/event-stream\\r\\ntransfer-encoding: chunked\\r\\n\\r\\n")
    event = b'data: {"choices": [{"index": 0, "text": "x", "token_ids": [1]}]}\\n\\n'
    while True:
        writer.write(b"%x\\r\\n%s\\r\\n" % (len(event), event))
        await writer.drain()
        await asyncio.sleep(0.2)
async def main():
    server = await asyncio.start_server(handle, sys.argv[1], 7200)
    await server.serve_forever()
asyncio.run(main())
"""


@pytest.fixture()
def rig():
    with NetRig(["a", "b"]) as built:
        server = subprocess.Popen(built.argv("b", [sys.executable, "-c", STREAMER, built.addr("b")]))
        try:
            _wait_listening(built, server)
            yield built
        finally:
            server.kill()
            server.wait(10)


def _wait_listening(rig: NetRig, server: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Until the streamer on ``b`` accepts a connection from ``a`` (a loaded CI machine can take
    seconds to start it; a fixed sleep made the test fail as unreachable before anything was cut)."""
    deadline = time.monotonic() + timeout_s
    with rig.inside("a"):
        while True:
            assert server.poll() is None, f"the streamer exited with {server.returncode}"
            try:
                socket.create_connection((rig.addr("b"), 7200), timeout=1.0).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


async def _stream_then_cut(rig: NetRig, dead_peer_timeout_s: float | None, idle_timeout_s: float) -> Exception:
    from lmcache_p2p.proxy.upstream import Upstream

    up = Upstream(connect_timeout_s=5.0, dead_peer_timeout_s=dead_peer_timeout_s)
    events = 0
    try:
        async with up.stream_events(f"http://{rig.addr('b')}:7200", "/v1/completions", {"prompt": [1]},
                                    idle_timeout_s=idle_timeout_s) as stream:
            async for _ in stream:
                events += 1
                if events == 3:
                    await asyncio.to_thread(rig.cut, "b")
    except Exception as exc:  # noqa: BLE001 - the error is what the test looks at
        return exc
    finally:
        await up.aclose()
    raise AssertionError(f"the stream ended without an error after {events} events")


def test_a_stream_from_a_cut_host_breaks_as_unreachable_at_the_dead_peer_timeout(rig):
    from lmcache_p2p.proxy.errors import UpstreamUnreachable

    with rig.inside("a"):
        exc = asyncio.run(_stream_then_cut(rig, dead_peer_timeout_s=3.0, idle_timeout_s=60.0))
    assert isinstance(exc, UpstreamUnreachable), repr(exc)


def test_without_it_only_the_idle_timeout_ends_the_stream(rig):
    from lmcache_p2p.proxy.errors import UpstreamTimeout

    with rig.inside("a"):
        exc = asyncio.run(_stream_then_cut(rig, dead_peer_timeout_s=None, idle_timeout_s=6.0))
    assert isinstance(exc, UpstreamTimeout), repr(exc)
