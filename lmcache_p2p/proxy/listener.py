"""The proxy's HTTP port: its listening socket, bound before anything starts, and the warm-up before anything
runs on the event loop. Used by the one process and by each relay worker (``relay/worker.py``).

It owns the socket's options. It must not serve anything (``server.py`` and the relay workers do).
"""

from __future__ import annotations

import socket


def bind_http(host: str, port: int, *, listen: bool = True, reuse_port: bool = False) -> socket.socket:
    """A listening socket (port 0: ephemeral); bound here so a busy port fails before anything starts.

    Made with ``IPPROTO_TCP`` explicitly: asyncio sets TCP_NODELAY only on accepted sockets whose
    proto says TCP (proto 0 is skipped). Without it, Nagle held each streamed chunk written after
    the response headers until the client's delayed ACK, which delayed a streaming client's first token.

    ``reuse_port`` (``--workers N``): SO_REUSEPORT, so that each relay worker listens on the port with
    its own socket and the kernel spreads new connections over them (one shared listening socket
    let the least busy process take nearly every connection). The coordinator holds the port with
    a socket that does not listen (``listen=False``): it gets no connections.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot bind the proxy's HTTP port {host}:{port} (--host/--port): {exc}") from exc
    if listen:
        sock.listen(2048)
    sock.setblocking(False)
    return sock


async def warm_up() -> None:
    """Before anything runs on the event loop: what would otherwise be imported at a first use on it, where every
    request, probe and control message waits for the import (seconds on a loaded machine): aiohttp, the client of
    every upstream call (a health probe's first), and anyio's asyncio backend, whose first use is Starlette's first
    ``StreamingResponse``, i.e. the first stream's first byte, in every process."""
    import aiohttp  # noqa: F401
    import anyio

    await anyio.sleep(0)
