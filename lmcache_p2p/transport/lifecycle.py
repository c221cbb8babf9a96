"""A transport's lifecycle: built (nothing open), started (sockets, threads, agents), closed.

Construction only records settings, so it is cheap and cannot leave anything open; ``start()``
opens what the transport needs and, should that fail, closes what it opened before raising.
``close()`` is idempotent and safe in every phase. Every other call needs a started transport
and raises :class:`~lmcache_p2p.errors.ClosedError` before ``start()`` and after ``close()``.
Transitions happen under the owning transport's lock.
"""

from __future__ import annotations

import enum

from lmcache_p2p.errors import ClosedError


class Phase(enum.Enum):
    BUILT = "built"
    OPEN = "open"
    CLOSED = "closed"


class Lifecycle:
    """The phase of one transport, and the checks its calls make against it."""

    def __init__(self, what: str) -> None:
        self.what = what  # names the transport in errors, e.g. "NCCL transport 'rx'"
        self.phase = Phase.BUILT

    @property
    def closed(self) -> bool:
        return self.phase is Phase.CLOSED

    def begin_start(self) -> bool:
        """True when the caller should open the transport now; False if it is open already (a
        second ``start()`` does nothing); ClosedError once closed (a failed start closes too)."""
        if self.phase is Phase.CLOSED:
            raise ClosedError(f"{self.what} is closed; build a new one to start again")
        return self.phase is Phase.BUILT

    def opened(self) -> None:
        self.phase = Phase.OPEN

    def begin_close(self) -> bool:
        """True the first time (the caller releases everything now); False afterwards."""
        if self.phase is Phase.CLOSED:
            return False
        self.phase = Phase.CLOSED
        return True

    def check_open(self) -> None:
        if self.phase is Phase.OPEN:
            return
        if self.phase is Phase.CLOSED:
            raise ClosedError(f"{self.what} is closed")
        raise ClosedError(f"{self.what} is not started: call start() first")
