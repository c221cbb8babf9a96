"""HTTP calls to prefillers and decoders, with deadlines, mapped to :mod:`lmcache_p2p.proxy.errors`.

One ``aiohttp`` session per proxy for every upstream call: health probes, JSON calls and decode
streams (connection reuse; no pool limit, so the proxy never queues requests the instances could
take), and one map of aiohttp's exceptions to the proxy's (:func:`_mapped`). aiohttp rather than
httpx: per call and per stream read it costs the proxy less CPU and latency on loopback
(``bench/proxy_client.py``), and a prefill call is on every request's TTFT while a stream read is
on every token's path. Every call has a deadline: ``post_json`` / ``get_json`` a total one,
``get_status`` one per phase (connect, then the answer), ``stream_events`` a connect timeout plus an
idle timeout between bytes. An upstream 4xx keeps its status and body; a 5xx becomes 502; an
unreachable instance 502; a deadline 504. A connection that was never established (refused,
connect timeout) raises :class:`UpstreamConnectError`: the instance received nothing, so the caller
may send the same call elsewhere.

A decode stream is the proxy's hot path (every output token passes through it): its bytes are
split into SSE events here, per read, and the token events one read brought are merged into one
event (``coalesce``), so a proxy that lags behind its decoder writes one chunk per read to the
client instead of one per token, and catches up. Nothing waits to be merged: a read with one
event yields that event at once.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import msgspec

from lmcache_p2p.proxy.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamMalformed,
    UpstreamStatus,
    UpstreamTimeout,
    UpstreamUnreachable,
    error_body,
)

logger = logging.getLogger(__name__)

_FORWARDED_HEADERS = ("authorization",)
# An idle pooled connection is let go this long after its answer was read. vLLM's server (uvicorn) closes its end
# 5 s after it wrote the answer (VLLM_HTTP_TIMEOUT_KEEP_ALIVE); a call that goes out on a connection as the
# instance closes it is reset, and a reset decode is moved to another instance, which computes the prompt again.
# The margin covers a busy proxy that reads an answer's end late and takes the connection again late (CI saw
# such a reset with a 1 s margin).
_KEEPALIVE_S = 2.0
REQUEST_ID_HEADER = "X-Request-Id"  # vLLM names a request after it (cmpl-{id}-{prompt index}-{8 random})


def forwarded_headers(client_headers: Mapping[str, str]) -> dict[str, str]:
    """Client headers an instance needs too (its API key)."""
    return {k: v for k in _FORWARDED_HEADERS if (v := client_headers.get(k))}


def with_request_id(headers: Mapping[str, str], request_id: str | None) -> Mapping[str, str]:
    """``headers`` and, when given, the ``X-Request-Id`` the instance names its request after."""
    return headers if request_id is None else {**headers, REQUEST_ID_HEADER: request_id}


class Upstream:
    def __init__(self, connect_timeout_s: float, dead_peer_timeout_s: float | None = None) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._dead_peer_timeout_s = dead_peer_timeout_s  # None: the kernel's (hours)
        self._aio: Any = None  # aiohttp.ClientSession, made on first use (see _session)

    async def aclose(self) -> None:
        if self._aio is not None:
            await self._aio.close()

    async def post_json(self, base_url: str, path: str, body: dict[str, Any], *, timeout_s: float,
                        headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        return await self._call("POST", base_url, path, body, timeout_s, headers)

    async def get_json(self, base_url: str, path: str, *, timeout_s: float) -> dict[str, Any]:
        return await self._call("GET", base_url, path, None, timeout_s, None)

    async def get_status(self, base_url: str, path: str, *, timeout_s: float) -> int:
        """GET ``path`` for its HTTP status alone (a health probe); every phase bounded by ``timeout_s``."""
        import aiohttp  # lazy: the proxy alone needs it

        url = base_url + path
        timeout = aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_connect=timeout_s, sock_read=timeout_s)
        with _mapped(f"GET {url}", f"no answer within {timeout_s:.1f} s"):
            async with self._session().get(url, timeout=timeout) as resp:
                await resp.read()  # the connection goes back to the pool
                return resp.status

    async def get_text(self, base_url: str, path: str, *, timeout_s: float) -> str:
        """GET ``path``'s text (an instance's Prometheus ``/metrics``); a status >= 400 raises."""
        import aiohttp  # lazy: the proxy alone needs it

        url = base_url + path
        timeout = aiohttp.ClientTimeout(total=timeout_s, connect=timeout_s, sock_connect=timeout_s)
        with _mapped(f"GET {url}", f"no answer within {timeout_s:.1f} s"):
            async with self._session().get(url, timeout=timeout) as resp:
                status, content = resp.status, await resp.read()
        if status >= 400:
            raise _status_error(url, status, content)
        return content.decode(errors="replace")

    async def _call(self, method: str, base_url: str, path: str, body: dict[str, Any] | None, timeout_s: float,
                    headers: Mapping[str, str] | None) -> dict[str, Any]:
        """One JSON call (a prefill, ``/tokenize``): on every request's TTFT."""
        import aiohttp  # lazy: the proxy alone needs it

        url = base_url + path
        content = msgspec.json.encode(body) if body is not None else None
        c = min(self._connect_timeout_s, timeout_s)
        timeout = aiohttp.ClientTimeout(total=timeout_s, connect=c, sock_connect=c)
        with _mapped(f"{method} {url}", f"no answer within {timeout_s:.1f} s"):
            # ``total`` bounds the whole call, the answer's body included
            async with self._session().request(method, url, data=content, headers=_json_headers(headers),
                                               timeout=timeout) as resp:
                status, answer = resp.status, await resp.read()
        if status >= 400:
            raise _status_error(url, status, answer)
        return _decode_object(url, answer)

    @asynccontextmanager
    async def stream_events(self, base_url: str, path: str, body: dict[str, Any] | msgspec.Raw, *,
                            idle_timeout_s: float, headers: Mapping[str, str] | None = None
                            ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """POST a streaming request; yields an iterator over its SSE ``data:`` events (JSON objects).
        ``body``: JSON, or its bytes already encoded (``msgspec.Raw``: sent as they are).

        A decode stream is read once per decoder write, so the client's cost per read matters
        (aiohttp: C parser, one ``iter_any`` step). Leaving the context closes the connection unless
        the stream was read to its end, which makes vLLM abort the request.
        """
        import aiohttp  # lazy: the proxy alone needs it

        url = base_url + path
        c = self._connect_timeout_s
        timeout = aiohttp.ClientTimeout(total=None, connect=c, sock_connect=c, sock_read=idle_timeout_s)
        with _mapped(f"POST {url}", f"no answer within {idle_timeout_s:.1f} s"):
            resp = await self._session().post(url, data=msgspec.json.encode(body), headers=_json_headers(headers),
                                              timeout=timeout)
        try:
            if resp.status >= 400:
                raise _status_error(url, resp.status, await _read_body(url, resp))
            yield _sse_events(url, _chunks(url, resp, idle_timeout_s))
        finally:
            if resp.content.at_eof():
                resp.release()  # read to its end: the connection goes back to the pool
            else:
                resp.close()

    def _session(self) -> Any:
        """The aiohttp session of every upstream call (made on first use: it belongs to the running loop)."""
        if self._aio is None:
            import aiohttp

            self._aio = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=_KEEPALIVE_S,
                                               socket_factory=dead_peer_sockets(self._dead_peer_timeout_s)),
                trust_env=False, auto_decompress=False)  # never through an environment proxy; SSE is not compressed
        return self._aio


KEEPALIVE_PROBES = 5


def dead_peer_sockets(timeout_s: float | None) -> Callable[[tuple], socket.socket] | None:
    """A socket factory whose connections close once the peer acknowledged nothing for ``timeout_s``.

    A host that falls off the network (link down, partition) sends no FIN or RST: without this, a
    decode stream from it stays open until ``--decode-idle-timeout-s`` and a call sent on a pooled
    connection until its own deadline. TCP keepalive probes start after half of ``timeout_s`` of
    silence; ``TCP_USER_TIMEOUT`` closes the connection when probes or sent data stay unacknowledged
    for ``timeout_s``. A live instance that is only slow to answer acknowledges the probes (its
    kernel does), so nothing is cut for being slow.
    """
    if timeout_s is None:
        return None
    idle_s = max(1, int(timeout_s / 2))
    interval_s = max(1, int(timeout_s / 2 / KEEPALIVE_PROBES))

    def make(addr_info: tuple) -> socket.socket:
        family, type_, proto, _, _ = addr_info
        sock = socket.socket(family=family, type=type_, proto=proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", idle_s), ("TCP_KEEPINTVL", interval_s), ("TCP_KEEPCNT", KEEPALIVE_PROBES),
                            ("TCP_USER_TIMEOUT", int(timeout_s * 1000))):
            if hasattr(socket, name):  # Linux; elsewhere the kernel's keepalive defaults stay
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
        return sock

    return make


@contextmanager
def _mapped(what: str, timed_out: str) -> Iterator[None]:
    """aiohttp's exceptions as the proxy's, for every upstream call: ``what`` names the call (method
    and URL), ``timed_out`` what a deadline means for it."""
    import aiohttp

    try:
        yield
    except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
        raise UpstreamConnectError(f"{what}: {_describe(exc)}") from exc
    except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
        raise UpstreamTimeout(f"{what}: {timed_out}") from exc
    except (aiohttp.ClientError, ValueError) as exc:  # ValueError: aiohttp's for a malformed URL
        raise UpstreamUnreachable(f"{what}: {_describe(exc)}") from exc


async def _read_body(url: str, resp: Any) -> bytes:
    """The body of an error answer; one that stalls is the broken answer it is (502), not a deadline."""
    try:
        with _mapped(f"POST {url}: answered {resp.status}, then", "its body stalled"):
            return await resp.read()
    except UpstreamTimeout as exc:
        raise UpstreamUnreachable(str(exc)) from exc


async def _chunks(url: str, resp: Any, idle_timeout_s: float) -> AsyncIterator[bytes]:
    """The stream's bytes as they arrive, its failures mapped to the proxy's errors."""
    with _mapped(f"POST {url}: stream broke", f"stream silent for {idle_timeout_s:.1f} s (--decode-idle-timeout-s)"):
        async for chunk in resp.content.iter_any():
            yield chunk


async def _sse_events(url: str, chunks: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any]]:
    """The stream's ``data:`` events; the token events of one read are merged into one (``coalesce``).

    Bytes are split into events here, per read (a line iterator costs a generator step per line);
    an event cut across reads waits for its end.
    """
    lines = SseLines()
    async for chunk in chunks:
        pending: list[dict[str, Any]] = []
        for data in lines.feed(chunk):
            if data == b"[DONE]":
                for event in coalesce(pending):
                    yield event
                return
            event = _decode_object(url, data)
            if "error" in event and "choices" not in event:
                for merged in coalesce(pending):
                    yield merged
                raise _stream_error(url, event)
            pending.append(event)
        for event in coalesce(pending):
            yield event


class SseLines:
    """Splits an SSE byte stream, read in arbitrary pieces, into the payloads of its ``data:`` lines.

    Line ends may be ``\n``, ``\r\n`` or ``\r`` (the SSE spec's three); a line cut across pieces is
    kept until its end arrives. Each ``data:`` line is one event (vLLM writes one per event).
    """

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r", b"\n")  # "\r\n" becomes an empty line too: harmless
        lines = (self._rest + chunk).split(b"\n") if self._rest else chunk.split(b"\n")
        self._rest = lines.pop()
        return [line[5:].strip() for line in lines if line.startswith(b"data:")]


_LOGPROB_LISTS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def coalesce(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive completion token events merged into one, as vLLM's own output collector merges the
    deltas a slow client has not taken yet: one event with the tokens' text, ids and logprobs in
    order and the last one's finish. Only events already read are merged (no wait, no added
    latency); a usage or unusual event is kept apart, in order."""
    if len(events) < 2:
        return events
    out = [events[0]]
    for event in events[1:]:
        if not _merge_into(out[-1], event):
            out.append(event)
    return out


def _merge_into(into: dict[str, Any], event: dict[str, Any]) -> bool:
    """Append ``event``'s one choice to ``into``'s; False (nothing changed) when they do not merge."""
    a, b = _token_choice(into), _token_choice(event)
    if a is None or b is None or a.get("finish_reason") is not None:
        return False
    if ("token_ids" in a) != ("token_ids" in b) or set(a) - _CHOICE_KEYS or set(b) - _CHOICE_KEYS:
        return False
    la, lb = a.get("logprobs"), b.get("logprobs")
    if (la is None) != (lb is None) or (la is not None and not _mergeable_logprobs(la, lb)):
        return False
    a["text"] = (a.get("text") or "") + (b.get("text") or "")
    if "token_ids" in a:
        a["token_ids"] = list(a["token_ids"] or ()) + list(b["token_ids"] or ())
    if la is not None:
        a["logprobs"] = {k: list(la.get(k) or ()) + list(lb.get(k) or ()) for k in _LOGPROB_LISTS}
    a["finish_reason"] = b.get("finish_reason")
    a["stop_reason"] = b.get("stop_reason")
    return True


_CHOICE_KEYS = frozenset({"index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids",
                          "prompt_token_ids", "prompt_logprobs"})


def _token_choice(event: dict[str, Any]) -> dict[str, Any] | None:
    """The one completion choice of a plain token event (no usage, no other field), else None."""
    choices = event.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or event.get("usage") is not None:
        return None
    choice = choices[0]
    if not isinstance(choice, dict) or choice.get("index", 0) != 0 or not isinstance(choice.get("text", ""), str):
        return None
    return choice


def _mergeable_logprobs(a: Any, b: Any) -> bool:
    keys = set(_LOGPROB_LISTS)
    return (isinstance(a, dict) and isinstance(b, dict) and set(a) <= keys and set(b) <= keys
            and all(isinstance(v, list) for v in (*a.values(), *b.values())))


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc or 'connection failed'}"


def _json_headers(extra: Mapping[str, str] | None) -> dict[str, str]:
    return {"content-type": "application/json", **(extra or {})}


def _decode_object(url: str, content: bytes) -> dict[str, Any]:
    try:
        value = msgspec.json.decode(content)
    except msgspec.DecodeError as exc:
        raise UpstreamMalformed(f"{url} answered with invalid JSON: {content[:200]!r}") from exc
    if not isinstance(value, dict):
        raise UpstreamMalformed(f"{url} answered with JSON that is not an object: {content[:200]!r}")
    return value


def _status_error(url: str, status: int, content: bytes) -> UpstreamError:
    try:
        body = msgspec.json.decode(content)
    except msgspec.DecodeError:
        body = None
    message = _error_message(body) or content[:500].decode(errors="replace")
    if 400 <= status < 500:
        passthrough = body if isinstance(body, dict) and "error" in body else error_body(message, "BadRequestError",
                                                                                           status)
        return UpstreamStatus(f"{url} answered {status}: {message}", status_code=status, body=passthrough)
    return UpstreamStatus(f"{url} answered {status}: {message}", status_code=502)


def _stream_error(url: str, event: dict[str, Any]) -> UpstreamError:
    code = event["error"].get("code") if isinstance(event["error"], dict) else None
    status = code if isinstance(code, int) and 400 <= code < 500 else 502
    return UpstreamStatus(f"{url} stream error: {_error_message(event)}", status_code=status,
                          body=event if status < 500 else None)


def _error_message(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        if err is not None:
            return str(err)
        if "detail" in body:
            return str(body["detail"])
    return ""

