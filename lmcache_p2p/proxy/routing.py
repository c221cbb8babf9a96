"""Which decoder and which prefiller serve a request.

The decoder is chosen first, among those whose receive buffer can hold the request's KV now
(``ceil(prompt_tokens / chunk_tokens)`` slots against announced free slots minus the proxy's own
promises, see ``registry.py``); decoders that did not announce a capacity are always eligible, and
so is every decoder for a request whose KV will not be sent (``needs_kv=False``: it recomputes).
Then the prefiller. Policies:

* ``least_loaded`` (default): fewest in-flight tokens (prompt + max output on a decoder, prompt on a
  prefiller); ties go round robin so equal instances share the work.
* ``round_robin``: the next one in instance-id order.

``exclude`` names instances to avoid (a retry after a KV failure); when nothing else is left they
are used anyway.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
from collections.abc import Callable, Collection

from lmcache_p2p.config import Role
from lmcache_p2p.proxy.errors import NoCapacity, NoInstanceAvailable
from lmcache_p2p.proxy.registry import Instance


class Policy(str, enum.Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"


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
        if not decoders:
            raise NoInstanceAvailable(
                "no decoder available: start one (p2p.role: receiver, p2p.proxy_url -> this proxy's control port) "
                "or pass --decode URL"
            )
        fitting = [d for d in decoders if not needs_kv or _fits(d, cost.prompt_tokens)]
        if not fitting:
            raise _no_capacity(decoders, cost.prompt_tokens)
        return self._pick(Role.RECEIVER, _prefer(fitting, exclude), lambda d: d.inflight_tokens)

    def pick_prefiller(self, prefillers: list[Instance], exclude: Collection[str] = ()) -> Instance:
        if not prefillers:
            raise NoInstanceAvailable(
                "no prefiller available: start one (p2p.role: sender, p2p.proxy_url -> this proxy's control port) "
                "or pass --prefill URL"
            )
        return self._pick(Role.SENDER, _prefer(prefillers, exclude), lambda p: p.inflight_tokens)

    def _pick(self, role: Role, candidates: list[Instance], load: Callable[[Instance], int]) -> Instance:
        ordered = sorted(candidates, key=lambda i: i.instance_id)
        turn = next(self._turn[role])
        if self.policy is Policy.ROUND_ROBIN:
            return ordered[turn % len(ordered)]
        lowest = min(load(i) for i in ordered)
        tied = [i for i in ordered if load(i) == lowest]
        return tied[turn % len(tied)]


def _prefer(candidates: list[Instance], exclude: Collection[str]) -> list[Instance]:
    kept = [i for i in candidates if i.instance_id not in exclude]
    return kept or candidates


def _fits(decoder: Instance, prompt_tokens: int) -> bool:
    free = decoder.free_slots()
    return free is None or chunks_needed(prompt_tokens, decoder.chunk_tokens) <= free


def _no_capacity(decoders: list[Instance], prompt_tokens: int) -> NoCapacity:
    needs = {d.instance_id: chunks_needed(prompt_tokens, d.chunk_tokens) for d in decoders}
    if all(needs[d.instance_id] > (d.capacity_slots or 0) for d in decoders):
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
