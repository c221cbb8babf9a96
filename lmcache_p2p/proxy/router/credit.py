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

An instance keeps its own commits and load (``Instance.hold`` / ``release``); a request's claim on it
is a ``router/lease.py`` ``Lease``.

Owns: the commit and the credit arithmetic, over plain data. Must not: know instances, leases or
requests, log, or await.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Protocol


@dataclasses.dataclass(eq=False)
class Commit:
    """Receive slots the proxy promised one request on one decoder."""

    chunks: int
    settled_at_s: float | None = None  # the KV is ready (every slot reserved) or failed
    returned_at_s: float | None = None  # the decoder no longer holds it: loaded, cancelled or failed

    def resize(self, chunks: int) -> bool:
        """The exact count in place of the estimate while nothing settled or returned it; True when it shrank."""
        if self.settled_at_s is not None or self.returned_at_s is not None:
            return False
        shrank = chunks < self.chunks
        self.chunks = chunks
        return shrank

    def settle(self, now_s: float) -> None:
        if self.settled_at_s is None:
            self.settled_at_s = now_s


class Announced(Protocol):
    """What one rank last announced, as the arithmetic reads it (``instances.RankInfo``)."""

    @property
    def free_slots(self) -> int: ...

    @property
    def last_seen_s(self) -> float: ...


def free_slots(ranks: Sequence[Announced], commits: list[Commit]) -> int:
    """Announced free slots (the fullest rank's) - promised and not yet announced or returned."""
    oldest_s = min(r.last_seen_s for r in ranks)
    free = min(r.free_slots for r in ranks)
    for c in commits:
        announced_held = c.settled_at_s is not None and c.settled_at_s < oldest_s
        if c.returned_at_s is None and not announced_held:
            free -= c.chunks
    return free


def unabsorbed(ranks: Sequence[Announced], commits: list[Commit]) -> list[Commit]:
    """The commits that not every rank's announcement reflects yet (returned ones heard of are dropped)."""
    heard_s = min((r.last_seen_s for r in ranks), default=-math.inf)
    return [c for c in commits if c.returned_at_s is None or c.returned_at_s >= heard_s]


def chunks_needed(prompt_tokens: int, chunk_tokens: int) -> int:
    """Receive slots a prompt's KV takes on a decoder (0 when its chunk size is unknown)."""
    return math.ceil(prompt_tokens / chunk_tokens) if chunk_tokens > 0 else 0
