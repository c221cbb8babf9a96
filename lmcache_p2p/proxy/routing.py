"""Which instances serve a request, and how.

Modes (decided in ``flow.py``, in this order):

1. disaggregated: a prefiller computes the prompt and sends its KV to a decoder, which decodes.
   Only a prefiller and a decoder whose KV fingerprints agree are paired (``Registry.compatible``).
2. colocated (:class:`ColocatedReason`): one instance serves the whole request as a plain
   completion, no KV transfer: the least loaded prefiller when no decoder is routable or none is
   compatible with any prefiller; the least loaded decoder (it computes the prompt itself) when no
   prefiller is routable or reachable, when a prefill broke before its first token and no other
   prefiller is left, or when admission gave up (see ``admission.py``: no buffer credit within
   ``--admission-timeout-s``, the admission queue full, or the prompt's KV larger than every buffer).
3. 503 only when no instance at all is routable.

Decoder choice (disaggregated): a decoder is eligible when its receive buffer has credit for the
request's KV now (``ceil(prompt_tokens / chunk_tokens)`` slots against announced free slots minus
the proxy's own promises, see ``registry.py``); decoders that did not announce a capacity are always
eligible, and so is every decoder for a request whose KV will not be sent (``needs_kv=False``: it
recomputes). Among eligible ones:

* ``least_loaded`` (default): fewest in-flight tokens (prompt + max output); then the most free
  buffer credit; remaining ties go round robin so equal decoders share the work. Deterministic:
  no random choice.
* ``round_robin``: the next one in instance-id order.

Prefiller choice: among those compatible with the chosen decoder, fewest in-flight prompt tokens
(ties round robin), or round robin.

``exclude`` names instances to avoid (a retry after a failure); when nothing else is left they are
used anyway.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
from collections.abc import Callable, Collection
from typing import Any

from lmcache_p2p.config import Role
from lmcache_p2p.proxy.errors import NoCapacity, NoInstanceAvailable
from lmcache_p2p.proxy.registry import Instance


class Policy(str, enum.Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"


class ColocatedReason(str, enum.Enum):
    """Why one instance serves a whole request (the ``reason`` label of ``colocated_total``)."""

    NO_DECODER = "no_decoder"  # no routable decoder: a prefiller serves it
    NO_COMPATIBLE_DECODER = "no_compatible_decoder"  # every decoder's KV fingerprint differs: a prefiller
    NO_PREFILLER = "no_prefiller"  # no routable or reachable prefiller: a decoder computes the prompt
    PREFILL_FAILED = "prefill_failed"  # the prefill broke before its first token, no other prefiller left
    ADMISSION_TIMEOUT = "admission_timeout"  # no decoder buffer credit within --admission-timeout-s
    ADMISSION_QUEUE_FULL = "admission_queue_full"  # --admission-queue-max requests already wait
    TOO_LARGE = "too_large"  # the prompt's KV is larger than every decoder buffer


@dataclasses.dataclass(frozen=True)
class RequestCost:
    prompt_tokens: int
    max_output_tokens: int

    @property
    def decode_tokens(self) -> int:
        return self.prompt_tokens + self.max_output_tokens


def chunks_needed(prompt_tokens: int, chunk_tokens: int) -> int:
    """Receive slots a prompt's KV takes on a decoder (0 when its chunk size is unknown)."""
    return math.ceil(prompt_tokens / chunk_tokens) if chunk_tokens > 0 else 0


class Router:
    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._turn = {role: itertools.count() for role in Role}

    def pick_decoder(self, decoders: list[Instance], cost: RequestCost, exclude: Collection[str] = (), *,
                     needs_kv: bool = True) -> Instance:
        """A decoder with room for the request's KV now (any, without ``needs_kv``); raises when none."""
        if not decoders:
            raise NoInstanceAvailable(
                "no decoder available: start one (p2p.role: receiver, p2p.proxy_url -> this proxy's control port) "
                "or pass --decode URL"
            )
        decoder = self.decoder_with_room(decoders, cost, exclude) if needs_kv else self._pick_decoder(decoders,
                                                                                                       exclude)
        if decoder is None:
            raise no_capacity(decoders, cost.prompt_tokens)
        return decoder

    def decoder_with_room(self, decoders: list[Instance], cost: RequestCost,
                          exclude: Collection[str] = ()) -> Instance | None:
        """A decoder whose buffer credit holds the request's KV now; None when none has room."""
        fitting = [d for d in decoders if _fits(d, cost.prompt_tokens)]
        return self._pick_decoder(fitting, exclude) if fitting else None

    def _pick_decoder(self, decoders: list[Instance], exclude: Collection[str]) -> Instance:
        return self._pick(Role.RECEIVER, _prefer(decoders, exclude), _decoder_load)

    def pick_prefiller(self, prefillers: list[Instance], exclude: Collection[str] = ()) -> Instance:
        if not prefillers:
            raise NoInstanceAvailable(
                "no prefiller available: start one (p2p.role: sender, p2p.proxy_url -> this proxy's control port) "
                "or pass --prefill URL"
            )
        return self._pick(Role.SENDER, _prefer(prefillers, exclude), lambda p: p.inflight_tokens)

    def _pick(self, role: Role, candidates: list[Instance], load: Callable[[Instance], Any]) -> Instance:
        ordered = sorted(candidates, key=lambda i: i.instance_id)
        turn = next(self._turn[role])
        if self.policy is Policy.ROUND_ROBIN:
            return ordered[turn % len(ordered)]
        lowest = min(load(i) for i in ordered)
        tied = [i for i in ordered if load(i) == lowest]
        return tied[turn % len(tied)]


def exceeds_every_buffer(decoders: list[Instance], prompt_tokens: int) -> bool:
    """The prompt's KV can never fit: every decoder announced a buffer, all smaller than it needs."""
    return bool(decoders) and all(
        d.capacity_slots is not None and chunks_needed(prompt_tokens, d.chunk_tokens) > d.capacity_slots
        for d in decoders)


def _decoder_load(decoder: Instance) -> tuple[int, int]:
    """Lower is better: in-flight tokens, then the most free credit (unknown counts as none)."""
    return decoder.inflight_tokens, -(decoder.free_slots() or 0)


def _prefer(candidates: list[Instance], exclude: Collection[str]) -> list[Instance]:
    kept = [i for i in candidates if i.instance_id not in exclude]
    return kept or candidates


def _fits(decoder: Instance, prompt_tokens: int) -> bool:
    free = decoder.free_slots()
    return free is None or chunks_needed(prompt_tokens, decoder.chunk_tokens) <= free


def no_capacity(decoders: list[Instance], prompt_tokens: int) -> NoCapacity:
    needs = {d.instance_id: chunks_needed(prompt_tokens, d.chunk_tokens) for d in decoders}
    if exceeds_every_buffer(decoders, prompt_tokens):
        largest = max(decoders, key=lambda d: d.capacity_slots or 0)
        return NoCapacity(
            f"request needs {needs[largest.instance_id]} KV chunks (~{prompt_tokens} prompt tokens) but the largest "
            f"decoder buffer holds {largest.capacity_slots} chunks: raise p2p.buffer_size on the decoders"
        )
    freest = max(decoders, key=lambda d: d.free_slots() or 0)
    return NoCapacity(
        f"every decoder buffer is busy: the request needs {needs[freest.instance_id]} KV chunks "
        f"(~{prompt_tokens} prompt tokens), the most free now is {max(freest.free_slots() or 0, 0)} of "
        f"{freest.capacity_slots} on {freest.instance_id}; retry later or add decoders"
    )
