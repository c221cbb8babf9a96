"""Routing policies: which of several candidate instances of one role gets a request (``--policy``).

One class per policy behind :class:`SelectionPolicy`:

* :class:`LeastLoaded` (``least_loaded``): the lowest load (the router passes the key: in-flight
  tokens, then free credit for a decoder); ties go round robin, so equal instances share the work.
  Deterministic: no random choice.
* :class:`RoundRobin` (``round_robin``): the next one in instance-id order.
* :class:`PrefixAware` (``prefix``): cache-aware in the style of SGLang's router. Load is balanced
  unless ``max - min > --prefix-balance-abs`` AND ``max > --prefix-balance-rel * min`` (in-flight
  requests among the candidates). Balanced: the instances holding the longest prefix of the prompt
  win when it covers at least ``--prefix-cache-threshold`` of it (ties: least loaded); otherwise,
  or when imbalanced, or when there are no token ids for the prompt, least loaded. Each decision is
  told to ``on_decision`` (``prefix_routed_total{decision}``).

Owns: the choice among candidates it is given. Must not: filter candidates (buffer credit,
fingerprints, exclusions are the router's, ``router/routing.py``), change the registry, or await.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable
from typing import Any, Protocol

from lmcache_p2p.config import Role
from lmcache_p2p.proxy.router.instances import Instance
from lmcache_p2p.proxy.router.prefix import PrefixSettings, PromptPrefix

Load = Callable[[Instance], Any]  # lower is better; comparable values
Matched = Callable[[Instance, PromptPrefix], int]  # prompt tokens an instance holds (the prefix index)


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


DecisionListener = Callable[[Role, PrefixDecision], None]


class SelectionPolicy(Protocol):
    def choose(self, role: Role, ordered: list[Instance], load: Load, prefix: PromptPrefix | None) -> Instance:
        """One of ``ordered`` (non-empty, in instance-id order) for a request of ``role``."""
        ...


class RoundRobin:
    def __init__(self) -> None:
        self._turn = {role: itertools.count() for role in Role}

    def choose(self, role: Role, ordered: list[Instance], load: Load, prefix: PromptPrefix | None) -> Instance:
        return ordered[next(self._turn[role]) % len(ordered)]


class LeastLoaded:
    def __init__(self) -> None:
        self._turn = {role: itertools.count() for role in Role}

    def choose(self, role: Role, ordered: list[Instance], load: Load, prefix: PromptPrefix | None) -> Instance:
        turn = next(self._turn[role])
        lowest = min(load(i) for i in ordered)
        tied = [i for i in ordered if load(i) == lowest]
        return tied[turn % len(tied)]


class PrefixAware:
    def __init__(self, settings: PrefixSettings, matched: Matched,
                 on_decision: list[DecisionListener] | None = None) -> None:
        self._settings = settings
        self._matched = matched
        self._least_loaded = LeastLoaded()
        self.on_decision = on_decision if on_decision is not None else []  # metrics

    def choose(self, role: Role, ordered: list[Instance], load: Load, prefix: PromptPrefix | None) -> Instance:
        decision, holders = self._holders(ordered, prefix)
        for listener in self.on_decision:
            listener(role, decision)
        return self._least_loaded.choose(role, holders or ordered, load, prefix)

    def _holders(self, ordered: list[Instance], prefix: PromptPrefix | None) -> tuple[PrefixDecision, list[Instance]]:
        """The candidates holding the longest prefix of the prompt when that one should win (else none)."""
        if prefix is None or prefix.tokens == 0:
            return PrefixDecision.NO_PREFIX, []
        if len(ordered) > 1 and self._imbalanced(ordered):
            return PrefixDecision.IMBALANCED, []
        matched = {i.instance_id: self._matched(i, prefix) for i in ordered}
        best = max(matched.values())
        if best == 0 or best / prefix.tokens < self._settings.cache_threshold:
            return PrefixDecision.NO_MATCH, []
        return PrefixDecision.MATCH, [i for i in ordered if matched[i.instance_id] == best]

    def _imbalanced(self, ordered: list[Instance]) -> bool:
        """SGLang's rule on in-flight requests: max - min > abs AND max > rel * min."""
        loads = [i.inflight_requests for i in ordered]
        most, least = max(loads), min(loads)
        s = self._settings
        return most - least > s.balance_abs_requests and most > s.balance_rel * least


def make_policy(policy: Policy, settings: PrefixSettings, matched: Matched,
                on_decision: list[DecisionListener] | None = None) -> SelectionPolicy:
    """The policy object for a ``--policy`` value."""
    if policy is Policy.ROUND_ROBIN:
        return RoundRobin()
    if policy is Policy.PREFIX:
        return PrefixAware(settings, matched, on_decision)
    return LeastLoaded()
