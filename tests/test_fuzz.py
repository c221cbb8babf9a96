"""Fuzz: random and mutated control frames at a real receiver's control port, a real sender's control
socket and the proxy's registry, with and without a shared secret.

Each frame is random bytes, or a valid frame flipped, truncated, extended with extra parts, made
oversized, replayed, signed with the wrong secret or stamped outside the window. Checked after
every run: nothing crashed; the service still answers a valid request; no slot (receiver) or
instance (proxy) exists that a rejected frame asked for; and the service's rejected-frame counters
equal, reason by reason, the rejections of an independent Codec fed the same frames in the same
order (frames that must be refused, such as any mutation under a secret, are also asserted as such).

Short form by default (CI): ``LMCACHE_P2P_FUZZ_FRAMES`` frames per target (500); the long form is
``LMCACHE_P2P_FUZZ_FRAMES=10000``. ``LMCACHE_P2P_FUZZ_SEED`` picks the seed.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import random
import socket
import time
from collections.abc import Callable, Sequence

import pytest
import torch
import zmq

from lmcache_p2p import protocol
from lmcache_p2p.backend.receive_service import ReceiveService
from lmcache_p2p.backend.send_service import Chunk, SendService, Target
from lmcache_p2p.buffer import SlotPool
from lmcache_p2p.config import P2PConfig, Role, TransportKind
from lmcache_p2p.errors import ProtocolError
from lmcache_p2p.transport import Notification, Transport, WriteHandle

FRAMES = int(os.environ.get("LMCACHE_P2P_FUZZ_FRAMES", "500"))
SEED = int(os.environ.get("LMCACHE_P2P_FUZZ_SEED", "20261130"))
SECRETS = [None, "fuzz-s3cret"]
SLOT_BYTES = 4096
SHAPE = protocol.ChunkShape(shape=[2, 1, 16, 64], dtype="bfloat16", nbytes=4096)


def chunk_bytes() -> torch.Tensor:
    return torch.zeros(SHAPE.nbytes, dtype=torch.uint8)
WAIT_S = 60.0 + FRAMES / 20  # a 2-core machine shared with other work; never hit when things work
REASONS = ("auth", "replay", "stale", "oversized", "malformed")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"

pytestmark = pytest.mark.timeout(int(3 * WAIT_S))


# ---- the generator ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Fuzzed:
    kind: str
    parts: list[bytes]
    must_reject: bool | None  # None: depends on the bytes (a flip without a secret may still decode)
    seed_type: type | None = None


class FrameFuzzer:
    """Seeded frames for one target; ``seeds`` makes a fresh valid message for that target."""

    KINDS = ("random", "flip", "truncate", "extra", "huge", "replay", "wrong_secret", "stale", "valid")
    WEIGHTS = (14, 26, 12, 10, 1, 10, 8, 6, 13)

    def __init__(self, rng: random.Random, secret: str | None, seeds: Callable[[int], protocol.Message],
                 to: str = protocol.ANYONE) -> None:
        self.rng = rng
        self.secret = secret
        self.seeds = seeds
        self.to = to  # the target's name: every frame is addressed to it
        self.honest = protocol.Codec(secret, identity="fuzz-peer")
        self.intruder = protocol.Codec("not-" + (secret or "the-secret"), identity="intruder")
        self.late = protocol.Codec(secret, identity="fuzz-peer", clock=lambda: time.time() - 120)
        self.accepted: list[list[bytes]] = []  # valid frames sent, for replays
        self.n = 0

    def valid(self) -> tuple[list[bytes], type]:
        self.n += 1
        msg = self.seeds(self.n)
        return self.honest.pack(msg, self.to), type(msg)

    def frame(self) -> Fuzzed:
        kind = self.rng.choices(self.KINDS, self.WEIGHTS)[0]
        signed = self.secret is not None
        if kind == "random":
            parts = [self.rng.randbytes(self.rng.randrange(0, 200)) for _ in range(self.rng.randrange(1, 5))]
            return Fuzzed(kind, parts, True if signed or len(parts) != 2 else None)
        if kind == "replay" and self.accepted:
            return Fuzzed(kind, list(self.rng.choice(self.accepted)), True if signed else False)
        if kind == "wrong_secret":
            return Fuzzed(kind, self.intruder.pack(self.seeds(0), self.to), True if signed else False)
        if kind == "stale":
            return Fuzzed(kind, self.late.pack(self.seeds(0), self.to), True if signed else False)
        if kind == "huge":  # every part within zmq.MAXMSGSIZE, the frame over MAX_MESSAGE_BYTES in all
            auth, payload = self.honest.seal(self.rng.randbytes(64) * (protocol.MAX_MESSAGE_BYTES // 64), self.to)
            return Fuzzed(kind, [auth or self.rng.randbytes(16), payload], True)
        parts, seed_type = self.valid()
        if kind == "flip":
            i = self.rng.choice([i for i, p in enumerate(parts) if p])
            part = bytearray(parts[i])
            for _ in range(self.rng.randrange(1, 4)):
                part[self.rng.randrange(len(part))] ^= 1 << self.rng.randrange(8)
            if part == parts[i]:  # flips cancelled out: flip once more
                part[0] ^= 0x80
            parts[i] = bytes(part)
            return Fuzzed(kind, parts, True if signed else None, seed_type)
        if kind == "truncate":
            i = self.rng.choice([i for i, p in enumerate(parts) if p])
            parts[i] = parts[i][:self.rng.randrange(len(parts[i]))]
            return Fuzzed(kind, parts, True, seed_type)
        if kind == "extra":
            extra = [self.rng.randbytes(self.rng.randrange(0, 40)) for _ in range(self.rng.randrange(1, 3))]
            return Fuzzed(kind, parts + extra if self.rng.random() < 0.7 else extra + parts, True, seed_type)
        self.accepted.append(parts)
        return Fuzzed("valid", parts, False, seed_type)


class Oracle:
    """An independent Codec fed the same frames in the same order: what the service must have refused."""

    def __init__(self, secret: str | None, names: list[str] | None = None) -> None:
        self.codec = protocol.Codec(secret, names=names)
        self.accepted: list[tuple[Fuzzed, protocol.Message]] = []

    def check(self, f: Fuzzed) -> None:
        try:
            msg = self.codec.unpack(f.parts)
        except ProtocolError as exc:
            assert f.must_reject is not False, f"a {f.kind} frame was refused: {exc}"
            return
        assert f.must_reject is not True, f"a {f.kind} frame was accepted: {f.parts!r:.200}"
        self.accepted.append((f, msg))

    @property
    def rejected(self) -> dict[str, int]:
        return self.codec.rejected


def expect_counts(got: dict[str, int], oracle: Oracle, frames: int) -> None:
    assert {r: got.get(r, 0) for r in REASONS} == {r: oracle.rejected.get(r, 0) for r in REASONS}
    assert sum(oracle.rejected.values()) > frames // 3  # the run exercised rejection at all
    assert oracle.rejected.get("malformed", 0) > 0
    if frames >= 200:  # one huge frame in ~100
        assert oracle.rejected.get("oversized", 0) > 0
    if oracle.codec.authenticated:
        assert all(oracle.rejected.get(r, 0) > 0 for r in ("auth", "replay", "stale"))


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {WAIT_S:.0f}s waiting for {what}"
        time.sleep(0.005)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeTransport(Transport):
    """Moves no bytes: writes complete at once; enough for the control plane."""

    kind = "loopback"

    def __init__(self) -> None:
        self.notifications: collections.deque[Notification] = collections.deque()

    def start(self) -> FakeTransport:
        return self

    def register(self, tensor):  # pragma: no cover - never called here
        raise NotImplementedError

    def info(self) -> protocol.TransportInfo:
        return protocol.TransportInfo(kind=self.kind, name=f"fake-{id(self):x}")

    def connect(self, peer: protocol.TransportInfo, timeout_s: float) -> str:
        return peer.name

    def write(self, peer: str, srcs: Sequence, dst_addrs: Sequence[int], notif: bytes) -> WriteHandle:
        return WriteHandle(peer, SLOT_BYTES * len(dst_addrs), object())

    def poll(self, handle: WriteHandle) -> bool:
        return True

    def get_notifications(self) -> list[Notification]:
        out = list(self.notifications)
        self.notifications.clear()
        return out

    def disconnect(self, peer: str) -> None:
        pass

    def close(self) -> None:
        pass


def dealer(ctx: zmq.Context, endpoint: str, identity: bytes) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(endpoint)
    return sock


def recv(sock: zmq.Socket, codec: protocol.Codec, timeout_s: float = WAIT_S) -> protocol.Message:
    assert sock.poll(int(timeout_s * 1000)), "no reply"
    return codec.unpack(sock.recv_multipart())


# ---- the receiver's control port ----------------------------------------------------------------------


def receiver_config(secret: str | None) -> P2PConfig:
    return P2PConfig(role=Role.RECEIVER, control_ports=free_port(), shared_secret=secret,
                     reserve_lease_s=3600.0, ready_lease_s=3600.0)


def hello(name: str) -> protocol.Hello:
    return protocol.Hello(protocol.PROTOCOL_VERSION, name, 0, protocol.TransportInfo(kind="loopback", name=name))


@pytest.mark.parametrize("secret", SECRETS, ids=["no-secret", "secret"])
def test_fuzz_the_receiver_control_port(secret):
    rng = random.Random(SEED)
    pool = SlotPool(FRAMES + 16)
    service = ReceiveService(receiver_config(secret), tp_rank=0, tp_size=1, transport=FakeTransport(), pool=pool,
                             slot_bytes=SLOT_BYTES, region_addr=0, chunk_tokens=16, dtype="bfloat16").start()
    ctx = zmq.Context()
    codec = protocol.Codec(secret, identity="fuzz-peer")
    address = service.control_endpoint.removeprefix("tcp://")
    sock = dealer(ctx, service.control_endpoint, b"fuzz-peer")
    try:
        sock.send_multipart(codec.pack(hello("fuzz-peer"), address))  # a known peer: an accepted Alloc would reserve
        assert isinstance(recv(sock, codec), protocol.Welcome)

        def seed(n: int) -> protocol.Message:
            if n and rng.random() < 0.6:
                return protocol.Alloc(n, f"fz-{SEED}-{n}", [f"key-{n}"], [SHAPE], False)
            return protocol.Cancel(n, f"gone-{n}", "fuzz")  # never one of the Allocs' requests

        fuzzer, oracle = FrameFuzzer(rng, secret, seed, service.receiver_id), Oracle(secret, [service.receiver_id])
        granted = valid_allocs = 0
        replies: list[protocol.Message] = []
        for _ in range(FRAMES):
            f = fuzzer.frame()
            oracle.check(f)
            valid_allocs += f.kind == "valid" and f.seed_type is protocol.Alloc
            sock.send_multipart(f.parts)
            while sock.poll(0):
                replies.append(codec.unpack(sock.recv_multipart()))
        sentinel = protocol.Cancel(10**9, "sentinel", "end of fuzz")
        sock.send_multipart(codec.pack(sentinel, service.receiver_id))
        while not replies or replies[-1] != protocol.Ack(10**9):
            replies.append(codec.unpack(sock.recv_multipart()) if sock.poll(int(WAIT_S * 1000))
                           else pytest.fail("the receiver stopped answering"))
        granted = sum(s >= 0 for r in replies if isinstance(r, protocol.Grant) for s in r.slots)

        expect_counts(service.rejected_frames(), oracle, FRAMES)
        assert sum(isinstance(r, protocol.ErrorReply) and r.seq == -1 for r in replies) == sum(
            oracle.rejected.values())  # every rejected frame was answered as refused
        assert pool.reserved_slots == granted  # no slot reserved by a rejected frame
        if secret:
            assert granted == valid_allocs  # a replayed Alloc reserved nothing more

        # Still serving: a new sender's Hello and Alloc are answered.
        fresh = dealer(ctx, service.control_endpoint, b"after-fuzz")
        after = protocol.Codec(secret, identity="after-fuzz")
        try:
            fresh.send_multipart(after.pack(hello("after-fuzz"), address))
            assert isinstance(recv(fresh, after), protocol.Welcome)
            fresh.send_multipart(after.pack(protocol.Alloc(1, "after", ["after-key"], [SHAPE], True), service.receiver_id))
            grant = recv(fresh, after)
            assert isinstance(grant, protocol.Grant) and grant.slots[0] >= 0
        finally:
            fresh.close(linger=0)
    finally:
        sock.close(linger=0)
        ctx.term()
        service.close()


@pytest.mark.parametrize("secret", SECRETS, ids=["no-secret", "secret"])
def test_a_part_beyond_maxmsgsize_disconnects_only_that_peer(secret):
    """libzmq drops a connection whose part exceeds zmq.MAXMSGSIZE before the service sees it: not counted
    (nothing arrived), and the service keeps serving."""
    pool = SlotPool(8)
    service = ReceiveService(receiver_config(secret), tp_rank=0, tp_size=1, transport=FakeTransport(), pool=pool,
                             slot_bytes=SLOT_BYTES, region_addr=0, chunk_tokens=16, dtype="bfloat16").start()
    ctx = zmq.Context()
    codec = protocol.Codec(secret, identity="ok")
    try:
        big = dealer(ctx, service.control_endpoint, b"big")
        big.send_multipart([b"", b"\x00" * (protocol.MAX_MESSAGE_BYTES + 1)])
        ok = dealer(ctx, service.control_endpoint, b"ok")
        ok.send_multipart(codec.pack(hello("ok"), service.control_endpoint.removeprefix("tcp://")))
        assert isinstance(recv(ok, codec), protocol.Welcome)
        assert service.rejected_frames() == {} and pool.reserved_slots == 0
        big.close(linger=0)
        ok.close(linger=0)
    finally:
        ctx.term()
        service.close()


# ---- a sender's control socket (the replies it reads from a receiver) -----------------------------------


@pytest.mark.parametrize("secret", SECRETS, ids=["no-secret", "secret"])
def test_fuzz_the_sender_control_socket(secret):
    """A fake receiver answers the sender's Hello with fuzz first, then serves it properly."""
    rng = random.Random(SEED + 1)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.SNDHWM, 0)  # a ROUTER drops what exceeds its high-water mark: queue everything
    port = router.bind_to_random_port("tcp://127.0.0.1")
    cfg = P2PConfig(role=Role.SENDER, shared_secret=secret, connect_timeout_s=3600.0, alloc_timeout_s=3600.0)
    service = SendService(cfg, tp_rank=0, tp_size=1, transport=FakeTransport()).start()
    codec = protocol.Codec(secret, identity="fake-receiver", names=["fake-receiver", f"127.0.0.1:{port}"])
    done: list[str] = []
    try:
        service.submit("req-1", Target("127.0.0.1", port), [Chunk("k1", SHAPE, chunk_bytes(), lambda: done.append("k1"))],
                       True)
        assert router.poll(int(WAIT_S * 1000))
        identity, *frames = router.recv_multipart()
        assert isinstance(codec.unpack(frames), protocol.Hello)

        def seed(n: int) -> protocol.Message:  # replies that a sender in handshake ignores if accepted
            kind = rng.randrange(3)
            if kind == 0:
                return protocol.Ack(n)
            if kind == 1:
                return protocol.Grant(10**6 + n, f"nobody-{n}", [n % 8], 8)
            return protocol.Refused(10**6 + n, f"nobody-{n}", protocol.RefusalCode.FULL, "fuzz", 1, 0, 8)

        fuzzer, oracle = FrameFuzzer(rng, secret, seed, service.sender_id), Oracle(secret, [service.sender_id])
        for _ in range(FRAMES):
            f = fuzzer.frame()
            oracle.check(f)
            router.send_multipart([identity, *f.parts])
        expected = sum(oracle.rejected.values())
        wait_until(lambda: sum(service.stats().rejected_frames.values()) >= expected, "the sender to read the fuzz")
        expect_counts(service.stats().rejected_frames, oracle, FRAMES)

        # Still working: the handshake completes and the request's chunk is written.
        welcome = protocol.Welcome(protocol.PROTOCOL_VERSION, "fake-receiver", 0, SLOT_BYTES, 8,
                                   protocol.TransportInfo(kind="loopback", name="fake-receiver"))
        router.send_multipart([identity, *codec.pack(welcome, service.sender_id)])
        assert router.poll(int(WAIT_S * 1000))
        _, *frames = router.recv_multipart()
        alloc = codec.unpack(frames)
        assert isinstance(alloc, protocol.Alloc) and alloc.keys == ["k1"]
        router.send_multipart([identity, *codec.pack(protocol.Grant(alloc.seq, "req-1", [3], 7), service.sender_id)])
        wait_until(lambda: service.stats().requests_done == 1, "the request to finish")
        assert done == ["k1"] and service.stats().requests_failed == 0
    finally:
        service.close()
        router.close(linger=0)
        ctx.term()


# ---- the proxy's registry ---------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("secret", SECRETS, ids=["no-secret", "secret"])
async def test_fuzz_the_proxy_registry(secret):
    import asyncio

    import zmq.asyncio

    from lmcache_p2p.proxy.control import ControlListener
    from lmcache_p2p.proxy.observe.metrics import ProxyMetrics
    from lmcache_p2p.proxy.router.registry import Registry
    from lmcache_p2p.proxy.handover.waiters import KvWaiters

    rng = random.Random(SEED + 2)
    registry = Registry(ttl_s=3600)
    metrics = ProxyMetrics(registry.instances)
    codec = protocol.Codec(secret)
    listener = ControlListener("127.0.0.1", 0, codec, registry, KvWaiters(), metrics)
    listener.start()
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(listener.address)

    def announce(instance_id: str) -> protocol.Announce:
        return protocol.Announce(protocol.PROTOCOL_VERSION, instance_id, "receiver", "http://127.0.0.1:1", 0, 1,
                                 "127.0.0.1", 7300, 7400, 8, 8, SLOT_BYTES, 16)

    def seed(n: int) -> protocol.Message:
        kind = rng.randrange(4 if secret else 3)  # unsigned Announces that mutate into valid ones are not counted
        if kind == 0:
            return protocol.KvReady(f"r-{n}", "nobody", 0, 1, 10)
        if kind == 1:
            return protocol.KvFailed(f"r-{n}", "nobody", 0, "fuzz")
        if kind == 2:
            return protocol.Goodbye(f"nobody-{n}")
        return announce(f"fz-{n}")

    try:
        name = protocol.dialled_name(listener.address)  # every frame is addressed to the proxy as dialled
        fuzzer, oracle = FrameFuzzer(rng, secret, seed, name), Oracle(secret, list(listener.names))
        for _ in range(FRAMES):
            f = fuzzer.frame()
            oracle.check(f)
            await sock.send_multipart(f.parts)
        await sock.send_multipart(protocol.Codec(secret).pack(announce("sentinel"), name))
        deadline = time.monotonic() + WAIT_S
        while all(i.instance_id != "sentinel" for i in registry.instances()):
            assert time.monotonic() < deadline, "the proxy stopped taking announces"
            await asyncio.sleep(0.01)

        def metric(reason: str) -> int:
            value = metrics.registry.get_sample_value("lmcache_p2p_proxy_control_rejected_total", {"reason": reason})
            return int(value or 0)

        expect_counts({r: metric(r) for r in REASONS}, oracle, FRAMES)
        assert metric("version") == 0
        announced = {m.instance_id for _, m in oracle.accepted if isinstance(m, protocol.Announce)}
        assert {i.instance_id for i in registry.instances()} == announced | {"sentinel"}  # nothing rogue
    finally:
        sock.close(linger=0)
        ctx.term()
        await listener.close()


# ---- what a receiver tells its peers ---------------------------------------------------------------------


def test_the_announce_carries_the_advertised_host_and_a_host_qualified_id(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "node7")
    port = free_port()
    cfg = P2PConfig(role=Role.RECEIVER, control_ports=port, advertise_host="10.0.0.5")
    service = ReceiveService(cfg, tp_rank=0, tp_size=1, transport=FakeTransport(), pool=SlotPool(4),
                             slot_bytes=SLOT_BYTES, region_addr=0, chunk_tokens=16, dtype="bfloat16").start()
    try:
        announce = service._announce()
        assert (announce.control_host, announce.control_port) == ("10.0.0.5", port)
        assert service.control_endpoint == f"tcp://127.0.0.1:{port}"  # bound where p2p.host says
        assert announce.instance_id == f"decoder-node7:{port}"
    finally:
        service.close()


def test_the_nccl_store_binds_host_and_advertises_advertise_host():
    pytest.importorskip("torch")
    from lmcache_p2p.backend.common import build_transport

    cfg = P2PConfig(role=Role.RECEIVER, transport=TransportKind.NCCL, transport_ports=free_port(),
                    advertise_host="127.0.0.9")
    transport = build_transport(cfg, "adv-test", 0).start()
    try:
        info = transport.info()
        assert (info.host, info.port) == ("127.0.0.9", cfg.transport_port(0))
    finally:
        transport.close()


def test_the_nccl_store_listens_on_the_configured_host_only():
    pytest.importorskip("torch")
    from lmcache_p2p.backend.common import build_transport

    cfg = P2PConfig(role=Role.RECEIVER, transport=TransportKind.NCCL, transport_ports=free_port())
    transport = build_transport(cfg, "bind-test", 0).start()
    try:
        socket.create_connection(("127.0.0.1", cfg.transport_port(0)), timeout=5).close()
        with pytest.raises(ConnectionRefusedError):  # another address of this machine: nothing listens
            socket.create_connection(("127.0.0.2", cfg.transport_port(0)), timeout=5)
    finally:
        transport.close()


# ---- a Written notification only counts from the sender that owns the request -----------------------------


def test_written_is_matched_to_the_sender_that_owns_the_slots():
    transport = FakeTransport()
    pool = SlotPool(8)
    service = ReceiveService(receiver_config("s3cret"), tp_rank=0, tp_size=1, transport=transport, pool=pool,
                             slot_bytes=SLOT_BYTES, region_addr=0, chunk_tokens=16, dtype="bfloat16").start()
    ctx = zmq.Context()
    codecs = {name: protocol.Codec("s3cret", identity=name) for name in ("sender-a", "sender-b")}
    a, b = dealer(ctx, service.control_endpoint, b"a"), dealer(ctx, service.control_endpoint, b"b")
    try:
        for sock, name in ((a, "sender-a"), (b, "sender-b")):
            # transport name == sender name here
            sock.send_multipart(codecs[name].pack(hello(name), service.control_endpoint.removeprefix("tcp://")))
            assert isinstance(recv(sock, codecs[name]), protocol.Welcome)
        a.send_multipart(codecs["sender-a"].pack(protocol.Alloc(1, "req-a", ["key-a"], [SHAPE], True),
                                                 service.receiver_id))
        grant = recv(a, codecs["sender-a"])
        assert isinstance(grant, protocol.Grant)

        def written(peer: str, sender_id: str) -> None:
            payload = protocol.encode(protocol.Written(sender_id, "req-a", grant.slots))
            transport.notifications.append(Notification(peer, payload))

        written("sender-b", "sender-b")  # B claims A's slots
        written("sender-b", "sender-a")  # B pretends to be A
        wait_until(lambda: service.rejected_frames().get("foreign") == 2, "both forged notifications")
        assert service.count_ready(["key-a"]) == 0 and pool.reserved_slots == 1
        written("sender-a", "sender-a")
        wait_until(lambda: service.count_ready(["key-a"]) == 1, "the owner's notification")
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()
        service.close()


# ---- a real sender and a real receiver, with matching and mismatched secrets --------------------------------


class LoopbackTransport(FakeTransport):
    """A write lands at once and notifies the receiving LoopbackTransport named in ``net``."""

    def __init__(self, name: str, net: dict[str, LoopbackTransport]) -> None:
        super().__init__()
        self.name = name
        self.net = net
        net[name] = self

    def info(self) -> protocol.TransportInfo:
        return protocol.TransportInfo(kind=self.kind, name=self.name)

    def write(self, peer: str, srcs: Sequence, dst_addrs: Sequence[int], notif: bytes) -> WriteHandle:
        self.net[peer].notifications.append(Notification(self.name, notif))
        return super().write(peer, srcs, dst_addrs, notif)


@pytest.mark.parametrize("sender_secret, receiver_secret, outcome", [
    ("s3cret", "s3cret", "delivered"),
    (None, None, "delivered"),
    ("other", "s3cret", "refused"),
    (None, "s3cret", "refused"),
])
def test_sender_and_receiver_secrets(sender_secret, receiver_secret, outcome):
    net: dict[str, LoopbackTransport] = {}
    pool = SlotPool(8)
    receiver = ReceiveService(receiver_config(receiver_secret), tp_rank=0, tp_size=1,
                              transport=LoopbackTransport("recv", net), pool=pool, slot_bytes=SLOT_BYTES,
                              region_addr=0, chunk_tokens=16, dtype="bfloat16").start()
    # a refusal signed with a key the sender lacks is nothing it takes: it gives up at its connect timeout, short
    # here; a Welcome comes in whatever time a loaded machine takes (1 s failed the delivered cases when slower)
    connect_timeout_s = 1.0 if outcome == "refused" else WAIT_S
    cfg = P2PConfig(role=Role.SENDER, shared_secret=sender_secret, connect_timeout_s=connect_timeout_s)
    sender = SendService(cfg, tp_rank=0, tp_size=1, transport=LoopbackTransport("send", net)).start()
    released: list[str] = []
    try:
        target = Target("127.0.0.1", int(receiver.control_endpoint.rsplit(":", 1)[1]))
        sender.submit("req-1", target, [Chunk("k1", SHAPE, chunk_bytes(), lambda: released.append("k1"))], True)
        wait_until(lambda: sender.stats().requests_done + sender.stats().requests_failed == 1, "the request to end")
        assert released == ["k1"]  # the chunk's reference is dropped either way
        if outcome == "delivered":
            assert sender.stats().requests_done == 1
            # the sender is done when its write is; the receiver takes the chunk when its own thread reads the
            # write's notification, which a loaded machine can hold back
            wait_until(lambda: receiver.count_ready(["k1"]) == 1, "the receiver to take k1")
            assert receiver.rejected_frames() == {} and sender.stats().rejected_frames == {}
        else:
            assert sender.stats().requests_failed == 1 and pool.reserved_slots == 0 and pool.free_slots == 8
            assert receiver.rejected_frames() == {"auth": 1}  # the Hello, unsigned or signed with another secret
            if sender_secret:  # the receiver's refusal is signed with a key the sender does not share
                assert sender.stats().rejected_frames == {"auth": 1}
    finally:
        sender.close()
        receiver.close()
