"""The receiving side of an NcclTransport: accepting senders, guarding writes, notifications.

A part of :class:`~lmcache_p2p.transport.nccl.transport.NcclTransport` (its attributes are set
there): the hooks its receiver pairs (``recv_pair.py``) call from their threads, and the
notifications of completed and failed writes. See transport.py for the whole design.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from lmcache_p2p.errors import PeerUnreachable, ProtocolError
from lmcache_p2p.protocol import Region, TransportInfo
from lmcache_p2p.transport.base import Notification, WriteGuard
from lmcache_p2p.transport.nccl import wire
from lmcache_p2p.transport.nccl.pairs import PairSettings, RecvHooks, RecvPair

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class ReceiveSide:
    """NcclTransport's receiver half (a mixin: the state is NcclTransport's)."""

    kind: str
    _name: str
    _lock: threading.RLock
    _closed: bool
    _store: Any
    _s: PairSettings
    _hooks: RecvHooks
    _regions: list[Region]
    _views: list[Any]
    _notified: threading.Condition
    _receivers: dict[str, RecvPair]
    _recv_threads: set[RecvPair]
    _notifs: collections.deque[Notification]
    _failed: collections.deque[Notification]
    _guard: WriteGuard | None

    def _region_bytes(self) -> list[int]:
        return [r.length for r in self._regions]

    def _slot_view(self, chunk: wire.ChunkDest) -> torch.Tensor:
        return self._views[chunk.region][chunk.offset : chunk.offset + chunk.nbytes]

    # ---- receiver side --------------------------------------------------------------------------

    def set_write_guard(self, guard: WriteGuard | None) -> None:
        self._guard = guard

    def _admit(self, sender: str, header: wire.Header) -> None:
        """ProtocolError if the write guard refuses ``sender``'s write (the pair thread then ends)."""
        guard = self._guard
        if guard is None:
            return
        with self._lock:
            dests = [(self._regions[c.region].addr + c.offset, c.nbytes) for c in header.chunks]
        reason = guard(sender, dests, header.notif)
        if reason:
            raise ProtocolError(f"refused a write of {header.nbytes} bytes from {sender}: {reason}")

    def accept(self, peer: TransportInfo) -> None:
        """Start pairing with sender ``peer`` in a background thread; returns at once."""
        if peer.kind != self.kind:
            raise PeerUnreachable(f"peer {peer.name!r} speaks transport {peer.kind!r}, we speak {self.kind!r}")
        with self._lock:
            self._check_open()
            pair = RecvPair(self._hooks, self._s, peer.name)
            self._recv_threads.add(pair)
        pair.start()

    def _on_paired(self, pair: RecvPair) -> bool:
        """A receiver pair is up: it becomes its sender's pair (an older one is stopped)."""
        with self._lock:
            if self._closed or pair.stopping:
                return False
            old = self._receivers.get(pair.sender)
            self._receivers[pair.sender] = pair
        if old is not None:
            self._stop_receiver(old)
        return True

    def _on_pair_ended(self, pair: RecvPair) -> None:
        with self._lock:
            self._recv_threads.discard(pair)
            if self._receivers.get(pair.sender) is pair:
                del self._receivers[pair.sender]

    def _stop_receiver(self, pair: RecvPair) -> None:
        """Stop a receiver pair, waking its store wait through our own store client."""
        with self._lock:
            store = self._store
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
        with self._lock:
            self._check_open()
            out = list(self._failed)
            self._failed.clear()
        return out

    def get_notifications(self) -> list[Notification]:
        with self._lock:
            self._check_open()
            out = list(self._notifs)
            self._notifs.clear()
        return out

    def wait_notifications(self, timeout_s: float) -> list[Notification]:
        """Block until a notification arrives (woken by the pair threads), or [] after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._notified:
            while not self._notifs and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._notified.wait(left)
        return self.get_notifications()
