"""protocol: every message round-trips; garbage, unknown tags and bad tags are rejected."""

from __future__ import annotations

import msgspec
import pytest

from lmcache_p2p import protocol
from lmcache_p2p.errors import AuthError, ProtocolError

INFO = protocol.TransportInfo(kind="nixl", name="a", metadata=b"\x00\x01", regions=[protocol.Region(4096, 1 << 20)])
SHAPE = protocol.ChunkShape(shape=[2, 2, 256, 64], dtype="bfloat16", nbytes=131072)
MESSAGES = [
    protocol.Hello(1, "s", 0, INFO),
    protocol.Welcome(1, "r", 8192, 131072, 16, INFO),
    protocol.Alloc(3, "req", ["k1", "k2"], [SHAPE, SHAPE], True),
    protocol.Grant(3, "req", [4, -1], 10),
    protocol.Refused(3, "req", protocol.RefusalCode.FULL, "full", 2, 0, 16),
    protocol.Written("s", "req", [4]),
    protocol.Cancel(4, "req", "why"),
    protocol.Ack(4),
    protocol.ErrorReply(5, "bad"),
    protocol.Announce(1, "d0", "receiver", "http://127.0.0.1:7200", 0, 1, "127.0.0.1", 7300, 7400, 16, 9, 131072, 256),
    protocol.Goodbye("d0"),
    protocol.KvReady("req", "d0", 0, 2, 262144),
    protocol.KvFailed("req", "d0", 0, "lease expired"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    codec = protocol.Codec()
    assert codec.unpack(codec.pack(msg)) == msg


@pytest.mark.parametrize("payload", [b"", b"\xff\xfe", msgspec.msgpack.encode({"type": "nope"}),
                                     msgspec.msgpack.encode({"type": "grant", "seq": "x"}),
                                     msgspec.msgpack.encode([1, 2, 3])])
def test_garbage_is_a_protocol_error(payload):
    with pytest.raises(ProtocolError):
        protocol.Codec().unpack([b"", payload])


def test_pickle_is_never_accepted():
    import pickle

    with pytest.raises(ProtocolError):
        protocol.decode(pickle.dumps(protocol.Ack(1)))


def test_frame_count_is_checked():
    with pytest.raises(ProtocolError, match="expected 2 frames"):
        protocol.Codec().unpack([b"only one"])


def test_shared_secret():
    good, bad, none = protocol.Codec("s3cret"), protocol.Codec("other"), protocol.Codec()
    frames = good.pack(protocol.Ack(1))
    assert good.unpack(frames) == protocol.Ack(1)
    with pytest.raises(AuthError, match="p2p.shared_secret"):
        bad.unpack(frames)
    with pytest.raises(AuthError):
        good.unpack(none.pack(protocol.Ack(1)))
    tampered = [frames[0], frames[1][:-1] + b"\x02"]
    with pytest.raises(AuthError):
        good.unpack(tampered)
