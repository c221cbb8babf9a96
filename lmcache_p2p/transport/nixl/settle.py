"""Polling and settling for the NIXL transport: a write's state from NIXL, and when its sources are free.

:class:`Settler` is composed into :class:`~lmcache_p2p.transport.nixl.transport.NixlTransport`
and shares its :class:`~lmcache_p2p.transport.nixl.state.NixlState` (see transport.py's module
docstring for the NIXL behaviour relied on). A write settles once NIXL reported it DONE (or it
was never posted); one NIXL failed (ERR, or a state check that raised) is given up: it never
settles. Disconnected peers whose writes were in flight are unloaded here once those settled.
"""

from __future__ import annotations

import logging
from typing import Any

from lmcache_p2p.errors import PeerUnreachable, TransportError
from lmcache_p2p.transport.base import WriteHandle
from lmcache_p2p.transport.nixl.records import Status, Xfer
from lmcache_p2p.transport.nixl.staging import StagedWrite
from lmcache_p2p.transport.nixl.state import NixlState

logger = logging.getLogger(__name__)


class Settler:
    """A NixlTransport's poll/abort/settle path, over the transport's shared state."""

    def __init__(self, state: NixlState) -> None:
        self._st = state

    def poll(self, handle: WriteHandle) -> bool:
        """True once the write completed (its handle is then released); TransportError if it failed."""
        if isinstance(handle.token, StagedWrite):
            return self._poll_staged(handle, handle.token)
        xfer: Xfer = handle.token
        with self._st.lock:
            agent = self._st.check_open()
            if not xfer.done and not xfer.error:
                self.advance(agent, xfer)
        if xfer.error:
            error = PeerUnreachable if xfer.unreachable else TransportError
            raise error(f"write of {handle.nbytes} bytes to {handle.peer} failed: {xfer.error}")
        return xfer.done

    def advance(self, agent: Any, xfer: Xfer) -> None:
        """Ask NIXL for the state of ``xfer``; finish it on DONE, give it up on ERR or a failed check."""
        try:
            status = Status(agent.check_xfer_state(xfer.xfer))
        except self._st.errors as exc:
            self.give_up(agent, xfer, f"state check failed: {exc}", isinstance(exc, self._st.disconnected))
            return
        if status is Status.DONE:
            self.finish(agent, xfer)
        elif status is Status.ERR:
            self.give_up(agent, xfer, "NIXL reported ERR")

    def _poll_staged(self, handle: WriteHandle, write: StagedWrite) -> bool:
        with self._st.lock:
            self._st.check_open()
            if not write.finished:
                self._st.ring.pump()
        if write.error:
            error = PeerUnreachable if write.unreachable else TransportError
            raise error(f"write of {handle.nbytes} bytes to {handle.peer} failed: {write.error}")
        return write.done

    def abort(self, handle: WriteHandle) -> None:
        """Fail an unfinished write for its caller; it stays in flight until NIXL finishes it
        (see the module docstring: NIXL cannot recall a put), so poll ``settled``."""
        with self._st.lock:
            if isinstance(handle.token, StagedWrite):
                if self._st.ring is not None and not handle.token.finished:
                    self._st.ring.abort(handle.token, "aborted")
                return
            xfer: Xfer = handle.token
            if not xfer.done and not xfer.error:
                xfer.error = "aborted"

    def settled(self, handle: WriteHandle) -> bool:
        """True once NIXL reported the write finished (DONE or ERR); advances it if need be."""
        with self._st.lock:
            agent = self._st.agent
            if isinstance(handle.token, StagedWrite):
                write: StagedWrite = handle.token
                if agent is not None and self._st.ring is not None and not write.settled:
                    self._st.ring.pump()
                return write.settled
            xfer: Xfer = handle.token
            if agent is not None and not xfer.settled and xfer.xfer is not None:
                self.advance(agent, xfer)
            if agent is not None and self._st.retiring:
                self.reap_retiring(agent)
            return xfer.settled

    def staged_done(self, xfer: Xfer) -> bool:
        """True once the transfer completed; TransportError once it failed AND nothing reads its slot.

        A transfer failed for its caller while still on the wire (its peer disconnected) keeps
        reading its ring slot until NIXL reports DONE: False until then, so the ring does not
        refill the slot under it. One given up (ERR, close, a reconnect) never ends: see
        ``staged_given_up``.
        """
        if not xfer.settled and xfer.xfer is not None and self._st.agent is not None:
            self.advance(self._st.agent, xfer)
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
        if not xfer.settled and xfer.xfer is not None and self._st.agent is not None:
            self.release(self._st.agent, xfer, "aborted", ended=False)

    def give_up(self, agent: Any, xfer: Xfer, error: str, unreachable: bool = False) -> None:
        """NIXL failed ``xfer`` but may still run its other puts: fail it, never settle it."""
        if not xfer.done and not xfer.error:
            xfer.unreachable = unreachable
        self.release(agent, xfer, error, ended=False)
        self._st.given_up += 1
        logger.warning("%s: a write to %s failed (%s) while NIXL may still read its sources: it never settles, its "
                       "memory stays in use (%d write(s) given up so far)", self._st.name, xfer.peer, error, self._st.given_up)

    def finish(self, agent: Any, xfer: Xfer) -> None:
        self.release(agent, xfer, "", ended=True)
        xfer.done = True

    def release(self, agent: Any, xfer: Xfer, error: str, *, ended: bool) -> None:
        """Free the NIXL handle and the write's temporary registrations; record ``error`` if any.

        ``ended``: NIXL reported the transfer DONE (or it was never posted), so nothing reads its
        sources and the write is settled. Otherwise (ERR, close, a reconnect) NIXL only attempts a
        cancel: the sources may still be read, the write never settles and its temporary
        registrations stay until close.
        """
        self._st.inflight.pop(id(xfer), None)
        if error and not xfer.done and not xfer.error:
            xfer.error = error
        released = True
        if xfer.xfer is not None:
            try:
                xfer.xfer.release()
            except self._st.errors:
                logger.warning("%s: NIXL could not release a write to %s (%s)", self._st.name, xfer.peer, error)
                released = False
            xfer.xfer = None
        for reg in xfer.temp:
            if released and ended:
                self._st.deregister(agent, reg)
            else:
                self._st.leaked.append(reg)
        xfer.temp = []
        xfer.settled = ended
        xfer.given_up = not ended

    def reap_retiring(self, agent: Any) -> None:
        """Advance writes to disconnected peers; unload each peer whose writes all settled."""
        st = self._st
        for peer in list(st.retiring):
            for xfer in [x for x in st.inflight.values() if x.peer == peer and x.xfer is not None]:
                self.advance(agent, xfer)
            if not any(x.peer == peer for x in st.inflight.values()):
                st.retiring.discard(peer)
                st.remove_remote(agent, peer)
