"""protocol: every message round-trips; garbage, unknown tags and bad tags are rejected."""

from __future__ import annotations

import msgspec
import pytest

from lmcache_p2p import protocol
from lmcache_p2p.errors import (AuthError, MisaddressedError, OversizedError, ProtocolError, ReplayError,
                                StaleFrameError)

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
    protocol.KvSent("req", "p0", 0, store_s=0.002, submit_s=0.001, transfer_s=0.004, chunks=2, nbytes=262144),
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


def test_kv_sent_from_a_sender_that_sends_only_the_ids_decodes_with_zero_times():
    """KvSent's times are optional: a minimal (or older) sender's message still decodes."""
    payload = msgspec.msgpack.encode({"type": "kv_sent", "req_id": "req", "instance_id": "p0", "tp_rank": 1})
    assert protocol.decode(payload) == protocol.KvSent("req", "p0", 1, 0.0, 0.0, 0.0, 0, 0)


def test_kv_sent_with_a_wrong_type_is_a_protocol_error():
    payload = msgspec.msgpack.encode({"type": "kv_sent", "req_id": "r", "instance_id": "p", "tp_rank": 0,
                                      "submit_s": "slow"})
    with pytest.raises(ProtocolError):
        protocol.decode(payload)


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
    assert good.rejected == {"auth": 2} and bad.rejected == {"auth": 1}


class Clock:
    def __init__(self, now_s: float = 1_800_000_000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def test_without_a_secret_framing_is_cheap_and_anonymous():
    codec = protocol.Codec(identity="prefiller-a")
    frames = codec.pack(protocol.Ack(1))
    assert frames == [b"", protocol.encode(protocol.Ack(1))]
    env = codec.open(frames)
    assert env.msg == protocol.Ack(1) and env.sender == ""
    assert codec.unpack(frames) == protocol.Ack(1)  # no replay protection without a secret


def test_envelope_authenticates_the_sender_identity():
    clock = Clock()
    sender = protocol.Codec("s3cret", identity="prefiller-hostA-12/r0", clock=clock)
    receiver = protocol.Codec("s3cret", identity="decoder-hostB:7300", clock=clock)
    env = receiver.open(sender.pack(protocol.Ack(7), "decoder-hostB:7300"))
    assert env.msg == protocol.Ack(7) and env.sender == "prefiller-hostA-12/r0"
    assert env.sent_at_s == pytest.approx(clock.now_s, abs=0.001)
    auth, payload = sender.pack(protocol.Ack(7), "decoder-hostB:7300")
    for at in (32, 32 + 16, 32 + 16 + 8, len(auth) - 1):  # nonce, stamp, identity: all covered by the tag
        forged = auth[:at] + bytes([auth[at] ^ 1]) + auth[at + 1:]
        with pytest.raises(AuthError, match="wrong shared-secret tag"):
            receiver.open([forged, payload])
    assert receiver.rejected == {"auth": 4}


def test_a_replayed_frame_is_refused_and_counted():
    codec = protocol.Codec("s3cret")
    frames = codec.pack(protocol.Cancel(1, "req", "why"))
    assert codec.unpack(frames) == protocol.Cancel(1, "req", "why")
    with pytest.raises(ReplayError, match="replayed"):
        codec.unpack(frames)
    assert codec.unpack(codec.pack(protocol.Cancel(1, "req", "why"))) == protocol.Cancel(1, "req", "why")
    assert codec.rejected == {"replay": 1}


@pytest.mark.parametrize("skew_s", [-31.0, 31.0])
def test_a_frame_outside_the_window_is_refused(skew_s):
    sent, received = Clock(), Clock()
    sender = protocol.Codec("s3cret", clock=sent)
    receiver = protocol.Codec("s3cret", window_s=30.0, clock=received)
    sent.now_s = received.now_s + skew_s
    with pytest.raises(StaleFrameError, match="window of 30 s .p2p.auth_window_s"):
        receiver.unpack(sender.pack(protocol.Ack(1)))
    sent.now_s = received.now_s + skew_s / 31 * 29  # inside the window
    assert receiver.unpack(sender.pack(protocol.Ack(1))) == protocol.Ack(1)
    assert receiver.rejected == {"stale": 1}


def test_the_replay_cache_is_bounded_and_never_readmits_a_forgotten_nonce():
    clock = Clock()
    codec = protocol.Codec("s3cret", replay_cache_entries=4, clock=clock)
    sent = []
    for i in range(10):
        clock.now_s += 0.01
        frames = codec.pack(protocol.Ack(i))
        codec.unpack(frames)
        sent.append(frames)
    assert len(codec._replay) <= 4
    for frames in sent:  # each is refused: still remembered (replay) or below the floor (stale)
        with pytest.raises((ReplayError, StaleFrameError)):
            codec.unpack(frames)
    clock.now_s += 0.01
    assert codec.unpack(codec.pack(protocol.Ack(99))) == protocol.Ack(99)  # fresh frames still pass


def test_expired_nonces_are_forgotten():
    clock = Clock()
    codec = protocol.Codec("s3cret", window_s=30.0, clock=clock)
    for i in range(5):
        codec.unpack(codec.pack(protocol.Ack(i)))
    clock.now_s += 31
    codec.unpack(codec.pack(protocol.Ack(5)))
    assert len(codec._replay) == 1


@pytest.mark.parametrize("secret", [None, "s3cret"])
def test_oversized_frames_are_refused_before_decoding(secret):
    codec = protocol.Codec(secret, max_message_bytes=1024)
    small = codec.pack(protocol.ErrorReply(1, "x" * 900))
    assert codec.unpack(small).message == "x" * 900
    with pytest.raises(OversizedError, match="exceeds the limit of 1024 bytes"):
        codec.unpack(codec.pack(protocol.ErrorReply(1, "x" * 1100)))
    with pytest.raises(OversizedError):
        codec.unpack([b"", b"a" * 600, b"b" * 600])  # counted over every part
    assert codec.rejected == {"oversized": 2}


def test_malformed_envelopes_are_rejected():
    codec = protocol.Codec("s3cret")
    _, payload = codec.pack(protocol.Ack(1))
    for auth in (b"", b"x" * 10, b"x" * 1000):
        with pytest.raises(AuthError, match="malformed shared-secret envelope"):
            codec.unpack([auth, payload])


def test_rejection_reasons():
    assert protocol.rejection_of(ReplayError("r")) is protocol.Rejection.REPLAY
    assert protocol.rejection_of(StaleFrameError("s")) is protocol.Rejection.STALE
    assert protocol.rejection_of(AuthError("a")) is protocol.Rejection.AUTH
    assert protocol.rejection_of(OversizedError("o")) is protocol.Rejection.OVERSIZED
    assert protocol.rejection_of(ProtocolError("m")) is protocol.Rejection.MALFORMED


def test_a_frame_is_accepted_only_by_the_recipient_it_names():
    clock = Clock()
    sender = protocol.Codec("s3cret", identity="prefiller-a/r0", clock=clock)
    receiver_a = protocol.Codec("s3cret", identity="decoder-a/r0/1", names=["decoder-a/r0/1", "host-a:7200"],
                                clock=clock)
    receiver_b = protocol.Codec("s3cret", identity="decoder-b/r0/2", names=["decoder-b/r0/2", "host-b:7200"],
                                clock=clock)
    for to in ("host-a:7200", "decoder-a/r0/1"):
        frames = sender.pack(protocol.Ack(1), to)
        with pytest.raises(MisaddressedError, match=f"addressed to '{to}', not to this peer"):
            receiver_b.open(frames)  # captured for A, replayed to B: B never saw its nonce
        env = receiver_a.open(frames)
        assert (env.msg, env.sender, env.recipient) == (protocol.Ack(1), "prefiller-a/r0", to)
    assert receiver_b.rejected == {"misaddressed": 2} and receiver_a.rejected == {}
    auth, payload = sender.pack(protocol.Ack(2), "decoder-b/r0/2")
    readdressed = auth[:-len("decoder-b/r0/2")] + b"decoder-a/r0/1"  # the recipient is under the tag
    with pytest.raises(AuthError, match="wrong shared-secret tag"):
        receiver_a.open([readdressed, payload])
    assert protocol.rejection_of(MisaddressedError("m")) is protocol.Rejection.MISADDRESSED


def test_by_default_a_codec_answers_to_its_identity_only():
    proxy = protocol.Codec("s3cret", identity="proxy-1")
    instance = protocol.Codec("s3cret", identity="decoder-a")
    assert proxy.unpack(instance.pack(protocol.Ack(2), "proxy-1")) == protocol.Ack(2)
    for to in (protocol.ANYONE, "proxy-2"):  # a frame for whoever listens is for nobody under a secret
        with pytest.raises(MisaddressedError, match=f"addressed to '{to}'"):
            proxy.unpack(instance.pack(protocol.Ack(3), to))
    assert proxy.rejected == {"misaddressed": 2}


def test_a_codec_signs_as_another_of_its_names_and_never_as_a_stranger():
    proxy = protocol.Codec("s3cret", identity="proxy-1", names=["10.0.0.5:9101", "proxy.example:9101"])
    decoder = protocol.Codec("s3cret", identity="decoder-a", names=["decoder-a"])
    env = decoder.open(proxy.pack(protocol.Ack(1), "decoder-a", signer="proxy.example:9101"))
    assert (env.msg, env.sender) == (protocol.Ack(1), "proxy.example:9101")
    with pytest.raises(ValueError, match="cannot sign as 'other:9101'"):
        proxy.pack(protocol.Ack(2), "decoder-a", signer="other:9101")


def test_frames_stamped_before_the_codec_started_are_refused_as_stale():
    clock = Clock()
    instance = protocol.Codec("s3cret", identity="decoder-a", clock=clock)
    captured = instance.pack(protocol.Ack(1), "proxy:9101")  # meant for the proxy's earlier incarnation
    clock.now_s += 2.0
    restarted = protocol.Codec("s3cret", names=["proxy:9101"], clock=clock)
    restarted.refuse_stamped_before(clock.now_s - 1.0)
    with pytest.raises(StaleFrameError, match="before this peer started"):
        restarted.open(captured)
    assert restarted.rejected == {"stale": 1}
    assert restarted.unpack(instance.pack(protocol.Ack(2), "proxy:9101")) == protocol.Ack(2)


def test_dialled_name_is_the_endpoint_without_its_scheme():
    assert protocol.dialled_name("tcp://proxy.example:9101") == "proxy.example:9101"
