"""The hooks of two-sided transports: the receiver takes part in every write (NCCL: both sides post).

A one-sided transport (NIXL) writes into the receiver's memory without the receiver doing
anything but poll, so it never sees a write before it lands and never learns of one that failed;
it has none of these hooks. A two-sided one must pair with each sender, knows every write's
destinations before receiving it, and knows when a write it admitted will not land whole. Callers
ask :func:`two_sided` once and use the hooks only where it answers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from lmcache_p2p.protocol import TransportInfo
    from lmcache_p2p.transport.base import Notification, Transport

# (sender peer name, [(destination address, nbytes)], notification) -> "" to admit, else why not.
WriteGuard = Callable[[str, list[tuple[int, int]], bytes], str]


@runtime_checkable
class TwoSided(Protocol):
    """Receiver-side hooks of a transport whose receiver posts every write's receives."""

    def accept(self, peer: TransportInfo) -> None:
        """A sender said Hello: start pairing with it. Must not block (the control thread calls it)."""

    def set_write_guard(self, guard: WriteGuard | None) -> None:
        """Ask ``guard`` before receiving a write; a non-empty answer refuses it (nothing of it is
        received, the pair ends). Called from the transport's own threads."""

    def get_failed_writes(self) -> list[Notification]:
        """Notifications of admitted writes into our memory that will NOT land whole, since the last call.

        Reported only once nothing more of that write lands (its destinations may hold part of
        it): the receiver may fail its request and reuse those destinations at once.
        """


def two_sided(transport: Transport) -> TwoSided | None:
    """``transport``'s two-sided hooks, or None for a one-sided transport."""
    return transport if isinstance(transport, TwoSided) else None
