"""One request's step API: what the side that serves the client (``flow/client.py``, ``flow/decode.py``)
asks of the request's owner (the process that routes it), and the typed data of each step.

    steps = owner.open(req, headers, received_s)
    opened = await steps.prefill()             routed, admitted, prefilled: the first token
    target = await steps.plan()                the KV is ready (or retried / recomputed): where the decode goes
      await steps.settled()                    (``target.kv_pending``: sent before its KV was ready) the KV's
                                               outcome, raced against the first output: where instead (None: on)
      await steps.unreachable(exc)             the target refused the connection: where instead (None: nowhere)
      steps.started(sent_s, first_s)           its first output came (the KV is loaded)
      await steps.broken(ids, ..., exc)        the stream broke after ``ids``: where it continues
    await steps.end(answer) / steps.close(answer)   the request is over (``close`` never awaits)

The API has two implementations: ``flow/flow.py``'s ``RequestFlow`` itself, in the process that routes
the request (a step is a method call; exceptions pass as objects), and ``relay/link.py``'s
``RemoteSteps`` in a relay worker of ``--workers N``, the only code that turns steps into messages
to the coordinator. The data here are msgspec structs so that the relay sends them as they are.

It owns the API and its data only. It must not import the implementations, the relay or the HTTP app.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import msgspec

from lmcache_p2p.proxy.errors import UpstreamConnectError, UpstreamError
from lmcache_p2p.proxy.http.responses import FirstToken
from lmcache_p2p.proxy.http.shaping import ClientRequest
from lmcache_p2p.proxy.http.tokenizer import ProxyTokenizer


class Opened(msgspec.Struct, frozen=True):
    """``prefill``'s answer: the first token and what the client side needs to serve the rest."""

    response_id: str
    first: FirstToken
    prompt_ids: list[int]
    needs_decode: bool
    regenerates_first: bool  # the decoder generates the whole output (colocated, or no text for the first)
    colocated: bool
    proxy_text: bool  # the client side makes the client's text with the tokenizer below
    tokenizer: str | None
    decode_idle_timeout_s: float


class Target(msgspec.Struct, frozen=True):
    """Where a decode goes and its request."""

    url: str
    body: dict[str, Any] | msgspec.Raw  # the decode request's JSON body; a relay worker's: the bytes as sent
    replays: int = 0  # the client's last output tokens this decode generates again (dropped from its stream)
    first_output_timeout_s: float | None = None  # its first output's deadline (a decoder that pulls the KV first)
    request_id: str | None = None  # its X-Request-Id: the prefill's whose KV it takes (vLLM pairs them by it)
    kv_pending: bool = False  # sent before its KV is ready (--early-decode): race its first output against settled()
    path: str = "/v1/completions"  # the decode's endpoint: /v1/chat/completions when the decoder renders the answer


class Count(msgspec.Struct, frozen=True):
    """One count of an answer: ``requests_total{status}`` or ``errors_total{type}``."""

    endpoint: str
    status: int | None = None
    error: str | None = None


class Answer(msgspec.Struct, frozen=True):
    """What the client side knows of the request as it closes it."""

    output_ids: list[int]  # the output the client got (the owner remembers it for the next turn)
    counts: list[Count] = []  # the answer's counts, applied once
    first_byte_s: float | None = None  # time.perf_counter() when the first token reached the client


class RequestSteps(Protocol):
    """One request's steps on its owner (see the module docstring)."""

    async def prefill(self) -> Opened:
        """Route, admit and prefill; the first token (colocated: empty, the whole output comes in the decode)."""

    async def tokenizer(self) -> ProxyTokenizer:
        """The tokenizer ``Opened.tokenizer`` names (only when ``Opened.proxy_text``)."""

    async def plan(self) -> Target:
        """Wait for the KV (retrying or recomputing per policy); where the first decode goes."""

    async def settled(self) -> Target | None:
        """A ``kv_pending`` target's KV outcome, or its first output (``started``), whichever the owner learns
        first: None when the decode goes on (the KV is ready, or the decode output first, or left its decoder);
        else the KV failed first, the decode is given up (the caller closes its stream and drops what it
        received) and where the decode goes instead (``--on-kv-failure``, as for a KV wait before the decode).
        Bounded by ``--kv-timeout-s`` and that failure's path."""

    async def unreachable(self, exc: UpstreamConnectError) -> Target | None:
        """The target refused the connection (nothing was sent): where the decode goes instead."""

    async def broken(self, output_ids: list[int], finished: bool, rewound: int, exc: UpstreamError) -> Target | None:
        """The stream broke after ``output_ids``: where it continues (the last ``rewound`` generated again)."""

    def started(self, decode_sent_s: float, first_decoded_s: float, decode_accepted_s: float | None = None,
                kv_pending: bool = False) -> None:
        """The target sent its first output (it has loaded the KV); the stamps of its request, its response
        headers and that output; ``kv_pending``: the target was (then the owner may have given it up first)."""

    async def end(self, answer: Answer) -> None:
        """The answer is complete: the owner closes the request now (before the client's last bytes)."""

    def close(self, answer: Answer) -> None:
        """The request is over, however it ended; never awaits. Called again (a step that ended after its
        handler gave up) it releases what was taken since; the answer counts once."""

    async def closing(self) -> None:
        """Until the owner has closed the request (after ``close``)."""


class RequestOwner(Protocol):
    """Where requests are opened: this process's ``flow.Orchestrator``, or a relay worker's coordinator link."""

    def open(self, req: ClientRequest, headers: Mapping[str, str], received_s: float) -> RequestSteps:
        """The steps of a new request (nothing is sent before ``prefill``)."""

    def count(self, count: Count) -> None:
        """A count of an answer that had no request (a malformed body); never awaits."""
