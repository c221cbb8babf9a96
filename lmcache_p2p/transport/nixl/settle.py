"""Polling and settling for the NIXL transport: a write's state from NIXL, and when its sources are free.

A part of :class:`~lmcache_p2p.transport.nixl.transport.NixlTransport` (its state is set there;
see its module docstring). A write settles once NIXL reported it DONE (or it was never posted);
one NIXL failed (ERR, or a state check that raised) is given up: it never settles.
"""

from __future__ import annotations

import logging
from typing import Any

from lmcache_p2p.errors import PeerUnreachable, TransportError
from lmcache_p2p.transport.base import WriteHandle
from lmcache_p2p.transport.nixl.records import NixlState, Peer, Status, Xfer
from lmcache_p2p.transport.nixl.staging import StagedWrite

logger = logging.getLogger(__name__)


class WriteSettling(NixlState):
    """NixlTransport's poll/abort/settle path and the staging ring's port (a mixin)."""


    def poll(self, handle: WriteHandle) -> bool:
        """True once the write completed (its handle is then released); TransportError if it failed."""
        if isinstance(handle.token, StagedWrite):
            return self._poll_staged(handle, handle.token)
        xfer: Xfer = handle.token
        with self._lock:
            agent = self._check_open()
            if not xfer.done and not xfer.error:
                self._advance(agent, xfer)
        if xfer.error:
            error = PeerUnreachable if xfer.unreachable else TransportError
            raise error(f"write of {handle.nbytes} bytes to {handle.peer} failed: {xfer.error}")
        return xfer.done

    def _advance(self, agent: Any, xfer: Xfer) -> None:
        """Ask NIXL for the state of ``xfer``; finish it on DONE, give it up on ERR or a failed check."""
        try:
            status = Status(agent.check_xfer_state(xfer.xfer))
        except self._errors as exc:
            self._give_up(agent, xfer, f"state check failed: {exc}", isinstance(exc, self._disconnected))
            return
        if status is Status.DONE:
            self._finish(agent, xfer)
        elif status is Status.ERR:
            self._give_up(agent, xfer, "NIXL reported ERR")

    def _poll_staged(self, handle: WriteHandle, write: StagedWrite) -> bool:
        with self._lock:
            self._check_open()
            if not write.finished:
                self._ring.pump()
        if write.error:
            error = PeerUnreachable if write.unreachable else TransportError
            raise error(f"write of {handle.nbytes} bytes to {handle.peer} failed: {write.error}")
        return write.done

    def abort(self, handle: WriteHandle) -> None:
        """Fail an unfinished write for its caller; it stays in flight until NIXL finishes it
        (see the module docstring: NIXL cannot recall a put), so poll ``settled``."""
        with self._lock:
            if isinstance(handle.token, StagedWrite):
                if self._ring is not None and not handle.token.finished:
                    self._ring.abort(handle.token, "aborted")
                return
            xfer: Xfer = handle.token
            if not xfer.done and not xfer.error:
                xfer.error = "aborted"

    def settled(self, handle: WriteHandle) -> bool:
        """True once NIXL reported the write finished (DONE or ERR); advances it if need be."""
        with self._lock:
            agent = self._agent
            if isinstance(handle.token, StagedWrite):
                write: StagedWrite = handle.token
                if agent is not None and self._ring is not None and not write.settled:
                    self._ring.pump()
                return write.settled
            xfer: Xfer = handle.token
            if agent is not None and not xfer.settled and xfer.xfer is not None:
                self._advance(agent, xfer)
            if agent is not None and self._retiring:
                self._reap_retiring(agent)
            return xfer.settled

    def staged_done(self, xfer: Xfer) -> bool:
        """True once the transfer completed; TransportError once it failed AND nothing reads its slot.

        A transfer failed for its caller while still on the wire (its peer disconnected) keeps
        reading its ring slot until NIXL reports DONE: False until then, so the ring does not
        refill the slot under it. One given up (ERR, close, a reconnect) never ends: see
        ``staged_given_up``.
        """
        if not xfer.settled and xfer.xfer is not None and self._agent is not None:
            self._advance(self._agent, xfer)
        if xfer.error:
            if not xfer.settled:
                return False
            raise TransportError(f"staged write to {xfer.peer} failed: {xfer.error}")
        return xfer.done

    def staged_given_up(self, xfer: Xfer) -> tuple[str, bool] | None:
        """(why, peer unreachable) once ``xfer`` was given up (its slot may be read for good), else None."""
        return (xfer.error, xfer.unreachable) if xfer.given_up else None

    def drop_staged(self, xfer: Xfer) -> None:
        """The ring closes with ``xfer`` reading one of its slots (ring memory, not a caller's)."""
        if not xfer.settled and xfer.xfer is not None and self._agent is not None:
            self._release(self._agent, xfer, "aborted", ended=False)

    def _give_up(self, agent: Any, xfer: Xfer, error: str, unreachable: bool = False) -> None:
        """NIXL failed ``xfer`` but may still run its other puts: fail it, never settle it."""
        if not xfer.done and not xfer.error:
            xfer.unreachable = unreachable
        self._release(agent, xfer, error, ended=False)
        self.given_up += 1
        logger.warning("%s: a write to %s failed (%s) while NIXL may still read its sources: it never settles, its "
                       "memory stays in use (%d write(s) given up so far)", self._name, xfer.peer, error, self.given_up)

    def _finish(self, agent: Any, xfer: Xfer) -> None:
        self._release(agent, xfer, "", ended=True)
        xfer.done = True

    def _release(self, agent: Any, xfer: Xfer, error: str, *, ended: bool) -> None:
        """Free the NIXL handle and the write's temporary registrations; record ``error`` if any.

        ``ended``: NIXL reported the transfer DONE (or it was never posted), so nothing reads its
        sources and the write is settled. Otherwise (ERR, close, a reconnect) NIXL only attempts a
        cancel: the sources may still be read, the write never settles and its temporary
        registrations stay until close.
        """
        self._inflight.pop(id(xfer), None)
        if error and not xfer.done and not xfer.error:
            xfer.error = error
        released = True
        if xfer.xfer is not None:
            try:
                xfer.xfer.release()
            except self._errors:
                logger.warning("%s: NIXL could not release a write to %s (%s)", self._name, xfer.peer, error)
                released = False
            xfer.xfer = None
        for reg in xfer.temp:
            if released and ended:
                self._deregister(agent, reg)
            else:
                self._leaked.append(reg)
        xfer.temp = []
        xfer.settled = ended
        xfer.given_up = not ended
