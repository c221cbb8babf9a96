"""The nonces of accepted control frames (``protocol.Codec``): a frame replayed within the
authentication window is refused, and the memory this takes is bounded."""

from __future__ import annotations

import collections

from lmcache_p2p.errors import ReplayError, StaleFrameError


class ReplayCache:
    """Nonces accepted within the window, bounded: evicting one raises a timestamp floor below which
    every frame is refused, so a frame whose nonce was forgotten can never be accepted again."""

    def __init__(self, max_entries: int) -> None:
        self._max_entries = max_entries
        self._seen: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # nonce -> stamp (ms)
        self.floor_ms = 0

    def check_and_add(self, nonce: bytes, stamp_ms: int, now_ms: int, window_ms: int) -> None:
        if stamp_ms <= self.floor_ms:
            raise StaleFrameError(f"control frame stamped {stamp_ms} ms is at or below the replay floor "
                                  f"{self.floor_ms} ms (replay cache full: {self._max_entries} nonces)")
        if nonce in self._seen:
            raise ReplayError(f"control frame replayed: nonce {nonce.hex()} was already accepted within "
                              f"the last {window_ms / 1000:.0f} s (p2p.auth_window_s)")
        while self._seen:  # forget nonces whose frames are stale anyway
            oldest, oldest_ms = next(iter(self._seen.items()))
            if oldest_ms >= now_ms - window_ms and len(self._seen) < self._max_entries:
                break
            del self._seen[oldest]
            if oldest_ms >= now_ms - window_ms:
                self.floor_ms = max(self.floor_ms, oldest_ms)
        self._seen[nonce] = stamp_ms

    def __len__(self) -> int:
        return len(self._seen)
