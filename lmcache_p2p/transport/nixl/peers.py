"""The NIXL transport's peers: loading a receiver's agent metadata, and forgetting it safely.

:class:`Peers` is composed into :class:`~lmcache_p2p.transport.nixl.transport.NixlTransport`
and shares its :class:`~lmcache_p2p.transport.nixl.state.NixlState`. A peer's agent stays
loaded after ``disconnect`` while writes to it are in flight (NIXL answers nothing about a
transfer to an agent it no longer knows); the Settler unloads it once they settled.
"""

from __future__ import annotations

import logging
from typing import Any

from lmcache_p2p.errors import PeerUnreachable
from lmcache_p2p.protocol import TransportInfo
from lmcache_p2p.transport.nixl.records import Peer, spans_of
from lmcache_p2p.transport.nixl.settle import Settler
from lmcache_p2p.transport.nixl.state import NixlState

logger = logging.getLogger(__name__)


class Peers:
    """Connects to and forgets remote agents, over the transport's shared state."""

    def __init__(self, state: NixlState, settle: Settler, kind: str) -> None:
        self._st = state
        self._settle = settle
        self._kind = kind

    def connect(self, peer: TransportInfo) -> str:
        """Load the peer's agent metadata (local work only: UCX connects on the first write).

        Idempotent; new metadata under a known name (the peer restarted or registered more
        memory) replaces the old.
        """
        if peer.kind != self._kind:
            raise PeerUnreachable(f"peer {peer.name!r} speaks transport {peer.kind!r}, we speak {self._kind!r}")
        st = self._st
        with st.lock:
            agent = st.check_open()
            if peer.name in st.retiring:
                self._give_up_retiring(agent, peer.name)
            known = st.peers.get(peer.name)
            if known is not None and known.metadata == peer.metadata:
                known.spans = spans_of(peer.regions)
                return known.name
            if known is not None:
                self.forget(agent, peer.name)
            try:
                loaded = agent.add_remote_agent(peer.metadata)
            except st.errors as exc:
                raise PeerUnreachable(
                    f"NIXL rejected the metadata of peer {peer.name!r} ({len(peer.metadata)} bytes): {exc}"
                ) from exc
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if name != peer.name:
                st.remove_remote(agent, name)
                raise PeerUnreachable(f"peer announced itself as {peer.name!r} but its NIXL agent is {name!r}")
            st.peers[name] = Peer(name, bytes(peer.metadata), spans_of(peer.regions))
        logger.debug("%s connected to %s (%d regions)", st.name, name, len(peer.regions))
        return name

    def forget(self, agent: Any, peer: str) -> None:
        """Fail our writes to ``peer``; unload its agent now, or once its writes in flight settled."""
        st = self._st
        if st.peers.pop(peer, None) is None:
            return
        if st.ring is not None:
            st.ring.fail_peer(peer, f"peer {peer} disconnected")
        live = [x for x in st.inflight.values() if x.peer == peer]
        for xfer in live:
            if not xfer.done and not xfer.error:
                xfer.error = f"peer {peer} disconnected"
        if live:
            st.retiring.add(peer)  # NIXL cannot report on a write to an agent it no longer knows
        else:
            st.remove_remote(agent, peer)

    def _give_up_retiring(self, agent: Any, peer: str) -> None:
        """``peer`` reconnects under the same name before its old writes settled: they never will."""
        st = self._st
        stuck = [x for x in st.inflight.values() if x.peer == peer]
        for xfer in stuck:
            self._settle.release(agent, xfer, f"peer {peer} reconnected", ended=False)
        logger.warning("%s: %s reconnected with %d old write(s) still in flight; they never settle", st.name,
                       peer, len(stuck))
        st.retiring.discard(peer)
        st.remove_remote(agent, peer)
