"""Everything we read of a foreign router's addressing, in one place (docs/ROUTERS.md).

vllm-router (``--vllm-pd-disaggregation``) picks the prefiller and the decoder before the prefill and
sends both requests with the header ``X-Request-Id: ___prefill_addr_{P}___decode_addr_{D}_{uuid}``, where
P and D are the instances' ``host:port`` (HTTP, or a ZMQ address the router was given for them) and
uuid is 32 hex digits. vLLM makes the engine's request id of it: ``cmpl-{id}-{prompt index}-{8 random}``
for completions, ``chatcmpl-{id}-{8 random}`` for chat, and ``{n}_`` in front of each of a request's
``n`` samples. That engine id is all a connector sees of the router, so:

- the prefiller reads the decoder's HTTP address and the router's uuid from it, and sends the KV to
  the decoder's control ports (HTTP port + ``p2p.router_control_port_offset`` + rank), under the key
  ``router-{uuid}[-{prompt index}][~{sample}]`` that both sides of one request share;
- the prefill's response names that key (``kv_transfer_params.lmcache_p2p``), which the router copies
  into the decode request, so the decoder knows the KV is on its way and waits for it (bounded).

An id that names no decoder is an ordinary request (nothing is sent, as before). An id that names one
we cannot use, or a ``lmcache_p2p`` entry that does not parse, is logged once per cause and served
colocated: the decoder computes the prompt itself. Nothing else of a request id is parsed anywhere.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

MARKER_KEY = "lmcache_p2p"  # our entry in the prefill's kv_transfer_params, copied by the router to the decode
_ROUTER_ID = re.compile(
    r"^(?:(?P<sample>\d+)_)?(?P<kind>chatcmpl|cmpl)-___prefill_addr_(?P<prefill>.*?)___decode_addr_(?P<decode>.+)"
    r"_(?P<uuid>[0-9a-f]{32})(?P<tail>(?:-.*)?)$")
_CMPL_TAIL = re.compile(r"^-(?P<index>\d+)(?:-[0-9A-Za-z]{8})?$")  # -{prompt index}[-{8 random}]
_CHAT_TAIL = re.compile(r"^(?:-[0-9A-Za-z]{8})?$")
_HOST_PORT = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(?P<port>\d{1,5})$")
_warned: set[str] = set()


@dataclasses.dataclass(frozen=True)
class RouterRequest:
    """What a router's request id says: the request's shared key and its decoder's HTTP address."""

    key: str  # the same on the prefiller and the decoder: the KV's request id on the wire
    decoder_host: str
    decoder_http_port: int


@dataclasses.dataclass(frozen=True)
class Marker:
    """The prefiller's note to the decoder (through the router): KV for ``key`` is on its way."""

    key: str
    prompt_tokens: int  # what the prefiller stores: the decoder waits for a hit of this many tokens

    def as_params(self) -> dict[str, Any]:
        return {MARKER_KEY: {"req_id": self.key, "prompt_tokens": self.prompt_tokens}}


def parse_request_id(request_id: str) -> RouterRequest | None:
    """The router's addressing in a vLLM engine request id; None when the id carries none (a request
    our proxy or a client sent); ValueError naming what does not parse when it names a decoder badly."""
    match = _ROUTER_ID.match(request_id)
    if match is None:
        if "___decode_addr_" in request_id:
            raise ValueError("it names a decoder but is not ___prefill_addr_P___decode_addr_D_<32 hex> inside "
                             "cmpl-/chatcmpl-")
        return None
    chat = match.group("kind") == "chatcmpl"
    tail = (_CHAT_TAIL if chat else _CMPL_TAIL).match(match.group("tail"))
    if tail is None:
        raise ValueError(f"unexpected suffix {match.group('tail')!r} after the router's uuid")
    address = _HOST_PORT.match(match.group("decode"))
    if address is None or not 0 < int(address.group("port")) < 65536:
        raise ValueError(f"decode address {match.group('decode')!r} is not HOST:PORT (a ZMQ address the router was "
                         "given is not an lmcache_p2p decoder's HTTP address)")
    key = f"router-{match.group('uuid')}"
    if not chat:
        key += f"-{tail.group('index')}"
    if match.group("sample"):
        key += f"~{match.group('sample')}"
    return RouterRequest(key, address.group("host"), int(address.group("port")))


def disagg_spec(req: RouterRequest, control_port_offset: int, decoder_tp: int) -> dict[str, Any]:
    """The ``kv_transfer_params.disagg_spec`` our proxy would have sent for this request (LMCache builds
    the sender's ``transfer_spec`` from it); ValueError when the relation gives no valid port."""
    ports = [req.decoder_http_port + control_port_offset + rank for rank in range(decoder_tp)]
    if not all(0 < p < 65536 for p in ports):
        raise ValueError(f"HTTP port {req.decoder_http_port} + p2p.router_control_port_offset {control_port_offset} "
                         f"is no TCP port")
    return {"req_id": req.key, "receiver_host": req.decoder_host, "receiver_alloc_port": ports,
            "receiver_init_port": ports}


def spec_for(request_id: str, control_port_offset: int, decoder_tp: int) -> dict[str, Any] | None:
    """The prefiller's one decision: where this request's KV goes (None: nowhere, it is served colocated)."""
    try:
        req = parse_request_id(request_id)
        return None if req is None else disagg_spec(req, control_port_offset, decoder_tp)
    except ValueError as exc:
        _warn_once("id", "request %s: its router addressing does not parse (%s): no KV is sent, the decoder "
                         "computes the prompt itself (docs/ROUTERS.md)", request_id, exc)
        return None


def marker_of(params: Mapping[str, Any] | None, request_id: str) -> Marker | None:
    """The prefiller's note in a decode request's ``kv_transfer_params``; None when there is none or it does
    not parse (logged: the decoder then computes what it does not find, at once)."""
    entry = params.get(MARKER_KEY) if isinstance(params, Mapping) else None
    if entry is None:
        return None
    key = entry.get("req_id") if isinstance(entry, Mapping) else None
    tokens = entry.get("prompt_tokens") if isinstance(entry, Mapping) else None
    if not isinstance(key, str) or not key or isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        _warn_once("marker", "request %s: kv_transfer_params.%s is %r, not {req_id: str, prompt_tokens: int}: the "
                             "decoder does not wait for KV and computes what it lacks", request_id, MARKER_KEY, entry)
        return None
    return Marker(key, tokens)


def _warn_once(cause: str, msg: str, *args: Any) -> None:
    """The first failure of each cause at WARNING, the rest at DEBUG: a router that always sends an id we
    cannot use must not write a line per request."""
    level = logging.DEBUG if cause in _warned else logging.WARNING
    _warned.add(cause)
    logger.log(level, msg, *args)
