"""What the NCCL transport's two sides agree on: store keys and the write header.

Pure data, no torch: the pairing handshake (offer / claim keys in the receiver's TCPStore), the
doorbell key of each write, and the header a sender puts in that doorbell. The header is a run
of little-endian int64 words followed by the notification bytes::

    [kind, count, piece_bytes, notif_len, (region, offset, nbytes) * count] + notif

``region`` indexes the receiver's ``TransportInfo.regions``; ``offset`` is relative to that
region's start; ``piece_bytes`` > 0 means every chunk travels as consecutive messages of at most
that many bytes (the sender's staging ring), 0 means one message per chunk. A ``BYE`` header
(count 0) ends a pair. Decoding checks every field; it never trusts a peer's numbers.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from collections.abc import Sequence

from lmcache_p2p.errors import ProtocolError

WIRE_VERSION = 2  # 2: pairing moves a warm-up piece and the receiver acknowledges it serves the pair
HANDSHAKE_MAGIC = 0x4E43434C  # "NCCL": the first message of every pair, then WIRE_VERSION
WARMUP_BYTES = 1 << 20  # the piece a pairing moves sender -> receiver after the handshake
MAX_CHUNKS_PER_WRITE = 1 << 16
MAX_NOTIF_BYTES = 1 << 20

_WORD = struct.Struct("<q")
_FIXED_WORDS = 4


class HeaderKind(enum.IntEnum):
    WRITE = 1
    BYE = 2


@dataclasses.dataclass(frozen=True)
class ChunkDest:
    """Where one chunk lands: a receiver region (by index), an offset in it, a length."""

    region: int
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Header:
    kind: HeaderKind
    chunks: tuple[ChunkDest, ...] = ()
    piece_bytes: int = 0
    notif: bytes = b""

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    def encode(self) -> bytes:
        words = [int(self.kind), len(self.chunks), self.piece_bytes, len(self.notif)]
        for c in self.chunks:
            words += [c.region, c.offset, c.nbytes]
        return struct.pack(f"<{len(words)}q", *words) + self.notif

    @classmethod
    def decode(cls, raw: bytes) -> Header:
        """Parse and bounds-check a header; ProtocolError for anything malformed."""
        if len(raw) < _FIXED_WORDS * _WORD.size:
            raise ProtocolError(f"NCCL write header too short ({len(raw)} bytes)")
        kind_word, count, piece_bytes, notif_len = struct.unpack_from(f"<{_FIXED_WORDS}q", raw)
        try:
            kind = HeaderKind(kind_word)
        except ValueError as exc:
            raise ProtocolError(f"unknown NCCL header kind {kind_word}") from exc
        if not 0 <= count <= MAX_CHUNKS_PER_WRITE or not 0 <= notif_len <= MAX_NOTIF_BYTES or piece_bytes < 0:
            raise ProtocolError(f"NCCL header out of range: count={count} notif_len={notif_len} piece={piece_bytes}")
        table_end = (_FIXED_WORDS + 3 * count) * _WORD.size
        if len(raw) != table_end + notif_len:
            raise ProtocolError(f"NCCL header is {len(raw)} bytes, expected {table_end + notif_len}")
        flat = struct.unpack_from(f"<{3 * count}q", raw, _FIXED_WORDS * _WORD.size)
        chunks = tuple(ChunkDest(*flat[i : i + 3]) for i in range(0, len(flat), 3))
        return cls(kind, chunks, piece_bytes, bytes(raw[table_end:]))

    def check_fits(self, region_bytes: Sequence[int]) -> None:
        """ProtocolError unless every chunk lies inside the receiver region it names."""
        for c in self.chunks:
            if not 0 <= c.region < len(region_bytes):
                raise ProtocolError(f"chunk names region {c.region}; this receiver has {len(region_bytes)}")
            if c.offset < 0 or c.nbytes <= 0 or c.offset + c.nbytes > region_bytes[c.region]:
                raise ProtocolError(
                    f"chunk [{c.offset}, +{c.nbytes}) outside region {c.region} ({region_bytes[c.region]} bytes)"
                )


BYE = Header(HeaderKind.BYE)


def pieces(nbytes: int, piece_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) of each message a chunk of ``nbytes`` travels as."""
    if piece_bytes <= 0 or nbytes <= piece_bytes:
        return [(0, nbytes)]
    return [(off, min(piece_bytes, nbytes - off)) for off in range(0, nbytes, piece_bytes)]


# ---- store keys (all inside the receiver's TCPStore) ----------------------------------------------


def offer_key(sender: str) -> str:
    """Holds the pair id the receiver offers to ``sender`` (set on every accept)."""
    return f"offer/{sender}"


def generation_key(sender: str) -> str:
    """Counter making every offer to ``sender`` a fresh pair id."""
    return f"gen/{sender}"


def claim_key(pair_id: str) -> str:
    """``add(claim_key, 1) == 1`` wins a pair id: the sender joining it, or the receiver retracting it."""
    return f"claim/{pair_id}"


def group_prefix(pair_id: str) -> str:
    """The PrefixStore prefix of one pair's process group."""
    return f"pair/{pair_id}/"


def doorbell_key(pair_id: str, seq: int) -> str:
    """Header of the pair's ``seq``-th write (or BYE)."""
    return f"door/{pair_id}/{seq}"
