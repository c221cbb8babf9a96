"""The router: which instances serve a request, and how.

Modes. The request flow (``flow/flow.py``) asks the router in this order:

1. disaggregated: a prefiller computes the prompt and sends its KV to a decoder, which decodes.
   :func:`pairable` names the decoders that may take KV from some prefiller: both run the LMCache
   plugin (a live announcement from every rank) and their KV fingerprints agree
   (``Registry.compatible``, ``router/pairing.py``). The request then waits in the admission queue
   (``router/admission.py``) for buffer credit on one of them (``router/credit.py``).
2. colocated (:class:`ColocatedReason`): one instance serves the whole request as a plain
   completion, no KV transfer: the least loaded prefiller when no decoder is routable or none is
   compatible with any prefiller; the least loaded decoder (it computes the prompt itself) when no
   prefiller is routable or reachable, when no prefiller or no decoder runs the plugin, when a
   prefill broke before its first token and no other prefiller is left, or when admission gave up
   (no buffer credit within ``--admission-timeout-s``, the admission queue full, or the prompt's KV
   larger than every buffer).
3. 503 only when no instance at all is routable.

Decoder choice (disaggregated): a decoder is eligible when its receive buffer has credit for the
request's KV now (``ceil(prompt_tokens / chunk_tokens)`` slots against announced free slots minus
the proxy's own promises, see ``router/credit.py``); decoders that did not announce a capacity are always
eligible, and so is every decoder for a request whose KV will not be sent (``needs_kv=False``: it
recomputes). Among eligible ones the ``--policy`` chooses (``router/policies.py``, one class per policy:
``least_loaded``, ``round_robin``, ``prefix``); a decoder's load is its in-flight tokens (prompt +
max output), then the most free buffer credit. For ``prefix`` the router keeps, per instance, the
prompt chunks it recently sent there (``router/prefix.py``; a decoder also holds the output it
generated).

Prefiller choice: among those compatible with the chosen decoder, by the same policy, on in-flight
prompt tokens.

``exclude`` names instances to avoid (a retry after a failure); when nothing else is left they are
used anyway.

Owns: the choice of instances and the prefix index. Must not: change instances or leases (the
registry's), wait (admission's), or await.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Collection

from lmcache_p2p.config import Role
from lmcache_p2p.proxy.router.credit import chunks_needed
from lmcache_p2p.proxy.router.lease import exceeds_every_buffer, fits, no_capacity
from lmcache_p2p.proxy.errors import NoInstanceAvailable
from lmcache_p2p.proxy.router.policies import DecisionListener, Load, Policy, PrefixDecision, make_policy
from lmcache_p2p.proxy.router.prefix import PrefixIndex, PrefixSettings, PromptPrefix, none_hash
from lmcache_p2p.proxy.router.registry import Instance, Registry

__all__ = ["ColocatedReason", "Policy", "PrefixDecision", "RequestCost", "Router", "chunks_needed",
           "exceeds_every_buffer", "no_capacity", "pairable"]


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
    OUTPUT_AWARE_SAMPLING = "output_aware_sampling"  # penalties / bad_words read output tokens: one instance (flow/flow.py)
    ONE_TOKEN_RENDERED = "one_token_rendered"  # max_tokens 1 of a chat its parsers answer: one chat endpoint serves it


@dataclasses.dataclass(frozen=True)
class RequestCost:
    prompt_tokens: int
    max_output_tokens: int

    @property
    def decode_tokens(self) -> int:
        return self.prompt_tokens + self.max_output_tokens


class Router:
    def __init__(self, policy: Policy, prefix: PrefixSettings | None = None) -> None:
        self.policy = Policy(policy)
        self.prefix_settings = prefix or PrefixSettings()
        self.index = PrefixIndex(self.prefix_settings.index_chunks)
        self._start_hash = none_hash(self.prefix_settings.hash_seed)
        self.on_prefix_decision: list[DecisionListener] = []  # metrics
        self._choose = make_policy(self.policy, self.prefix_settings, self.matched_tokens,
                                   self.on_prefix_decision).choose

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
        fitting = [d for d in decoders if fits(d, cost.prompt_tokens)]
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
        return self._pick(Role.SENDER, _prefer(prefillers, exclude), _prefiller_load, prefix)

    def _pick(self, role: Role, candidates: list[Instance], load: Load, prefix: PromptPrefix | None) -> Instance:
        return self._choose(role, sorted(candidates, key=lambda i: i.instance_id), load, prefix)


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


def _chunk_tokens(instance: Instance) -> int:
    """Tokens per LMCache chunk of the instance (announced, else its fingerprint's; 0 when unknown)."""
    if instance.chunk_tokens > 0:
        return instance.chunk_tokens
    fingerprint = instance.fingerprint
    return fingerprint.chunk_tokens if fingerprint is not None else 0


def _decoder_load(decoder: Instance) -> tuple[int, int]:
    """Lower is better: in-flight tokens, then the most free credit (unknown counts as none)."""
    return decoder.inflight_tokens, -(decoder.free_slots() or 0)


def _prefiller_load(prefiller: Instance) -> int:
    return prefiller.inflight_tokens


def _prefer(candidates: list[Instance], exclude: Collection[str]) -> list[Instance]:
    kept = [i for i in candidates if i.instance_id not in exclude]
    return kept or candidates
