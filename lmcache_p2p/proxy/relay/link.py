"""The relay worker's link to its coordinator (``--workers N``): HTTP on the coordinator's Unix socket,
msgspec JSON (``relay/messages.py``); the ``open`` answer read line by line; step reports that
nothing waits for sent in tasks, in order; other endpoints passed through.

:class:`RemoteSteps` is one request's step API (``flow/steps.py``) in a relay worker: the only code that
turns steps into wire messages (the coordinator's ``relay/host.py`` turns them back into calls of the
request's ``RequestFlow``). :class:`CoordinatorLink` opens them (``flow.steps.RequestOwner``).

It owns the connection, the order of a request's reports and their retries. It must not decide
anything about a request: the client side (``flow/client.py``) says what to send, the coordinator
answers.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

import aiohttp
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from lmcache_p2p.proxy.errors import ProxyError, UpstreamConnectError, UpstreamError
from lmcache_p2p.proxy.flow.steps import Answer, Count, Opened, Target
from lmcache_p2p.proxy.http.shaping import ClientRequest
from lmcache_p2p.proxy.http.tokenizer import ProxyTokenizer
from lmcache_p2p.proxy.relay.messages import (
    PREFIX,
    PROTOCOL_VERSION,
    VERSION_HEADER,
    Failed,
    Open,
    PlanFailed,
    Planned,
    Step,
    WirePlanLine,
    WirePlanned,
)
from lmcache_p2p.proxy.relay.tokenizers import Tokenizers

logger = logging.getLogger(__name__)

M = TypeVar("M")
_PASSED_HEADERS = ("authorization", "content-type")
_ANSWER_HEADERS = ("content-type", "www-authenticate")
_LINK_ERRORS = (aiohttp.ClientError, TimeoutError)
_RETRY_BACKOFF_S = 0.1  # before the second attempt; doubled before each next one
CLOSED_ATTEMPTS = 5  # "closed" returns the request's lease: sent again after a link error


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

    def __init__(self, uds_path: str, worker: int, timeout_s: float, tokenizers: Tokenizers) -> None:
        self.worker = worker
        self.tokenizers = tokenizers
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

    def open(self, req: ClientRequest, headers: Mapping[str, str], received_s: float) -> RemoteSteps:
        return RemoteSteps(self, req, headers, received_s)

    def count(self, count: Count) -> None:
        self.tell_later("count", count)

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

    async def post_open(self, handle: str, req: ClientRequest, headers: Mapping[str, str],
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
        ``CLOSED_ATTEMPTS``, since until the coordinator takes it the request's lease (load, decoder
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


class RemoteSteps:
    """One request's steps on the coordinator (``flow/steps.py``), each a message on the link. The
    coordinator learns them in order: a step waits for the reports sent before it (``started``)."""

    def __init__(self, link: CoordinatorLink, req: ClientRequest, headers: Mapping[str, str],
                 received_s: float) -> None:
        self._link = link
        self._req = req
        self._headers = headers
        self._received_s = received_s
        self.handle = uuid.uuid4().hex  # the coordinator's name for it (it may be closed before open answers)
        self._opened: Opened | None = None
        self._answer: OpenAnswer | None = None  # the rest of open's answer: where the decode goes
        self._reports: list[asyncio.Task[Any]] = []  # sent in tasks; the coordinator must have them before "closed"
        self._closed = False
        self._closing: asyncio.Task[Any] | None = None

    async def prefill(self) -> Opened:
        opened, self._answer = await self._link.post_open(self.handle, self._req, self._headers, self._received_s)
        self._opened = opened
        if not opened.needs_decode:
            await self._answer.aclose()
        return opened

    async def tokenizer(self) -> ProxyTokenizer:
        source = self._opened.tokenizer if self._opened is not None else None
        if source is None:
            raise ProxyError(f"request {self.handle}: the coordinator named no tokenizer")
        return await self._link.tokenizers.get(source)

    async def plan(self) -> Target:
        if self._answer is None:
            raise RuntimeError("prefill() first")
        return await self._answer.plan()  # the coordinator sends it once the KV is ready: no call from here

    async def settled(self) -> Target | None:
        if self._answer is None:
            raise RuntimeError("prefill() first")
        return await self._answer.settled()  # the coordinator sends it once it is decided: no call from here

    async def unreachable(self, exc: UpstreamConnectError) -> Target | None:
        return await self._call("unreachable", Step(self.handle, message=str(exc)))

    async def broken(self, output_ids: list[int], finished: bool, rewound: int, exc: UpstreamError) -> Target | None:
        return await self._call("broken", Step(self.handle, output_ids=output_ids, finished=finished, rewound=rewound,
                                               connect_failed=isinstance(exc, UpstreamConnectError),
                                               message=str(exc)))

    def started(self, decode_sent_s: float, first_decoded_s: float, decode_accepted_s: float | None = None,
                kv_pending: bool = False) -> None:
        self._reports.append(self._link.tell_later(
            "started", Step(self.handle, decode_sent_s=decode_sent_s, first_decoded_s=first_decoded_s,
                            decode_accepted_s=decode_accepted_s, kv_pending=kv_pending)))

    async def end(self, answer: Answer) -> None:
        if self._closed:
            return
        self._closed = True
        if self._answer is not None:
            await self._answer.aclose()
        if self._reports:
            await asyncio.wait(self._reports)
        await self._link.tell("closed", self._closed_step(answer), CLOSED_ATTEMPTS)

    def close(self, answer: Answer) -> None:
        """Once: a second close (a late prefill's) has nothing to add, the coordinator closes a late open."""
        if self._closed:
            return
        self._closed = True
        self._closing = self._link.tell_later("closed", self._closed_step(answer), after=self._reports,
                                              answer=self._answer, attempts=CLOSED_ATTEMPTS)

    async def closing(self) -> None:
        if self._closing is not None:
            await asyncio.wait({self._closing})

    def _closed_step(self, answer: Answer) -> Step:
        return Step(self.handle, output_ids=answer.output_ids, first_byte_s=answer.first_byte_s, counts=answer.counts)

    async def _call(self, step: str, msg: Step) -> Target | None:
        if self._reports:
            await asyncio.wait(self._reports)
        return (await self._link.call(step, msg)).target


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
        """Where the first decode goes (the coordinator sends it once the KV is ready, or at once for a target
        sent before its KV was ready: ``settled`` reads the rest); raises its error."""
        target = await self._target_line("the decode's plan", closes=False)
        if target is None:
            await self.aclose()
            raise ProxyError("the coordinator named no decoder")
        if not target.kv_pending:
            await self.aclose()
        return target

    async def settled(self) -> Target | None:
        """The early decode's KV outcome: None, it goes on; else where it goes instead; raises its error."""
        return await self._target_line("the early decode's KV outcome", closes=True)

    async def _target_line(self, what: str, closes: bool) -> Target | None:
        try:
            line = msgspec.json.decode(await self._line(what), type=WirePlanLine)
        except BaseException:
            await self.aclose()
            raise
        if closes or isinstance(line, PlanFailed):
            await self.aclose()
        if isinstance(line, PlanFailed):
            raise RelayedError(line.failed, line.status)
        return line.planned().target

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
