"""One request as the process that serves its client runs it: ``open`` (the prefill, done by the
request's owner), the decode session (``flow/decode.py``) whose steps go to that owner, the
client's text, the answer's counts, and ``closed``.

The owner is reached through a link: :class:`flow_host.LocalLink` when this process routes the
request itself, ``relay_link.CoordinatorLink`` in a relay worker of ``--workers N``. So one
process and a relay worker run the same path (``http/app.py`` drives this class in both). It owns the
client side's state (output ids, text, counts, first-byte stamp). It must not route, wait for the
KV or account load: its link's owner does.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from typing import Any, Protocol

from lmcache_p2p.proxy.flow.decode import DecodeSession
from lmcache_p2p.proxy.http.detokenize import OutputText, TextParams
from lmcache_p2p.proxy.errors import UpstreamConnectError, UpstreamError
from lmcache_p2p.proxy.relay.messages import Count, Opened, Planned, Step, Target
from lmcache_p2p.proxy.http.responses import Delta, FirstToken, usage
from lmcache_p2p.proxy.http.shaping import ClientRequest
from lmcache_p2p.proxy.http.tokenizer import ProxyTokenizer
from lmcache_p2p.proxy.upstream import Upstream

CLOSED_ATTEMPTS = 5  # "closed" returns the request's lease: a relay link sends it again after a link error


class PlanSource(Protocol):
    """The second half of ``open``: where the first decode goes once the KV is ready."""

    async def plan(self) -> Target: ...

    async def aclose(self) -> None: ...


class FlowLink(Protocol):
    """The steps on the request's owner (``relay/messages.py`` names them)."""

    worker: int

    async def open(self, handle: str, req: ClientRequest, headers: Mapping[str, str],
                   received_s: float) -> tuple[Opened, PlanSource]: ...

    async def call(self, step: str, msg: Step) -> Planned: ...

    async def tell(self, step: str, msg: Any, attempts: int = 1) -> None: ...

    def tell_later(self, step: str, msg: Any, after: Collection[asyncio.Future[Any]] = (),
                   answer: Any = None, attempts: int = 1) -> asyncio.Future[Any]: ...

    async def tokenizer(self, source: str, handle: str) -> ProxyTokenizer: ...


class ClientFlow:
    def __init__(self, link: FlowLink, upstream: Upstream, req: ClientRequest, headers: Mapping[str, str],
                 received_s: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self._link = link
        self._upstream = upstream
        self.req = req
        self.handle = uuid.uuid4().hex
        self.response_id = self.handle
        self._headers = dict(headers)
        self._received_s = received_s
        self._clock = clock
        self._opened: Opened | None = None
        self._answer: PlanSource | None = None  # the rest of open's answer: where the decode goes
        self._counts: list[Count] = []  # this answer's requests_total / errors_total: they go with "closed"
        self.prompt_ids: list[int] = []
        self._output_ids: list[int] = []
        self._text: OutputText | None = None
        self._session: DecodeSession | None = None
        self._started: asyncio.Future[Any] | None = None
        self._first_byte_s: float | None = None
        self._closed = False
        self._closing: asyncio.Future[Any] | None = None
        self._before_close: list[asyncio.Future[Any]] = []  # reports the owner must have before "closed"

    async def prefill(self) -> FirstToken:
        opened, self._answer = await self._link.open(self.handle, self.req, self._headers, self._received_s)
        self._opened = opened
        if not opened.needs_decode:
            await self._answer.aclose()
        self.response_id, self.prompt_ids = opened.response_id, opened.prompt_ids
        first = opened.first
        self._output_ids = [] if opened.colocated else [first.token_id]
        if opened.proxy_text and opened.tokenizer is not None:
            tokenizer = await self._link.tokenizer(opened.tokenizer, self.handle)
            # the owner's copy made the first token's text; this one replays it once the first byte is out
            self._text = tokenizer.output_text(self.prompt_ids, TextParams.from_body(self.req.body),
                                               replay=() if opened.colocated else [first.token_id])
        return first

    @property
    def decoder_regenerates_first(self) -> bool:
        return self._open().regenerates_first

    @property
    def needs_decode(self) -> bool:
        return self._open().needs_decode

    def add_count(self, count: Count) -> None:
        """A count of this request's answer: it goes to the owner with "closed"."""
        self._counts.append(count)

    def first_byte_written(self) -> None:
        """The first token's bytes reached a streaming client (its transport took them)."""
        if self._first_byte_s is None:
            self._first_byte_s = self._clock()

    def usage(self) -> dict[str, int]:
        return usage(len(self.prompt_ids), len(self._output_ids) or 1)

    async def decode(self) -> AsyncIterator[Delta]:
        """The output after the first token; a stream that breaks continues where the owner says."""
        opened = self._open()
        self._session = DecodeSession(self, self._upstream, self.req, self._headers, opened.decode_idle_timeout_s,
                                      self._text, self._output_ids, self._clock)
        async for delta in self._session.deltas(opened.regenerates_first, opened.first.text):
            yield delta

    async def end(self) -> None:
        """The answer is complete (before the client's [DONE] or its body): the owner closes the request
        now (releases its load, remembers the output for the next turn)."""
        if self._closed:
            return
        self._closed = True
        if self._answer is not None:
            await self._answer.aclose()
        if self._before_close:
            await asyncio.wait(self._before_close)  # the owner learns the steps in order
        await self._link.tell("closed", self._closed_step(), CLOSED_ATTEMPTS)

    def close(self) -> None:
        """Tell the owner the request is over (never awaits); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._closing = self._link.tell_later("closed", self._closed_step, after=self._before_close,
                                              answer=self._answer, attempts=CLOSED_ATTEMPTS)

    async def closing(self) -> None:
        """Until the owner has closed the request (after ``close``)."""
        if self._closing is not None:
            await asyncio.wait({self._closing})

    # ---- the decode session's steps, on the owner (decode_session.DecodeSteps) ----------------------

    async def plan(self) -> Target:
        if self._answer is None:
            raise RuntimeError("prefill() first")
        return await self._answer.plan()  # the owner sends it once the KV is ready: no call from here

    async def unreachable(self, exc: UpstreamConnectError) -> Target | None:
        return await self._call("unreachable", message=str(exc))

    async def broken(self, output_ids: list[int], finished: bool, rewound: int, exc: UpstreamError) -> Target | None:
        return await self._call("broken", output_ids=output_ids, finished=finished, rewound=rewound,
                                connect_failed=isinstance(exc, UpstreamConnectError), message=str(exc))

    def started(self, decode_sent_s: float, first_decoded_s: float) -> None:
        self._started = self._link.tell_later("started", self._step(decode_sent_s=decode_sent_s,
                                                                    first_decoded_s=first_decoded_s))
        self._before_close.append(self._started)

    # ---- internals ---------------------------------------------------------------------------------

    def _open(self) -> Opened:
        if self._opened is None:
            raise RuntimeError("prefill() first")
        return self._opened

    def _step(self, **fields: Any) -> Step:
        fields.setdefault("output_ids", list(self._output_ids))
        fields.setdefault("finished", self._session is not None and self._session.finished)
        return Step(self.handle, first_byte_s=self._first_byte_s, **fields)

    def _closed_step(self) -> Step:
        return self._step(counts=list(self._counts))

    async def _call(self, step: str, **fields: Any) -> Target | None:
        if self._started is not None:
            await asyncio.wait({self._started})  # the owner learns the steps in order
        planned = await self._link.call(step, self._step(**fields))
        return planned.target
