"""One request as the process that serves its client runs it: the prefill (a step on the request's
owner), the decode session (``flow/decode.py``) whose steps go to that owner, the client's text, the
answer's counts, and the close.

The owner is reached through the step API (``flow/steps.py``): in one process the request's
``RequestFlow`` itself, in a relay worker of ``--workers N`` the coordinator through
``relay/link.py``. So one process and a relay worker run the same path (``app.py`` drives this class in
both). It owns the client side's state (output ids, text, counts, first-byte stamp). It must not
route, wait for the KV or account load: the owner does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from lmcache_p2p.proxy.flow.decode import DecodeSession
from lmcache_p2p.proxy.flow.steps import Answer, Count, Opened, RequestOwner
from lmcache_p2p.proxy.http.detokenize import OutputText, TextParams
from lmcache_p2p.proxy.http.responses import Delta, FirstToken, usage
from lmcache_p2p.proxy.http.shaping import ClientRequest
from lmcache_p2p.proxy.upstream import Upstream


class ClientFlow:
    def __init__(self, owner: RequestOwner, upstream: Upstream, req: ClientRequest, headers: Mapping[str, str],
                 received_s: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self._headers = dict(headers)
        self._steps = owner.open(req, self._headers, received_s)
        self._upstream = upstream
        self.req = req
        self.response_id = uuid.uuid4().hex  # the owner names it once the prefill answered
        self._clock = clock
        self._opened: Opened | None = None
        self._counts: list[Count] = []  # this answer's requests_total / errors_total: they go with the close
        self.prompt_ids: list[int] = []
        self._output_ids: list[int] = []
        self._text: OutputText | None = None
        self._first_byte_s: float | None = None
        self._ended = False
        self._rendered_usage: dict[str, Any] | None = None

    async def prefill(self) -> FirstToken:
        opened = self._opened = await self._steps.prefill()
        self.response_id, self.prompt_ids = opened.response_id, opened.prompt_ids
        first = opened.first
        self._output_ids = [] if opened.colocated else [first.token_id]
        if opened.proxy_text and opened.tokenizer is not None:
            tokenizer = await self._steps.tokenizer()
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
        """A count of this request's answer: it goes to the owner with the close."""
        self._counts.append(count)

    def first_byte_written(self) -> None:
        """The first token's bytes reached a streaming client (its transport took them)."""
        if self._first_byte_s is None:
            self._first_byte_s = self._clock()

    def usage(self) -> dict[str, Any]:
        if self._rendered_usage is not None:  # the decoder's chat endpoint counted it (its parsers may hide ids)
            return self._rendered_usage
        return usage(len(self.prompt_ids), len(self._output_ids) or 1)

    async def decode(self) -> AsyncIterator[Delta]:
        """The output after the first token; a stream that breaks continues where the owner says."""
        opened = self._open()
        session = DecodeSession(self._steps, self._upstream, self.req, self._headers, opened.decode_idle_timeout_s,
                                self._text, self._output_ids, self._clock)
        try:
            async for delta in session.deltas(opened.regenerates_first, opened.first.text):
                yield delta
        finally:
            self._rendered_usage = session.rendered_usage

    async def end(self) -> None:
        """The answer is complete (before the client's [DONE] or its body): the owner closes the request
        now (releases its load, remembers the output for the next turn)."""
        if not self._ended:
            self._ended = True
            await self._steps.end(self._answer())

    def close(self) -> None:
        """Tell the owner the request is over (never awaits). Called again (a prefill that ended after its
        handler gave up) the owner releases what it took since; the answer counts once."""
        self._ended = True
        self._steps.close(self._answer())

    async def closing(self) -> None:
        """Until the owner has closed the request (after ``close``)."""
        await self._steps.closing()

    def _open(self) -> Opened:
        if self._opened is None:
            raise RuntimeError("prefill() first")
        return self._opened

    def _answer(self) -> Answer:
        return Answer(list(self._output_ids), list(self._counts), self._first_byte_s)
