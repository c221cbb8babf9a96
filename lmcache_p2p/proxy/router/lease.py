"""A request's claim on one instance (:class:`Lease`: its load there and, on a decoder, its commit against
the buffer credit, ``router/credit.py``), and the decoder-side questions of routing: does a prompt's KV
fit now, can it ever.

Every change that may free credit is told to the lease's owner (the registry, which tells the
admission queue). The instance keeps the counts (``Instance.hold`` / ``return_credit`` / ``release``);
a lease calls only those.

Must not: choose instances, add or forget them, log, or await (a lease is released inside cancelled
tasks).
"""

from __future__ import annotations

from typing import Protocol

from lmcache_p2p.proxy.errors import NoCapacity
from lmcache_p2p.proxy.router.credit import chunks_needed
from lmcache_p2p.proxy.router.instances import Instance


class LeaseOwner(Protocol):
    """Who hears of a lease's changes (the registry)."""

    def now(self) -> float: ...

    def credit_changed(self) -> None: ...

    def released(self, instance: Instance) -> None: ...


class Lease:
    """One request's claim on one instance: in-flight load and, on a decoder, buffer credit."""

    def __init__(self, registry: LeaseOwner, instance: Instance, tokens: int, chunks: int) -> None:
        self.instance = instance
        self._registry = registry
        self._tokens = tokens
        self._commit = instance.hold(tokens, chunks)
        self._released = False

    @property
    def chunks(self) -> int:
        """Receive slots this lease promised (0: no KV comes with it)."""
        return self._commit.chunks if self._commit is not None else 0

    def resize_commit(self, chunks: int) -> None:
        """Replace the estimate with the exact chunk count once the prompt is tokenized."""
        if self._commit is not None and self._commit.resize(chunks):  # the estimate was high: credit frees
            self._registry.credit_changed()

    def settle(self) -> None:
        """The request's KV is ready or failed: the decoder's next heartbeat accounts for it."""
        if self._commit is not None:
            self._commit.settle(self._registry.now())

    def return_credit(self) -> None:
        """The decoder no longer holds this request's KV (loaded, cancelled or failed): the commit stops
        counting against the credit. Idempotent; does not await."""
        if self._commit is not None and self.instance.return_credit(self._commit, self._registry.now()):
            self._registry.credit_changed()

    def release(self) -> None:
        """Idempotent; safe inside a cancelled task (does not await). Returns the credit too."""
        if self._released:
            return
        self._released = True
        self.instance.release(self._tokens, self._commit, self._registry.now())
        self._registry.released(self.instance)
        self._registry.credit_changed()

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


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
