"""The receiving side of an NcclTransport: accepting senders, guarding writes, notifications.

:class:`Receiver` is composed into :class:`~lmcache_p2p.transport.nccl.transport.NcclTransport`
and shares its :class:`~lmcache_p2p.transport.nccl.state.NcclState`; it owns the receiver pairs,
the hooks they call from their threads (``recv_pair.py``) and the notifications of completed and
failed writes. See transport.py for the whole design.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import TYPE_CHECKING

from lmcache_p2p.errors import PeerUnreachable, ProtocolError
from lmcache_p2p.protocol import TransportInfo
from lmcache_p2p.transport.base import Notification
from lmcache_p2p.transport.nccl import wire
from lmcache_p2p.transport.nccl.pairs import RecvHooks, RecvPair
from lmcache_p2p.transport.nccl.state import NcclState

if TYPE_CHECKING:
    import torch

    from lmcache_p2p.transport.two_sided import WriteGuard

logger = logging.getLogger(__name__)

FAILED_WRITES_KEPT = 4096  # failed writes kept for get_failed_writes() when nobody drains them


class Receiver:
    """An NcclTransport's receiving side: one RecvPair (rank 0, with its thread) per accepted sender."""

    def __init__(self, state: NcclState, kind: str) -> None:
        self._st = state
        self._kind = kind
        self._name = state.name
        # Everything below changes under the state's lock (``_notified`` is a condition on it).
        self._notified = threading.Condition(state.lock)
        self._serving: dict[str, RecvPair] = {}  # the serving pair of each sender
        self._live: set[RecvPair] = set()  # every live receiver pair, pairing ones included
        self._notifs: collections.deque[Notification] = collections.deque()
        self._failed: collections.deque[Notification] = collections.deque(maxlen=FAILED_WRITES_KEPT)
        self._guard: WriteGuard | None = None
        self.hooks = RecvHooks(
            self._on_paired, self._on_pair_ended, self._notify, self._slot_view, self._region_bytes, self._admit,
            state.pairings.append, self._write_failed,
        )

    def serving(self, sender: str) -> RecvPair | None:
        with self._st.lock:
            return self._serving.get(sender)

    # Regions are only ever appended: the pair threads read them without the lock.
    def _region_bytes(self) -> list[int]:
        return [r.length for r in self._st.regions]

    def _slot_view(self, chunk: wire.ChunkDest) -> torch.Tensor:
        return self._st.views[chunk.region][chunk.offset : chunk.offset + chunk.nbytes]

    def set_write_guard(self, guard: WriteGuard | None) -> None:
        self._guard = guard

    def _admit(self, sender: str, header: wire.Header) -> None:
        """ProtocolError if the write guard refuses ``sender``'s write (the pair thread then ends)."""
        guard = self._guard
        if guard is None:
            return
        with self._st.lock:
            dests = [(self._st.regions[c.region].addr + c.offset, c.nbytes) for c in header.chunks]
        reason = guard(sender, dests, header.notif)
        if reason:
            raise ProtocolError(f"refused a write of {header.nbytes} bytes from {sender}: {reason}")

    def accept(self, peer: TransportInfo) -> None:
        """Start pairing with sender ``peer`` in a background thread; returns at once."""
        if peer.kind != self._kind:
            raise PeerUnreachable(f"peer {peer.name!r} speaks transport {peer.kind!r}, we speak {self._kind!r}")
        with self._st.lock:
            settings = self._st.check_open()
            pair = RecvPair(self.hooks, settings, peer.name)
            self._live.add(pair)
        pair.start()

    def disconnect(self, sender: str) -> list[RecvPair]:
        """Stop every pair of ``sender``, the serving one and any still pairing (a sender that said
        Goodbye right after its Hello must not leave a pair behind); returns them at once."""
        with self._st.lock:
            self._serving.pop(sender, None)
            pairs = [p for p in self._live if p.sender == sender]
        for pair in pairs:
            self._stop_pair(pair)
        return pairs

    def stop_all(self) -> list[RecvPair]:
        """Stop every pair and wake every ``wait_notifications`` (close); the caller joins them."""
        with self._st.lock:
            self._notified.notify_all()
            pairs = list(self._live)
            self._serving.clear()
            self._live.clear()
        for pair in pairs:
            self._stop_pair(pair)
        return pairs

    def clear(self) -> None:
        with self._st.lock:
            self._notifs.clear()
            self._failed.clear()

    def _on_paired(self, pair: RecvPair) -> bool:
        """A receiver pair is up: it becomes its sender's pair (an older one is stopped)."""
        with self._st.lock:
            if self._st.lifecycle.closed or pair.stopping:
                return False
            old = self._serving.get(pair.sender)
            self._serving[pair.sender] = pair
        if old is not None:
            self._stop_pair(old)
        return True

    def _on_pair_ended(self, pair: RecvPair) -> None:
        with self._st.lock:
            self._live.discard(pair)
            if self._serving.get(pair.sender) is pair:
                del self._serving[pair.sender]

    def _stop_pair(self, pair: RecvPair) -> None:
        """Stop a receiver pair, waking its store wait through our own store client."""
        with self._st.lock:
            store = self._st.store
        pair.stop(store)

    def _notify(self, sender: str, payload: bytes) -> None:
        with self._notified:
            self._notifs.append(Notification(peer=sender, payload=payload))
            self._notified.notify_all()

    def _write_failed(self, sender: str, payload: bytes, why: str) -> None:
        with self._notified:
            self._failed.append(Notification(peer=sender, payload=payload))
            self._notified.notify_all()
        logger.debug("%s: a write from %s failed: %s", self._name, sender, why)

    def get_failed_writes(self) -> list[Notification]:
        """Writes whose receives failed or never completed, reported once their pair was torn down."""
        with self._st.lock:
            self._st.check_open()
            out = list(self._failed)
            self._failed.clear()
        return out

    def get_notifications(self) -> list[Notification]:
        with self._st.lock:
            self._st.check_open()
            out = list(self._notifs)
            self._notifs.clear()
        return out

    def wait_notifications(self, timeout_s: float) -> list[Notification]:
        """Block until a notification arrives (woken by the pair threads), or [] after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._notified:
            self._st.check_open()
            while not self._notifs and not self._st.lifecycle.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._notified.wait(left)
        return self.get_notifications()
