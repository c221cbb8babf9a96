"""The NCCL transport's write header: round trip, and every malformed header refused."""

from __future__ import annotations

import struct

import pytest

from lmcache_p2p.errors import ProtocolError
from lmcache_p2p.transport.nccl import wire


def _header(notif: bytes = b"done") -> wire.Header:
    chunks = (wire.ChunkDest(0, 0, 4096), wire.ChunkDest(1, 13, 1), wire.ChunkDest(0, 8192, 100))
    return wire.Header(wire.HeaderKind.WRITE, chunks, piece_bytes=1 << 20, notif=notif)


@pytest.mark.parametrize("notif", [b"", b"x", bytes(range(256)) * 4])
def test_header_round_trip(notif: bytes) -> None:
    header = _header(notif)
    assert wire.Header.decode(header.encode()) == header
    assert header.nbytes == 4096 + 1 + 100


def test_bye_round_trip() -> None:
    assert wire.Header.decode(wire.BYE.encode()).kind is wire.HeaderKind.BYE


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\x00" * 31,
        struct.pack("<4q", 9, 0, 0, 0),  # unknown kind
        struct.pack("<4q", 1, -1, 0, 0),  # negative count
        struct.pack("<4q", 1, 1, 0, 0),  # count 1 but no table
        struct.pack("<4q", 1, 0, 0, 5) + b"abc",  # notif shorter than announced
        struct.pack("<4q", 1, 0, -1, 0),  # negative piece size
        _header().encode() + b"trailing",
    ],
)
def test_malformed_headers_are_refused(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        wire.Header.decode(raw)


@pytest.mark.parametrize(
    "chunk",
    [
        wire.ChunkDest(2, 0, 1),
        wire.ChunkDest(-1, 0, 1),
        wire.ChunkDest(0, 4000, 97),
        wire.ChunkDest(0, -1, 2),
        wire.ChunkDest(1, 0, 0),
    ],
)
def test_destinations_outside_the_receivers_regions_are_refused(chunk: wire.ChunkDest) -> None:
    header = wire.Header(wire.HeaderKind.WRITE, (chunk,))
    with pytest.raises(ProtocolError):
        header.check_fits([4096, 100])


def test_pieces_cover_a_chunk_exactly() -> None:
    assert wire.pieces(10, 0) == [(0, 10)]
    assert wire.pieces(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert wire.pieces(8, 4) == [(0, 4), (4, 4)]
    assert wire.pieces(3, 4) == [(0, 3)]
