"""The messages between the coordinator and its relay workers (``--workers N``, see ``relay/workers.py``).

JSON (msgspec) over HTTP on the coordinator's Unix socket, in a 0700 temporary folder; never
pickle. They carry the request's steps (``flow/steps.py``: ``Opened``, ``Target`` and ``Count`` are its
structs, sent as they are); ``relay/link.py`` turns the steps into these messages, ``relay/host.py``
back into calls. One request, as a worker sees it (3 calls; nothing on the client's path waits for a reply
but the first line of ``open``):

    POST /_relay/open     Open   -> Opened, Planned|PlanFailed[, Planned|PlanFailed]   (JSON lines)
                                 the answer is JSON lines on one response: ``Opened`` once the
                                 prefill is done (routed, admitted): the first token; then, after the
                                 KV wait, where the decode goes (only when ``Opened.needs_decode``);
                                 after a target sent before its KV was ready (``Target.kv_pending``,
                                 --early-decode), the step ``settled``'s answer: None, the decode goes on,
                                 or where it goes instead (the KV failed before its first output)
    POST /_relay/started  Step                      the decoder's first output (its KV is loaded), not awaited
                                                    (``kv_pending``: of a target sent before its KV was ready)
    POST /_relay/unreachable / broken  Step -> Planned   the decode could not connect / broke: go on where?
    POST /_relay/closed   Step                      the request is over, however it ended (idempotent), with the
                                                    requests_total / errors_total counts of its answer; a
                                                    complete answer is closed before its last bytes go out
    POST /_relay/count    Count                     a count of an answer that had no request (a malformed body)
    POST /_relay/hello    Hello                     a worker serves the HTTP port
    POST /_relay/tokenizer        -> TokenizerSource  which tokenizer to load (polled until settled)

A coordinator error answers with its HTTP status and a ``Failed`` body (``open``: before its first line;
after it, a ``PlanFailed`` line). The coordinator counts the calls it takes per step
(``RelayCoordinator.calls``).

Version history: 1: first. 2: ``plan`` folded into ``open``'s answer, ``count`` into ``closed``;
``started`` carries the worker's decode-sent / first-output stamps. 3: ``broken`` carries ``rewound``
(the last output tokens the continuation generates again, ``http/held_text.py``). 4: ``Target.kv_pending``
and ``open``'s third line after such a target (``settled``); ``started`` carries ``kv_pending``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from lmcache_p2p.proxy.flow.steps import Count, Opened, Target

__all__ = ["Count", "Failed", "Hello", "Open", "Opened", "PlanFailed", "Planned", "Step", "Target", "TokenizerSource",
           "WirePlanLine", "WirePlanned"]

PROTOCOL_VERSION = 4
VERSION_HEADER = "x-lmcache-relay-version"
PREFIX = "/_relay"


class Open(msgspec.Struct, frozen=True):
    handle: str  # the worker's id for this request (it may close it before it learns the answer)
    worker: int
    endpoint: str
    body: msgspec.Raw  # the client's JSON body
    headers: dict[str, str]  # forwarded to the instances (their API key)
    received_s: float  # time.perf_counter() when the worker received the request (one clock per machine)


class Planned(msgspec.Struct, frozen=True, tag="planned"):
    target: Target | None  # None: the decode may not go on (the worker raises the error it saw)


class _WireTarget(msgspec.Struct, frozen=True):
    url: str
    body: msgspec.Raw
    replays: int = 0
    first_output_timeout_s: float | None = None
    request_id: str | None = None
    kv_pending: bool = False
    path: str = "/v1/completions"


class WirePlanned(msgspec.Struct, frozen=True, tag="planned"):
    """``Planned`` as a relay worker reads it: the decode body stays the coordinator's bytes, sent on to the
    decoder as they are (a long prompt's ids are neither parsed nor encoded again in the worker)."""

    target: _WireTarget | None

    def planned(self) -> Planned:
        t = self.target
        return Planned(None if t is None else Target(t.url, t.body, t.replays, t.first_output_timeout_s,
                                                     request_id=t.request_id, kv_pending=t.kv_pending, path=t.path))


class Step(msgspec.Struct, frozen=True):
    handle: str
    output_ids: list[int] = []
    finished: bool = False
    connect_failed: bool = False  # broken: the connection was never made (nothing was sent)
    rewound: int = 0  # broken: the last output tokens the continuation generates again (their text is missing)
    message: str = ""
    # time.perf_counter() stamps on the worker (one monotonic clock per machine), for the timeline
    first_byte_s: float | None = None  # the first token reached the client
    decode_sent_s: float | None = None  # started: the decode request was sent to the decoder
    decode_accepted_s: float | None = None  # started: the decoder's response headers arrived
    first_decoded_s: float | None = None  # started: the decoder's first output arrived
    kv_pending: bool = False  # started: of a target sent before its KV was ready
    counts: list[Count] = []  # closed: the answer's requests_total / errors_total


class Hello(msgspec.Struct, frozen=True):
    worker: int
    pid: int
    version: int = PROTOCOL_VERSION


class TokenizerSource(msgspec.Struct, frozen=True):
    settled: bool  # False: the coordinator has not loaded it yet (it waits for an instance to ask)
    source: str | None  # the folder to load; None: the proxy makes no text (instances do)


class Failed(msgspec.Struct, frozen=True):
    name: str  # the error's class name (errors_total{type})
    body: dict[str, Any]  # what the client receives


class PlanFailed(msgspec.Struct, frozen=True, tag="plan_failed"):
    """``open``'s second line when the KV wait or the choice of a decoder failed: the error the client gets."""

    status: int
    failed: Failed


WirePlanLine = WirePlanned | PlanFailed  # open's second line
