"""The relay worker's link to its coordinator (``--workers N``): HTTP on the coordinator's Unix socket,
msgspec JSON (``relay/messages.py``); the ``open`` answer read line by line; step reports that
nothing waits for sent in tasks, in order; other endpoints passed through.

It owns the connection and the retries of reports. It must not decide anything about a request:
the worker's flow (``relay/worker.py``) says what to send, the coordinator answers.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

import aiohttp
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from lmcache_p2p.proxy.errors import ProxyError
from lmcache_p2p.proxy.http.shaping import ClientRequest
from lmcache_p2p.proxy.http.tokenizer import ProxyTokenizer, load_tokenizer
from lmcache_p2p.proxy.relay.messages import (
    PREFIX,
    PROTOCOL_VERSION,
    VERSION_HEADER,
    Failed,
    Open,
    Opened,
    PlanFailed,
    Planned,
    Target,
    WirePlanLine,
    WirePlanned,
)

logger = logging.getLogger(__name__)

M = TypeVar("M")
_PASSED_HEADERS = ("authorization", "content-type")
_ANSWER_HEADERS = ("content-type", "www-authenticate")
_LINK_ERRORS = (aiohttp.ClientError, TimeoutError)
_RETRY_BACKOFF_S = 0.1  # before the second attempt; doubled before each next one


class RelayedError(ProxyError):
    """An error the coordinator answered; keeps its status, body and class name (errors_total{type})."""

    def __init__(self, failed: Failed, status_code: int) -> None:
        error = failed.body.get("error") if isinstance(failed.body, dict) else None
        message = str(error.get("message")) if isinstance(error, dict) else str(failed.body)
        super().__init__(message, status_code=status_code, body=failed.body)
        self.relayed_name = failed.name


class CoordinatorLink:
    """HTTP to the coordinator's Unix socket; step reports that nothing waits for go in tasks, in order.

    On aiohttp, as the proxy's calls to instances: three calls per request (open, started, closed),
    so the client library's per-call cost is on every request's TTFT (open) and on the relay's CPU."""

    def __init__(self, uds_path: str, worker: int, timeout_s: float) -> None:
        self.worker = worker
        self.tokenizers = Tokenizers()
        self._uds_path = uds_path
        self._timeout_s = timeout_s
        self._session: Any = None  # aiohttp.ClientSession, made on first use (it belongs to the running loop)
        self._tasks: set[asyncio.Task[Any]] = set()

    def _client(self) -> Any:
        if self._session is None:
            t = self._timeout_s  # to connect and between reads: an open answer waits for the KV between its lines
            self._session = aiohttp.ClientSession(
                base_url="http://coordinator", connector=aiohttp.UnixConnector(path=self._uds_path, limit=0),
                headers={VERSION_HEADER: str(PROTOCOL_VERSION)}, trust_env=False,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=t, sock_read=t))
        return self._session

    async def _post(self, step: str, msg: msgspec.Struct) -> tuple[int, bytes]:
        async with self._client().post(f"{PREFIX}/{step}", data=msgspec.json.encode(msg)) as resp:
            return resp.status, await resp.read()

    async def tokenizer(self, source: str, handle: str) -> ProxyTokenizer:
        return await self.tokenizers.get(source)

    async def call(self, step: str, msg: msgspec.Struct) -> Planned:
        """A step answered with where the decode goes (``unreachable``, ``broken``)."""
        return (await self.ask(step, msg, WirePlanned)).planned()

    async def ask(self, step: str, msg: msgspec.Struct, answer: type[M]) -> M:
        try:
            status, content = await self._post(step, msg)
        except _LINK_ERRORS as exc:  # the coordinator is gone or stuck: a worker cannot serve alone
            raise self._unanswered(step, exc) from exc
        if status != 200:
            raise _relayed(status, content)
        return msgspec.json.decode(content, type=answer)

    async def open(self, handle: str, req: ClientRequest, headers: Mapping[str, str],
                   received_s: float) -> tuple[Opened, OpenAnswer]:
        """``open``: its first line (the prefill's first token) now; the rest of the answer (where the decode
        goes) stays to be read from the returned ``OpenAnswer``, which the caller closes."""
        msg = Open(handle, self.worker, req.endpoint.value, msgspec.Raw(msgspec.json.encode(req.body)), dict(headers),
                   received_s)
        try:
            resp = await self._client().post(f"{PREFIX}/open", data=msgspec.json.encode(msg))
        except _LINK_ERRORS as exc:
            raise self._unanswered("open", exc) from exc
        if resp.status != 200:
            try:
                content = await resp.read()
            except _LINK_ERRORS as exc:
                raise self._unanswered("open", exc) from exc
            finally:
                resp.release()
            raise _relayed(resp.status, content)
        answer = OpenAnswer(self, resp)
        try:
            return await answer.opened(), answer
        except BaseException:
            await answer.aclose()
            raise

    def _unanswered(self, step: str, exc: BaseException) -> ProxyError:
        return ProxyError(f"relay worker {self.worker}: the coordinator did not answer {step} "
                          f"({type(exc).__name__}: {exc})", status_code=503)

    async def tell(self, step: str, msg: msgspec.Struct, attempts: int = 1) -> None:
        """A report nothing waits on the answer of; a coordinator that does not take it is logged.

        A link error (no answer within --coordinator-timeout-s, a connection dropped) is sent again, up
        to ``attempts`` sends, after ``_RETRY_BACKOFF_S`` doubled each time: "closed" goes with
        ``client_flow.CLOSED_ATTEMPTS``, since until the coordinator takes it the request's lease (load, decoder
        credit) stays there. A send that did arrive (only its answer was lost) is harmless: the
        coordinator ignores a "closed" of a handle it already closed. A refusal (status >= 400) is
        final. After the last failed send the lease is returned when this worker exits (the coordinator
        closes a dead worker's requests): the coordinator has then not answered ``attempts`` times in a
        row, the judgement by which open fails requests with 503."""
        for attempt in range(1, attempts + 1):
            try:
                status, content = await self._post(step, msg)
            except _LINK_ERRORS as exc:
                logger.log(logging.ERROR if attempt == attempts else logging.WARNING,
                           "relay worker %d: the coordinator did not take %s (send %d of %d; %s: %s)",
                           self.worker, step, attempt, attempts, type(exc).__name__, exc)
                if attempt < attempts:
                    await asyncio.sleep(_RETRY_BACKOFF_S * 2 ** (attempt - 1))
                continue
            if status >= 400:
                logger.warning("the coordinator refused %s: %d %s", step, status, content[:300])
            return

    def tell_later(self, step: str, msg: msgspec.Struct | Callable[[], msgspec.Struct],
                   after: Collection[asyncio.Task[Any]] = (), answer: OpenAnswer | None = None,
                   attempts: int = 1) -> asyncio.Task[Any]:
        """Send in a task (never awaits here: safe in a cancelled task); after the tasks ``after`` (and
        after closing ``answer``); ``msg`` may be made when it goes; ``attempts``: as ``tell``."""
        task = asyncio.get_running_loop().create_task(self._tell_after(step, msg, after, answer, attempts),
                                                      name=f"relay-{step}")
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    async def _tell_after(self, step: str, msg: msgspec.Struct | Callable[[], msgspec.Struct],
                          after: Collection[asyncio.Task[Any]], answer: OpenAnswer | None, attempts: int) -> None:
        if answer is not None:
            await answer.aclose()
        if after:
            await asyncio.wait(after)
        await self.tell(step, msg if isinstance(msg, msgspec.Struct) else msg(), attempts)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("reporting to the coordinator failed: %r", task.exception())

    async def passthrough(self, request: Request) -> Response:
        headers = {k: v for k in _PASSED_HEADERS if (v := request.headers.get(k))}
        try:
            async with self._client().request(request.method, request.url.path,
                                              params=list(request.query_params.multi_items()),
                                              data=await request.body(), headers=headers) as resp:
                status, content, answer_headers = resp.status, await resp.read(), resp.headers
        except _LINK_ERRORS as exc:
            raise self._unanswered(request.url.path, exc) from exc
        return Response(content, status_code=status,
                        headers={k: v for k in _ANSWER_HEADERS if (v := answer_headers.get(k))})

    async def aclose(self) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5.0)
        if self._session is not None:
            await self._session.close()


class OpenAnswer:
    """The rest of an ``open`` answer (JSON lines): after ``Opened``, where the decode goes."""

    def __init__(self, link: CoordinatorLink, resp: Any) -> None:  # an aiohttp.ClientResponse
        self._link = link
        self._resp = resp
        self._chunks = resp.content.iter_any()
        self._buffer = b""
        self._closed = False

    async def opened(self) -> Opened:
        return msgspec.json.decode(await self._line("open"), type=Opened)

    async def plan(self) -> Target:
        """Where the first decode goes (the coordinator sends it once the KV is ready); raises its error."""
        try:
            line = msgspec.json.decode(await self._line("the decode's plan"), type=WirePlanLine)
        finally:
            await self.aclose()
        if isinstance(line, PlanFailed):
            raise RelayedError(line.failed, line.status)
        target = line.planned().target
        if target is None:
            raise ProxyError("the coordinator named no decoder")
        return target

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            if self._resp.content.at_eof():
                self._resp.release()  # read to its end: the connection goes back to the pool
            else:
                self._resp.close()  # the coordinator sees the request go (as with a client that left)

    async def _line(self, what: str) -> bytes:
        while b"\n" not in self._buffer:
            try:
                chunk = await self._chunks.__anext__()
            except StopAsyncIteration:
                raise ProxyError(f"relay worker {self._link.worker}: the coordinator ended its answer before "
                                 f"{what} (the request was closed there)", status_code=503) from None
            except _LINK_ERRORS as exc:
                raise self._link._unanswered(what, exc) from exc
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line


def _relayed(status: int, content: bytes) -> ProxyError:
    try:
        return RelayedError(msgspec.json.decode(content, type=Failed), status)
    except msgspec.DecodeError:
        return ProxyError(f"the coordinator answered {status}: {content[:300]!r}")


class Tokenizers:
    """The tokenizer the coordinator names, loaded once in this process (off the event loop)."""

    def __init__(self) -> None:
        self._loading: dict[str, asyncio.Task[ProxyTokenizer | None]] = {}
        self._import: asyncio.Task[Any] | None = None

    def prefetch(self) -> None:
        """Import ``transformers`` in a thread now (seconds): the first request then waits for the folder alone."""
        if self._import is None:
            self._import = asyncio.get_running_loop().create_task(
                asyncio.to_thread(importlib.import_module, "transformers"), name="relay-tokenizer-import")

    def preload(self, source: str) -> None:
        """Start loading ``source`` now (the proxy's --tokenizer folder), before the first request needs it."""
        if source not in self._loading:
            self._loading[source] = asyncio.get_running_loop().create_task(self._load(source), name="relay-tokenizer")

    async def get(self, source: str) -> ProxyTokenizer:
        self.preload(source)
        tokenizer = await asyncio.shield(self._loading[source])
        if tokenizer is None:
            raise ProxyError(f"this relay worker cannot load the coordinator's tokenizer {source}")
        return tokenizer

    async def _load(self, source: str) -> ProxyTokenizer | None:
        if self._import is not None:  # a second importing thread would see it half-initialized (http/tokenizer.py)
            await asyncio.wait({self._import})
        try:
            tokenizer = await asyncio.to_thread(load_tokenizer, source)
        except Exception as exc:
            logger.error("relay worker: cannot load the tokenizer from %s (%s: %s)", source, type(exc).__name__, exc)
            return None
        gc.freeze()  # as the coordinator does (http/tokenizer.py): full collections must not walk transformers' objects
        return tokenizer
