"""The proxy's JSON calls to instances: answers decoded, every failure mapped to the error its caller
acts on (a connection never made may go elsewhere; a broken one may not be resent blindly)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import pytest

from lmcache_p2p.proxy.errors import (
    UpstreamConnectError,
    UpstreamMalformed,
    UpstreamStatus,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from lmcache_p2p.proxy.upstream import Upstream

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")),
                  0)
    return await reader.readexactly(length)


def _answer(status: int, body: bytes) -> bytes:
    return (f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body)


def _answers_once_then_silent(answer: bytes, connections: list[int]) -> Handler:
    """A server that answers its first request and none after it, on any connection (each counted in
    ``connections``). A deadline test calls it twice: the second call rides the first's pooled
    connection, so its deadline can only pass waiting for the answer, however long a loaded machine
    takes to open a connection (a connect past the deadline is a connect error, which is not the case
    under test)."""
    answered = False

    async def handler(reader, writer) -> None:
        nonlocal answered
        connections.append(1)
        try:
            while True:
                await _read_request(reader)
                if answered:
                    await asyncio.sleep(10)
                    return
                answered = True
                writer.write(answer)
                await writer.drain()
        except asyncio.IncompleteReadError:
            return  # the client closed the connection

    return handler


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[str]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> str:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    yield start
    for server in servers:
        server.close()


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream(connect_timeout_s=2.0)
    yield up
    await up.aclose()


async def test_an_answer_comes_back_decoded_and_the_body_went_out_as_json(serve, upstream) -> None:
    seen: list[bytes] = []

    async def handler(reader, writer) -> None:
        while True:  # one connection, reused by the second call
            try:
                seen.append(await _read_request(reader))
            except asyncio.IncompleteReadError:
                return
            writer.write(_answer(200, b'{"choices": [{"token_ids": [7]}]}'))
            await writer.drain()

    url = await serve(handler)
    for _ in range(2):
        got = await upstream.post_json(url, "/v1/completions", {"prompt": [1, 2, 3]}, timeout_s=5)
        assert got == {"choices": [{"token_ids": [7]}]}
    assert [msgspec.json.decode(b) for b in seen] == [{"prompt": [1, 2, 3]}] * 2


async def test_a_refused_connection_is_a_connect_error(upstream) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(UpstreamConnectError, match=f"POST http://127.0.0.1:{port}/v1/completions"):
        await upstream.post_json(f"http://127.0.0.1:{port}", "/v1/completions", {}, timeout_s=5)


async def test_a_connection_that_breaks_after_the_request_is_not_a_connect_error(serve, upstream) -> None:
    async def handler(reader, writer) -> None:
        await _read_request(reader)
        writer.close()  # the instance died with the request in hand

    url = await serve(handler)
    with pytest.raises(UpstreamUnreachable) as caught:
        await upstream.post_json(url, "/v1/completions", {}, timeout_s=5)
    assert not isinstance(caught.value, UpstreamConnectError)  # it may have been received: never resent blindly


async def test_no_answer_within_the_deadline_is_a_timeout(serve, upstream) -> None:
    connections: list[int] = []
    url = await serve(_answers_once_then_silent(_answer(200, b"{}"), connections))
    assert await upstream.post_json(url, "/v1/completions", {}, timeout_s=5) == {}
    with pytest.raises(UpstreamTimeout, match="no answer within 0.3 s"):
        await upstream.post_json(url, "/v1/completions", {}, timeout_s=0.3)
    assert len(connections) == 1


@pytest.mark.parametrize("status, error_status", [(400, 400), (404, 404), (500, 502), (503, 502)])
async def test_an_http_error_keeps_a_4xx_and_makes_a_5xx_a_502(serve, upstream, status, error_status) -> None:
    async def handler(reader, writer) -> None:
        await _read_request(reader)
        writer.write(_answer(status, b'{"error": {"message": "max_tokens is too large"}}'))
        await writer.drain()

    url = await serve(handler)
    with pytest.raises(UpstreamStatus, match="max_tokens is too large") as caught:
        await upstream.post_json(url, "/v1/completions", {}, timeout_s=5)
    assert caught.value.status_code == error_status


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]"])
async def test_an_answer_that_is_not_a_json_object_is_malformed(serve, upstream, body) -> None:
    async def handler(reader, writer) -> None:
        await _read_request(reader)
        writer.write(_answer(200, body))
        await writer.drain()

    url = await serve(handler)
    with pytest.raises(UpstreamMalformed):
        await upstream.post_json(url, "/v1/completions", {}, timeout_s=5)


async def test_a_cancelled_call_closes_its_connection(serve, upstream) -> None:
    """A client that leaves mid-prefill: the instance sees the connection close (vLLM aborts the request)."""
    received, closed = asyncio.Event(), asyncio.Event()

    async def handler(reader, writer) -> None:
        await _read_request(reader)
        received.set()
        if await reader.read(1) == b"":
            closed.set()

    url = await serve(handler)
    call = asyncio.ensure_future(upstream.post_json(url, "/v1/completions", {}, timeout_s=30))
    await asyncio.wait_for(received.wait(), 10)  # cancelled before it was sent, nothing would reach the instance
    call.cancel()
    await asyncio.wait_for(closed.wait(), 10)


async def test_a_health_probe_reports_the_status_and_maps_failures_as_every_call(serve, upstream) -> None:
    async def handler(reader, writer) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 503 X\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()

    assert await upstream.get_status(await serve(handler), "/health", timeout_s=5) == 503
    connections: list[int] = []
    silent_after_one = await serve(_answers_once_then_silent(_answer(200, b""), connections))
    assert await upstream.get_status(silent_after_one, "/health", timeout_s=5) == 200
    with pytest.raises(UpstreamTimeout, match="no answer within 0.3 s"):
        await upstream.get_status(silent_after_one, "/health", timeout_s=0.3)
    assert len(connections) == 1
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(UpstreamConnectError, match=f"GET http://127.0.0.1:{port}/health"):
        await upstream.get_status(f"http://127.0.0.1:{port}", "/health", timeout_s=5)


def test_upstream_sockets_give_up_on_a_peer_that_acknowledges_nothing() -> None:
    from lmcache_p2p.proxy.upstream import dead_peer_sockets

    assert dead_peer_sockets(None) is None  # the kernel's defaults
    make = dead_peer_sockets(10.0)
    sock = make((socket.AF_INET, socket.SOCK_STREAM, 0, "", ("127.0.0.1", 1)))
    try:
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 10000
        idle = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
        probes = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)
        interval = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL)
        assert idle + probes * interval <= 10  # the probes end within the timeout
    finally:
        sock.close()
