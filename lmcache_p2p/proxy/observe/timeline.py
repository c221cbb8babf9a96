"""Where one disaggregated request's time goes: stamps at the proxy, times reported by the prefiller.

The proxy stamps (``clock()``, ``time.perf_counter`` by default) as the request passes:

    received -> prefill sent -> prefill answered -> first byte written to the client
                                prefill answered .. KV ready on every decoder rank (may come first)
                                max(prefill answered, KV ready) -> decode sent -> first decoded byte
                                (--early-decode: prefill answered -> decode sent, the KV wait beside it)

and the prefiller's sender reports its own durations for the request (``protocol.KvSent``, one per
TP rank, after its last chunk was written). The phases, in seconds:

  queue         received -> prefill sent: parsing, tokenization, routing, admission
  prefill       prefill sent -> prefill answer (the prefiller's HTTP round trip, forward pass included)
  first_byte    prefill answer -> the first token's bytes written to a streaming client
  kv_wait       prefill answer -> KV ready on every rank (0 when it was ready first)
  decode_start  max(prefill answer, KV ready) -> decode request sent; an early decode's (``--early-decode``):
                prefill answer -> decode request sent
  kv_after_decode  an early decode's only: decode sent -> KV ready on every rank (0 when it was ready first):
                how long the decoder could hold the decode for its KV (its HTTP intake included)
  decode_first  decode sent -> the decoder's first streamed byte; within it decode_accept (-> the
                decoder's response headers: its HTTP intake and the request's rendering, before vLLM
                counts the request as arrived, so outside the decoder's own TTFT histogram)
  store         prefiller: the request's LMCache store as the plugin sees it (its first store call's
                start -> its last store call's end; one store per prefill: equals ``submit``)
  submit        prefiller: time spent in ``batched_submit_put_task`` for the request (engine thread)
  transfer      prefiller: first chunk submitted -> last chunk written (acknowledged by the transport);
                within it: pickup (-> the first chunks could be written: the sender's thread took them and,
                for a store in VRAM, its GPU work was seen done), grant (its first Alloc -> the receiver's
                Grant) and write (first write posted -> last write seen complete). The Alloc leaves when the
                sender's thread takes the chunks, before their GPU work is done: grant overlaps pickup (only
                what of it outlasts pickup delays the writes), so pickup + grant + write may exceed transfer

With ``--workers N`` the first byte, decode sent and first decoded byte are the relay worker's own
stamps (same machine, same monotonic clock), reported to the coordinator with ``started`` / ``closed``.
The decode starts when the prefill answered, not after the first byte: first_byte and kv_wait +
decode_start overlap.

Where the output was decoded (``decode_parts``): the instance each decode request went to and the
output token it starts at (the first token, made by the prefill, is output token 0; a stream that
broke and continued elsewhere adds a part at the number of tokens the client had then). ``/stats``
lists them per request under ``recent_decodes``, colocated requests included.

Each timeline names the backend its pair ran (``lmcache_p2p`` or ``vllm-nixl``, ``flow/backends.py``):
a NixlConnector decoder pulls the KV itself, so its kv_wait is 0 and its decode_first holds the pull, and
its prefiller reports nothing.

A phase whose stamps are missing (no decode followed, the KV failed, a non-streaming client has no
first byte) is left out of that request's figures. With several TP ranks the prefiller phases are
the slowest rank's.
"""

from __future__ import annotations

import dataclasses
import enum

from lmcache_p2p.protocol import KvSent


class Phase(str, enum.Enum):
    QUEUE = "queue"
    PREFILL = "prefill"
    FIRST_BYTE = "first_byte"
    KV_WAIT = "kv_wait"
    DECODE_START = "decode_start"
    KV_AFTER_DECODE = "kv_after_decode"
    DECODE_FIRST = "decode_first"
    DECODE_ACCEPT = "decode_accept"
    STORE = "store"
    SUBMIT = "submit"
    TRANSFER = "transfer"
    PICKUP = "pickup"
    GRANT = "grant"
    WRITE = "write"


PROXY_PHASES = (Phase.QUEUE, Phase.PREFILL, Phase.FIRST_BYTE, Phase.KV_WAIT, Phase.DECODE_START,
                Phase.KV_AFTER_DECODE, Phase.DECODE_FIRST, Phase.DECODE_ACCEPT)
PREFILLER_PHASES = (Phase.STORE, Phase.SUBMIT, Phase.TRANSFER, Phase.PICKUP, Phase.GRANT, Phase.WRITE)


@dataclasses.dataclass(frozen=True)
class DecodePart:
    """One decode request of a request's output: where it went and the output token it continues at."""

    instance_id: str
    from_token: int


@dataclasses.dataclass
class Timeline:
    """The proxy's stamps for one request (``None``: that moment did not happen)."""

    received_s: float
    req_id: str = ""  # the KV handover's id (the prefiller and decoder know the request by it)
    tp_size: int = 1  # prefiller reports expected (one per rank)
    backend: str = ""  # the KV backend of its pair (``Backend``; "" when no pair served it)
    early_decode: bool = False  # its decode went before its KV was ready (--early-decode)
    prefill_sent_s: float | None = None
    prefill_answered_s: float | None = None
    first_byte_s: float | None = None
    kv_ready_s: float | None = None
    decode_sent_s: float | None = None
    decode_accepted_s: float | None = None  # the decoder's response headers
    first_decoded_s: float | None = None
    decode_parts: list[DecodePart] = dataclasses.field(default_factory=list)

    def phases(self) -> dict[Phase, float]:
        """The proxy-side phases this request went through, in seconds."""
        out: dict[Phase, float] = {}
        _span(out, Phase.QUEUE, self.received_s, self.prefill_sent_s)
        _span(out, Phase.PREFILL, self.prefill_sent_s, self.prefill_answered_s)
        _span(out, Phase.FIRST_BYTE, self.prefill_answered_s, self.first_byte_s)
        answered, ready = self.prefill_answered_s, self.kv_ready_s
        if answered is not None and ready is not None:
            out[Phase.KV_WAIT] = max(0.0, ready - answered)
        if self.early_decode:
            _span(out, Phase.DECODE_START, answered, self.decode_sent_s)
            _span(out, Phase.KV_AFTER_DECODE, self.decode_sent_s, ready)
        elif answered is not None and ready is not None:
            _span(out, Phase.DECODE_START, max(answered, ready), self.decode_sent_s)
        _span(out, Phase.DECODE_FIRST, self.decode_sent_s, self.first_decoded_s)
        if self.first_decoded_s is not None:
            _span(out, Phase.DECODE_ACCEPT, self.decode_sent_s, self.decode_accepted_s)
        return out


def _span(out: dict[Phase, float], phase: Phase, start_s: float | None, end_s: float | None) -> None:
    if start_s is not None and end_s is not None:
        out[phase] = max(0.0, end_s - start_s)


def prefiller_phases(reports: list[KvSent]) -> dict[Phase, float]:
    """The prefiller phases of one request from its ranks' reports: the slowest rank's, in seconds."""
    return {
        Phase.STORE: max(r.store_s for r in reports),
        Phase.SUBMIT: max(r.submit_s for r in reports),
        Phase.TRANSFER: max(r.transfer_s for r in reports),
        Phase.PICKUP: max(r.pickup_s for r in reports),
        Phase.GRANT: max(r.grant_s for r in reports),
        Phase.WRITE: max(r.write_s for r in reports),
    }
