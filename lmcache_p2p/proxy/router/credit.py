"""Buffer credit: the receive slots the proxy promised requests on a decoder, and what is left.

A decoder announces its free receive slots (``free_slots``): every heartbeat, and at once (at most
one per 25 ms) whenever slots free up, so a request waiting in admission for a busy buffer hears of
the slots a moment after the decoder loaded the KV that held them. The proxy keeps a :class:`Commit`
per request it routed there, and a decoder's credit is ``announced free slots - promised``
(:func:`free_slots`):

* promised: a commit counts against the credit until every rank's announcement holds it, i.e. a
  heartbeat from every rank arrived after its KV settled (ready: every slot it takes is reserved),
  and while it is not returned.
* returned: the decoder no longer holds the request's KV (the decode loaded it: its first output
  arrived; the proxy cancelled it; it failed; :meth:`Lease.return_credit`). A returned commit no
  longer counts against the credit, and never adds to it: whether the slots are free again is the
  decoder's to say (its announcement after the release), since an announcement the proxy hears
  before the first output may already count them free.
* a returned commit is forgotten once a heartbeat from every rank arrived after it was returned.

Errors lean towards too little credit: a commit that was partly reserved when an announcement was
taken counts twice until its KV settles and the next announcement holds it.

A :class:`Lease` is one request's claim on one instance: in-flight load and, on a decoder, a commit.
Every change that may free credit is told to the lease's owner (the registry, which tells the
admission queue). The decoder-side questions of routing (does the KV fit now, can it ever) live
here too.

Owns: commits, leases, and the credit arithmetic. Must not: choose instances, add or forget them,
log, or await (a lease is released inside cancelled tasks).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Protocol

from lmcache_p2p.proxy.errors import NoCapacity

if TYPE_CHECKING:
    from lmcache_p2p.proxy.router.instances import Instance, RankInfo


@dataclasses.dataclass(eq=False)
class Commit:
    """Receive slots the proxy promised one request on one decoder."""

    chunks: int
    settled_at_s: float | None = None  # the KV is ready (every slot reserved) or failed
    returned_at_s: float | None = None  # the decoder no longer holds it: loaded, cancelled or failed


class LeaseOwner(Protocol):
    """Who hears of a lease's changes (the registry)."""

    def now(self) -> float: ...

    def credit_changed(self) -> None: ...

    def released(self, instance: Instance) -> None: ...


def free_slots(ranks: list[RankInfo], commits: list[Commit]) -> int:
    """Announced free slots (the fullest rank's) - promised and not yet announced or returned."""
    oldest_s = min(r.last_seen_s for r in ranks)
    free = min(r.free_slots for r in ranks)
    for c in commits:
        announced_held = c.settled_at_s is not None and c.settled_at_s < oldest_s
        if c.returned_at_s is None and not announced_held:
            free -= c.chunks
    return free


def unabsorbed(ranks: list[RankInfo], commits: list[Commit]) -> list[Commit]:
    """The commits that not every rank's announcement reflects yet (returned ones heard of are dropped)."""
    heard_s = min((r.last_seen_s for r in ranks), default=-math.inf)
    return [c for c in commits if c.returned_at_s is None or c.returned_at_s >= heard_s]


class Lease:
    """One request's claim on one instance: in-flight load and, on a decoder, buffer credit."""

    def __init__(self, registry: LeaseOwner, instance: Instance, tokens: int, chunks: int) -> None:
        self.instance = instance
        self._registry = registry
        self._tokens = tokens
        self._commit = Commit(chunks) if chunks > 0 else None
        self._released = False
        instance.inflight_requests += 1
        instance.inflight_tokens += tokens
        if self._commit is not None:
            instance.commits.append(self._commit)

    @property
    def chunks(self) -> int:
        """Receive slots this lease promised (0: no KV comes with it)."""
        return self._commit.chunks if self._commit is not None else 0

    def resize_commit(self, chunks: int) -> None:
        """Replace the estimate with the exact chunk count once the prompt is tokenized."""
        if self._commit is not None and self._commit.settled_at_s is None and self._commit.returned_at_s is None:
            shrank = chunks < self._commit.chunks
            self._commit.chunks = chunks
            if shrank:  # the estimate was high: credit frees
                self._registry.credit_changed()

    def settle(self) -> None:
        """The request's KV is ready or failed: the decoder's next heartbeat accounts for it."""
        if self._commit is not None and self._commit.settled_at_s is None:
            self._commit.settled_at_s = self._registry.now()

    def return_credit(self) -> None:
        """The decoder no longer holds this request's KV (loaded, cancelled or failed): the commit stops
        counting against the credit. Idempotent; does not await."""
        commit = self._commit
        if commit is None or commit.returned_at_s is not None:
            return
        commit.returned_at_s = self._registry.now()
        self.instance._absorb_commits()
        self._registry.credit_changed()

    def release(self) -> None:
        """Idempotent; safe inside a cancelled task (does not await). Returns the credit too."""
        if self._released:
            return
        self._released = True
        if self._commit is not None and self._commit.returned_at_s is None:
            self._commit.returned_at_s = self._registry.now()
        self.instance._absorb_commits()
        self.instance.inflight_requests -= 1
        self.instance.inflight_tokens -= self._tokens
        self._registry.released(self.instance)
        self._registry.credit_changed()

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def chunks_needed(prompt_tokens: int, chunk_tokens: int) -> int:
    """Receive slots a prompt's KV takes on a decoder (0 when its chunk size is unknown)."""
    return math.ceil(prompt_tokens / chunk_tokens) if chunk_tokens > 0 else 0


def fits(decoder: Instance, prompt_tokens: int) -> bool:
    """The decoder's credit holds the prompt's KV now (always, when its capacity is unknown)."""
    free = decoder.free_slots()
    return free is None or chunks_needed(prompt_tokens, decoder.chunk_tokens) <= free


def exceeds_every_buffer(decoders: list[Instance], prompt_tokens: int) -> bool:
    """The prompt's KV can never fit: every decoder announced a buffer, all smaller than it needs."""
    return bool(decoders) and all(
        d.capacity_slots is not None and chunks_needed(prompt_tokens, d.chunk_tokens) > d.capacity_slots
        for d in decoders)


def no_capacity(decoders: list[Instance], prompt_tokens: int) -> NoCapacity:
    needs = {d.instance_id: chunks_needed(prompt_tokens, d.chunk_tokens) for d in decoders}
    if exceeds_every_buffer(decoders, prompt_tokens):
        largest = max(decoders, key=lambda d: d.capacity_slots or 0)
        return NoCapacity(
            f"request needs {needs[largest.instance_id]} KV chunks (~{prompt_tokens} prompt tokens) but the largest "
            f"decoder buffer holds {largest.capacity_slots} chunks: raise p2p.buffer_size on the decoders "
            f"(lmcache-p2p launch --buffer-size) to at least {needs[largest.instance_id]} chunks' worth"
        )
    freest = max(decoders, key=lambda d: d.free_slots() or 0)
    return NoCapacity(
        f"every decoder buffer is busy: the request needs {needs[freest.instance_id]} KV chunks "
        f"(~{prompt_tokens} prompt tokens), the most free now is {max(freest.free_slots() or 0, 0)} of "
        f"{freest.capacity_slots} on {freest.instance_id}; retry later or add decoders"
    )
