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
* ``prefix``: cache-aware, in the style of SGLang's router (``--cache-threshold``,
  ``--balance-abs-threshold``, ``--balance-rel-threshold``). The proxy hashes the prompt's chunks as
  LMCache does and keeps, per instance, the chunks it recently sent there (``prefix.py``; a decoder
  also holds the output it generated). Load is balanced unless ``max - min > --prefix-balance-abs``
  AND ``max > --prefix-balance-rel * min`` (in-flight requests among the candidates). Balanced: the
  instance holding the longest prefix of the prompt wins when that prefix covers at least
  ``--prefix-cache-threshold`` of the prompt (ties: least loaded); otherwise, or when imbalanced, or
  when the proxy has no token ids for the prompt (no tokenizer), it is ``least_loaded``. Only
  decoders with buffer credit are candidates, as with every policy, and prefillers are chosen among
  those whose KV fingerprint matches the decoder's.

Prefiller choice: among those compatible with the chosen decoder, fewest in-flight prompt tokens
(ties round robin), round robin, or (``prefix``) as above.

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
from lmcache_p2p.proxy.prefix import PrefixIndex, PrefixSettings, PromptPrefix, none_hash
from lmcache_p2p.proxy.registry import Instance, Registry


class Policy(str, enum.Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    PREFIX = "prefix"


class PrefixDecision(str, enum.Enum):
    """Why ``prefix`` picked an instance (the ``decision`` label of ``prefix_routed_total``)."""

    MATCH = "match"  # balanced load and a long enough cached prefix: the instance holding it
    NO_MATCH = "no_match"  # balanced, but no instance holds --prefix-cache-threshold of the prompt
    IMBALANCED = "imbalanced"  # the load is imbalanced: least loaded
    NO_PREFIX = "no_prefix"  # no token ids for the prompt (no tokenizer in the proxy): least loaded


class ColocatedReason(str, enum.Enum):
    """Why one instance serves a whole request (the ``reason`` label of ``colocated_total``)."""

    NO_DECODER = "no_decoder"  # no routable decoder: a prefiller serves it
    NO_COMPATIBLE_DECODER = "no_compatible_decoder"  # every decoder's KV fingerprint differs: a prefiller
    NO_PREFILLER = "no_prefiller"  # no routable or reachable prefiller: a decoder computes the prompt
    PREFILL_FAILED = "prefill_failed"  # the prefill broke before its first token, no other prefiller left
    ADMISSION_TIMEOUT = "admission_timeout"  # no decoder buffer credit within --admission-timeout-s
    ADMISSION_QUEUE_FULL = "admission_queue_full"  # --admission-queue-max requests already wait
    TOO_LARGE = "too_large"  # the prompt's KV is larger than every decoder buffer
    PLUGIN_NOT_RUNNING = "plugin_not_running"  # no prefiller or no decoder announces a running LMCache plugin
    OUTPUT_AWARE_SAMPLING = "output_aware_sampling"  # penalties / bad_words read output tokens: one instance (flow.py)


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
    def __init__(self, policy: Policy, prefix: PrefixSettings | None = None) -> None:
        self.policy = policy
        self._turn = {role: itertools.count() for role in Role}
        self.prefix_settings = prefix or PrefixSettings()
        self.index = PrefixIndex(self.prefix_settings.index_chunks)
        self._start_hash = none_hash(self.prefix_settings.hash_seed)
        self.on_prefix_decision: list[Callable[[Role, PrefixDecision], None]] = []  # metrics

    # ---- prefixes (``prefix`` policy) ------------------------------------------------------------

    @property
    def uses_prefix(self) -> bool:
        return self.policy is Policy.PREFIX

    def prompt_prefix(self, token_ids: list[int] | tuple[int, ...]) -> PromptPrefix:
        return PromptPrefix(token_ids, self._start_hash)

    def remember(self, instance: Instance, prefix: PromptPrefix | None) -> None:
        """``instance`` now holds these tokens' KV (in vLLM's prefix cache or our receive buffer)."""
        if self.uses_prefix and prefix is not None:
            self.index.record(instance.instance_id, prefix.hashes(_chunk_tokens(instance)))

    def forget(self, instance: Instance) -> None:
        """The instance left, restarted or went down: whatever it cached is gone."""
        self.index.forget(instance.instance_id)

    def matched_tokens(self, instance: Instance, prefix: PromptPrefix) -> int:
        chunk_tokens = _chunk_tokens(instance)
        matched = self.index.matched_chunks(instance.instance_id, prefix.hashes(chunk_tokens))
        return min(matched * chunk_tokens, prefix.tokens)

    # ---- choices ----------------------------------------------------------------------------------

    def pick_decoder(self, decoders: list[Instance], cost: RequestCost, exclude: Collection[str] = (), *,
                     needs_kv: bool = True, prefix: PromptPrefix | None = None) -> Instance:
        """A decoder with room for the request's KV now (any, without ``needs_kv``); raises when none."""
        if not decoders:
            raise NoInstanceAvailable(
                "no decoder available: start one (p2p.role: receiver, p2p.proxy_url -> this proxy's control port) "
                "or pass --decode URL"
            )
        decoder = (self.decoder_with_room(decoders, cost, exclude, prefix=prefix) if needs_kv
                   else self._pick_decoder(decoders, exclude, prefix))
        if decoder is None:
            raise no_capacity(decoders, cost.prompt_tokens)
        return decoder

    def decoder_with_room(self, decoders: list[Instance], cost: RequestCost, exclude: Collection[str] = (), *,
                          prefix: PromptPrefix | None = None) -> Instance | None:
        """A decoder whose buffer credit holds the request's KV now; None when none has room."""
        fitting = [d for d in decoders if _fits(d, cost.prompt_tokens)]
        return self._pick_decoder(fitting, exclude, prefix) if fitting else None

    def _pick_decoder(self, decoders: list[Instance], exclude: Collection[str],
                      prefix: PromptPrefix | None = None) -> Instance:
        return self._pick(Role.RECEIVER, _prefer(decoders, exclude), _decoder_load, prefix)

    def pick_prefiller(self, prefillers: list[Instance], exclude: Collection[str] = (), *,
                       prefix: PromptPrefix | None = None) -> Instance:
        if not prefillers:
            raise NoInstanceAvailable(
                "no prefiller available: start one (p2p.role: sender, p2p.proxy_url -> this proxy's control port) "
                "or pass --prefill URL"
            )
        return self._pick(Role.SENDER, _prefer(prefillers, exclude), lambda p: p.inflight_tokens, prefix)

    def _pick(self, role: Role, candidates: list[Instance], load: Callable[[Instance], Any],
              prefix: PromptPrefix | None = None) -> Instance:
        ordered = sorted(candidates, key=lambda i: i.instance_id)
        turn = next(self._turn[role])
        if self.policy is Policy.ROUND_ROBIN:
            return ordered[turn % len(ordered)]
        if self.policy is Policy.PREFIX:
            decision, holders = self._prefix_holders(ordered, prefix)
            for listener in self.on_prefix_decision:
                listener(role, decision)
            if holders:
                ordered = holders
        lowest = min(load(i) for i in ordered)
        tied = [i for i in ordered if load(i) == lowest]
        return tied[turn % len(tied)]

    def _prefix_holders(self, ordered: list[Instance], prefix: PromptPrefix | None
                        ) -> tuple[PrefixDecision, list[Instance]]:
        """The candidates holding the longest prefix of the prompt when that one should win (else none)."""
        if prefix is None or prefix.tokens == 0:
            return PrefixDecision.NO_PREFIX, []
        if len(ordered) > 1 and self._imbalanced(ordered):
            return PrefixDecision.IMBALANCED, []
        matched = {i.instance_id: self.matched_tokens(i, prefix) for i in ordered}
        best = max(matched.values())
        if best == 0 or best / prefix.tokens < self.prefix_settings.cache_threshold:
            return PrefixDecision.NO_MATCH, []
        return PrefixDecision.MATCH, [i for i in ordered if matched[i.instance_id] == best]

    def _imbalanced(self, ordered: list[Instance]) -> bool:
        """SGLang's rule on in-flight requests: max - min > abs AND max > rel * min."""
        loads = [i.inflight_requests for i in ordered]
        most, least = max(loads), min(loads)
        s = self.prefix_settings
        return most - least > s.balance_abs_requests and most > s.balance_rel * least


def pairable(registry: Registry) -> tuple[list[Instance], ColocatedReason | None]:
    """Routable decoders that may take KV from a routable prefiller (both plugins run, fingerprints
    agree, ``Registry.compatible``); else none and why."""
    prefillers, decoders = registry.routable(Role.SENDER), registry.routable(Role.RECEIVER)
    if not decoders:
        return [], ColocatedReason.NO_DECODER
    if not prefillers:
        return [], ColocatedReason.NO_PREFILLER
    # Every instance is asked, so that each one without a plugin is logged, not only the first.
    prefillers = [p for p in prefillers if registry.plugin_running(p)]
    decoders = [d for d in decoders if registry.plugin_running(d)]
    if not prefillers or not decoders:
        return [], ColocatedReason.PLUGIN_NOT_RUNNING
    paired = [d for d in decoders if any([registry.compatible(p, d) for p in prefillers])]  # logs every pair
    return paired, None if paired else ColocatedReason.NO_COMPATIBLE_DECODER


def exceeds_every_buffer(decoders: list[Instance], prompt_tokens: int) -> bool:
    """The prompt's KV can never fit: every decoder announced a buffer, all smaller than it needs."""
    return bool(decoders) and all(
        d.capacity_slots is not None and chunks_needed(prompt_tokens, d.chunk_tokens) > d.capacity_slots
        for d in decoders)


def _chunk_tokens(instance: Instance) -> int:
    """Tokens per LMCache chunk of the instance (announced, else its fingerprint's; 0 when unknown)."""
    if instance.chunk_tokens > 0:
        return instance.chunk_tokens
    fingerprint = instance.fingerprint
    return fingerprint.chunk_tokens if fingerprint is not None else 0


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
