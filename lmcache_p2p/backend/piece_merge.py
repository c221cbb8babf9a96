"""The receiver's piece merger: a request fed by several sender ranks, made one request again.

When the prefiller's TP size is larger than the decoder's, each decoder rank gets every chunk as
several pieces, one per sender rank that holds some of its heads (``kv_layout``). Each sender
rank's share is its own request in the grant table, ``req_id~index/count``, with its own slots
and writer, so every slot keeps exactly one writer (``buffer/pool.py``). The merger stands
between the grant table and what it tells the rest:

  * ``landed``: a piece is kept out of the chunk index until every piece of its chunk landed; then
    the pieces are merged into the first piece's slot (``relayout.merge_pieces``), that chunk is
    published under its key, and the other pieces' slots are freed (never cached: the grant table
    reserves them without a key, :func:`caches_key`);
  * ``report``: one KvReady for the request once every share is ready (bytes summed), one KvFailed
    when any share fails; the other shares are then cancelled (``flush``, on the service thread,
    outside the grant table's lock).

Everything else goes to the chunk index and the reporter unchanged, so a request of one piece
(equal TP, or a decoder TP larger than the prefiller's) takes exactly the path it always took.
Called under the grant table's lock, except ``flush``.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

from lmcache_p2p import kv_layout, protocol
from lmcache_p2p.backend.chunk_index import ChunkIndex
from lmcache_p2p.backend.relayout import merge_pieces
from lmcache_p2p.buffer import SlotPool

logger = logging.getLogger(__name__)

_GONE_REMEMBERED = 4096  # failed requests whose late reports are dropped
_Piece = tuple[str, int, protocol.ChunkShape]  # (share's wire id, slot, shape)


def caches_key(req_id: str) -> bool:
    """May this request's slots be cached under their keys once loaded? Not a later share's: its
    slot holds a part of a chunk, merged into the first share's slot."""
    return kv_layout.parse_sub_request(req_id)[1] == 0


class PieceMerger:
    """The chunk index and the reporter as the grant table sees them, merging shares of a request."""

    def __init__(self, index: ChunkIndex, pool: SlotPool, *, buffer: Any, slot_bytes: int,
                 report: Callable[[protocol.Message], object]) -> None:
        self._index = index
        self._pool = pool
        self._buffer = buffer  # the receive buffer as flat bytes (None: pieces cannot be merged here)
        self._slot_bytes = slot_bytes
        self._report = report
        self._forget: Callable[[str], None] = lambda req_id: None
        self._pieces: dict[tuple[str, str], dict[int, _Piece]] = {}  # (request, key) -> index -> piece
        self._ready: dict[str, dict[int, protocol.KvReady]] = {}  # request -> share index -> its KvReady
        self._failed: dict[str, int] = {}  # requests whose shares must be cancelled -> share count
        self._gone: collections.OrderedDict[str, None] = collections.OrderedDict()  # failed and cancelled
        self.merged = 0  # chunks merged from pieces

    def attach(self, forget_locked: Callable[[str], None]) -> None:
        """``forget_locked(req_id)``: the grant table drops a reported share with no slot left."""
        self._forget = forget_locked

    # ---- the chunk index, as the grant table uses it ----------------------------------------

    def granted(self, slot: int, key: str, shape: protocol.ChunkShape) -> None:
        self._index.granted(slot, key, shape)

    def shape_of(self, slot: int) -> protocol.ChunkShape | None:
        return self._index.shape_of(slot)

    def drop(self, req_id: str, slot: int, key: str) -> None:
        base, index, count = kv_layout.parse_sub_request(req_id)
        if count > 1:
            group = self._pieces.get((base, key))
            if group is not None and group.get(index, ("", -1))[:2] == (req_id, slot):
                del group[index]
                if not group:
                    del self._pieces[(base, key)]
        self._index.drop(req_id, slot, key)

    def landed(self, req_id: str, slot: int, key: str, shape: protocol.ChunkShape) -> None:
        base, index, count = kv_layout.parse_sub_request(req_id)
        if count == 1:
            self._index.landed(req_id, slot, key, shape)
            return
        group = self._pieces.setdefault((base, key), {})
        group[index] = (req_id, slot, shape)
        if len(group) < count:
            return
        del self._pieces[(base, key)]
        pieces = [group[i] for i in range(count)]
        try:
            merged = merge_pieces(self._buffer, self._slot_bytes, [(s, sh) for _, s, sh in pieces])
        except (ValueError, TypeError, RuntimeError) as exc:
            logger.error("request %s: the pieces of chunk %s cannot be merged (%s); it is not served", base, key, exc)
            return  # its slots stay READY and unindexed: freed with their shares (lease or failure)
        self.merged += 1
        first_id, first_slot, _ = pieces[0]
        self._index.granted(first_slot, key, merged)  # what the slot holds now (also once cached)
        self._index.landed(first_id, first_slot, key, merged)
        for share_id, piece_slot, _ in pieces[1:]:
            if self._pool.acquire(piece_slot, share_id):
                self._pool.release([piece_slot])
            self._forget(share_id)

    # ---- the reporter ------------------------------------------------------------------------

    def report(self, msg: protocol.Message) -> None:
        req_id = getattr(msg, "req_id", "")
        try:
            base, index, count = kv_layout.parse_sub_request(req_id)
        except ValueError:
            base, index, count = req_id, 0, 1
        if count == 1:
            self._report(msg)
            return
        if isinstance(msg, protocol.KvFailed):
            self._ready.pop(base, None)
            if base not in self._failed and base not in self._gone:
                self._failed[base] = count
                self._report(protocol.KvFailed(base, msg.instance_id, msg.tp_rank, f"share {index} of {count}: "
                                                                                     f"{msg.reason}", msg.cause))
            return
        if not isinstance(msg, protocol.KvReady) or base in self._failed or base in self._gone:
            return
        shares = self._ready.setdefault(base, {})
        shares[index] = msg
        if len(shares) < count:
            return
        del self._ready[base]
        moved = sum(m.nbytes for m in shares.values())
        self._report(protocol.KvReady(base, msg.instance_id, msg.tp_rank, shares[0].chunks, moved,
                                      bytes_received=sum(m.bytes_received for m in shares.values())))

    def flush(self, cancel: Callable[[str, str], None]) -> None:
        """Cancel the other shares of requests one share of which failed (outside the lock)."""
        if not self._failed:
            return
        failed, self._failed = self._failed, {}
        for base, count in failed.items():
            for index in range(count):
                cancel(kv_layout.share_id(base, index, count), "another share of this request failed")
            self._gone[base] = None
        while len(self._gone) > _GONE_REMEMBERED:
            self._gone.popitem(last=False)
