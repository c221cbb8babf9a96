"""What the README promises about the control plane and a full buffer, on real LMCache engines.

Each test runs a real prefiller engine and a real decoder engine in their own processes (the
plugin loaded from YAML, KV over NIXL/UCX tcp on loopback):

- a pair with ``p2p.shared_secret`` set on both sides moves KV; one side without the secret, or
  with another one, is refused: the request fails on the sender (counted in its stats), nothing
  is reserved or served on the receiver, and the side that holds the secret logs the rejection;
- a full buffer: the receiver refuses, the sender backs off and retries, and succeeds when slots
  free up within ``alloc_timeout_s``, or fails after it with its slots freed on the receiver;
- the proxy's ``Cancel`` (sent by the proxy's own ``KvCanceller`` to the decoder the proxy learnt
  from the decoder's own Announce) frees the request's slots on the real receiver.
"""

from __future__ import annotations

import asyncio
import time

from test_engine_p2p import FREE_TIMEOUT_S, STATS_TIMEOUT_S, all_free, assert_received, store, wait_for

SECRET = "claims-secret"
TINY_CHUNK = 256  # tokens per chunk in engine_proc.py
FOUR_SLOTS = "512KB"  # engine_proc's tiny model: one 256-token bf16 chunk is 128 KiB
LONG_LEASE_S = 600  # leases far beyond the test: a slot freed here was freed by the code under test
# A signed pair's Hello, Welcome and transport pairing: a normal step, which a loaded machine can hold for seconds.
# A sender that must give up on a receiver whose answers it cannot take waits REFUSED_CONNECT_TIMEOUT_S instead.
PAIRING_TIMEOUT_S = 30
REFUSED_CONNECT_TIMEOUT_S = 3


def restart_sender(pair, **p2p) -> None:
    """Replace the prefiller with one whose ``p2p.*`` keys are updated (None removes a key)."""
    import yaml

    pair.sender.close()
    cfg = yaml.safe_load(pair.scfg.read_text())
    section = cfg["extra_config"]["p2p"]
    for key, value in p2p.items():
        if value is None:
            section.pop(key, None)
        else:
            section[key] = value
    pair.scfg.write_text(yaml.safe_dump(cfg))
    pair.sender = pair.start_sender()


def failed_count(sender) -> int:
    return sender.call(op="slots")["failed"]


def wait_failed(sender, count: int) -> dict:
    stats = wait_for(lambda: sender.call(op="slots"), lambda s: s["failed"] >= count, STATS_TIMEOUT_S)
    assert stats["failed"] == count, stats
    assert stats["pending"] == 0, stats
    return stats


# ---- shared secret ---------------------------------------------------------------------------

def test_shared_secret_pair_works_and_a_mismatch_is_refused_with_nothing_reserved(make_pair):
    pair = make_pair(shared_secret=SECRET, reserve_lease_s=LONG_LEASE_S, ready_lease_s=LONG_LEASE_S,
                     sender_opts={"shared_secret": SECRET, "connect_timeout_s": PAIRING_TIMEOUT_S})
    store(pair.sender, pair.port, seed=31, n=600, req_id="signed")
    assert_received(pair.receiver, seed=31, n=600)
    assert all_free(pair.receiver)

    for other in (None, "another-secret"):
        restart_sender(pair, shared_secret=other, connect_timeout_s=REFUSED_CONNECT_TIMEOUT_S)
        store(pair.sender, pair.port, seed=32, n=600, req_id=f"unsigned-{other}")
        wait_failed(pair.sender, 1)
        assert pair.receiver.call(op="lookup", seed=32, num_tokens=600) == {"hit_tokens": 0}
        slots = pair.receiver.call(op="slots")
        assert slots["free"] == slots["capacity"], slots  # leases are 600 s: nothing was ever reserved
        assert "shared-secret" in pair.receiver.log_path.read_text()  # the receiver saw and dropped the frames

    # the receiver still serves a signed sender afterwards
    restart_sender(pair, shared_secret=SECRET, connect_timeout_s=PAIRING_TIMEOUT_S)
    store(pair.sender, pair.port, seed=33, n=300, req_id="signed-again")
    assert_received(pair.receiver, seed=33, n=300)
    assert all_free(pair.receiver)


def test_sender_with_a_secret_refuses_an_unsigned_receiver(make_pair):
    pair = make_pair(reserve_lease_s=LONG_LEASE_S,
                     sender_opts={"shared_secret": SECRET, "connect_timeout_s": REFUSED_CONNECT_TIMEOUT_S})
    store(pair.sender, pair.port, seed=34, n=600, req_id="to-unsigned")
    wait_failed(pair.sender, 1)
    assert pair.receiver.call(op="lookup", seed=34, num_tokens=600) == {"hit_tokens": 0}
    slots = pair.receiver.call(op="slots")
    assert slots["free"] == slots["capacity"], slots
    assert "shared-secret" in pair.sender.log_path.read_text()


# ---- full buffer: refusal, backoff, alloc_timeout_s ------------------------------------------

def test_full_buffer_fails_after_alloc_timeout_with_its_slots_freed_then_backoff_succeeds(make_pair):
    alloc_timeout_s = 4.0
    pair = make_pair(buffer_size=FOUR_SLOTS, alloc_timeout_s=alloc_timeout_s, reserve_lease_s=LONG_LEASE_S,
                     ready_lease_s=LONG_LEASE_S)
    assert pair.receiver.call(op="slots") == {"free": 4, "capacity": 4}
    # A: 2 chunks arrive and are never loaded (held until ready_lease_s).
    store(pair.sender, pair.port, seed=41, n=2 * TINY_CHUNK, req_id="holder")
    assert pair.receiver.call(op="wait_ready", seed=41, num_tokens=2 * TINY_CHUNK, timeout_s=60)["hit_tokens"] == 512
    # B: its first store gets 1 slot; its second store needs 2 more while 1 is free.
    store(pair.sender, pair.port, seed=42, n=3 * TINY_CHUNK, req_id="blocked", end=TINY_CHUNK, last=False)
    wait_for(lambda: pair.receiver.call(op="slots"), lambda s: s["free"] == 1, FREE_TIMEOUT_S)
    started = time.monotonic()
    store(pair.sender, pair.port, seed=42, n=3 * TINY_CHUNK, req_id="blocked", skip=TINY_CHUNK, last=True)
    wait_failed(pair.sender, 1)
    assert time.monotonic() - started >= alloc_timeout_s  # it backed off and retried until the deadline
    # the failure is counted, then logged: the log may lag the count by a moment
    log = wait_for(pair.sender.log_path.read_text,
                   lambda text: "p2p.alloc_timeout_s" in text and "last refusal: 1 of 4 slots free, 2 needed" in text,
                   FREE_TIMEOUT_S)
    assert "p2p.alloc_timeout_s" in log and "last refusal: 1 of 4 slots free, 2 needed" in log
    # B's granted slot is back in the pool; A is untouched.
    assert wait_for(lambda: pair.receiver.call(op="slots"), lambda s: s["free"] == 2, FREE_TIMEOUT_S)["free"] == 2
    assert pair.receiver.call(op="lookup", seed=42, num_tokens=3 * TINY_CHUNK) == {"hit_tokens": 0}

    # Backoff that succeeds: C needs 3 slots while 2 are free; it waits (alloc_timeout_s 120) until A is loaded.
    restart_sender(pair, alloc_timeout_s=120)
    store(pair.sender, pair.port, seed=43, n=3 * TINY_CHUNK, req_id="waits")
    stats = pair.sender.call(op="slots")
    assert stats["pending"] == 1 and stats["failed"] == 0, stats
    assert pair.receiver.call(op="lookup", seed=43, num_tokens=3 * TINY_CHUNK) == {"hit_tokens": 0}
    assert pair.receiver.call(op="retrieve", seed=41, num_tokens=2 * TINY_CHUNK) == {"retrieved": 512, "equal": True}
    assert_received(pair.receiver, seed=43, n=3 * TINY_CHUNK)
    assert all_free(pair.receiver)
    assert wait_for(lambda: pair.sender.call(op="slots"), lambda s: s["pending"] == 0, STATS_TIMEOUT_S)["failed"] == 0


# ---- the proxy's Cancel on the real receiver ------------------------------------------------

def test_proxy_cancel_frees_slots_on_the_real_receiver(make_pair):
    asyncio.run(_proxy_cancel(make_pair))


async def _proxy_cancel(make_pair) -> None:
    from lmcache_p2p.config import Role
    from lmcache_p2p.proxy.server import Proxy
    from lmcache_p2p.proxy.settings import ProxySettings

    proxy = Proxy(ProxySettings(port=0, control_port=0, shared_secret=SECRET, summary_interval_s=0,
                                instance_ttl_s=60.0, health_probe_interval_s=60.0))
    await proxy.start()
    try:
        pair = await asyncio.to_thread(
            make_pair, buffer_size=FOUR_SLOTS, reserve_lease_s=LONG_LEASE_S, ready_lease_s=LONG_LEASE_S,
            shared_secret=SECRET, proxy_url=proxy.control.address, instance_id="decoder-claims",
            heartbeat_interval_s=0.5, sender_opts={"shared_secret": SECRET})
        decoder = await _eventually(lambda: next((i for i in proxy.registry.instances()
                                                  if i.role is Role.RECEIVER and i.complete), None))
        call = lambda **cmd: asyncio.to_thread(pair.receiver.call, **cmd)  # noqa: E731
        # One request whose KV arrived (never loaded) and one still mid-prefill (last store pending).
        await asyncio.to_thread(store, pair.sender, pair.port, 51, 2 * TINY_CHUNK, "arrived")
        await asyncio.to_thread(store, pair.sender, pair.port, 52, 3 * TINY_CHUNK, "midway", end=TINY_CHUNK,
                                last=False)
        assert (await call(op="wait_ready", seed=51, num_tokens=512, timeout_s=60))["hit_tokens"] == 512
        assert (await _poll(call, lambda s: s["free"] == 1))["free"] == 1
        proxy.canceller.cancel(decoder, "arrived", "test: no decode will follow")
        proxy.canceller.cancel(decoder, "midway", "test: client left")
        assert (await _poll(call, lambda s: s["free"] == s["capacity"])) == {"free": 4, "capacity": 4}
        assert await call(op="lookup", seed=51, num_tokens=512) == {"hit_tokens": 0}
        # The cancelled request's late store is refused: nothing is reserved for it.
        await asyncio.to_thread(store, pair.sender, pair.port, 52, 3 * TINY_CHUNK, "midway", skip=TINY_CHUNK,
                                last=True)
        stats = await asyncio.to_thread(wait_for, lambda: pair.sender.call(op="slots"),
                                        lambda s: s["pending"] == 0, STATS_TIMEOUT_S)
        assert stats["failed"] == 1, stats
        assert await call(op="slots") == {"free": 4, "capacity": 4}
        # The proxy's own view of the decoder (its heartbeat) shows every slot free: what /instances reports.
        await _eventually(lambda: decoder.free_slots() == decoder.capacity_slots == 4 or None)
    finally:
        await proxy.close()


async def _poll(call, predicate, timeout_s: float = FREE_TIMEOUT_S) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        value = await call(op="slots")
        if predicate(value) or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.1)


async def _eventually(get, timeout_s: float = 60.0):
    """The first truthy ``get()`` within ``timeout_s`` (raises AssertionError after)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = get()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"condition not met within {timeout_s:.0f}s")
        await asyncio.sleep(0.1)


# ---- the signed envelope: who signs is who speaks, and a frame is for one receiver -----------------

def _member(endpoint: str, identity: bytes, codec):
    """A DEALER of a member that holds the secret: ``call(msg, to)`` sends signed and reads the reply."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(endpoint)
    sent: list[list[bytes]] = []

    def call(msg, to: str):
        frames = codec.pack(msg, to)
        sent.append(frames)
        return replay(frames)

    def replay(frames):
        sock.send_multipart(frames)
        return codec.unpack(sock.recv_multipart())

    def close():
        sock.close()
        ctx.term()

    return call, replay, sent, close


def test_a_member_cannot_speak_as_another_sender_nor_replay_another_receivers_frames(make_pair):
    import msgspec
    from test_receive_service import FakeTransport

    from lmcache_p2p import protocol
    from lmcache_p2p.backend.receive_service import ReceiveService
    from lmcache_p2p.buffer import SlotPool
    from lmcache_p2p.config import P2PConfig
    from engines import free_port

    pair = make_pair(shared_secret=SECRET, reserve_lease_s=LONG_LEASE_S, ready_lease_s=LONG_LEASE_S,
                     sender_opts={"shared_secret": SECRET, "connect_timeout_s": PAIRING_TIMEOUT_S})
    detail = pair.receiver.call(op="slots", detail=True)
    fingerprint = msgspec.convert(detail["fingerprint"], protocol.Fingerprint)
    shape = protocol.ChunkShape([1], "bfloat16", 1024)  # fits a slot of B and has B's dtype: B would grant it

    def hello(sender_id: str) -> protocol.Hello:
        return protocol.Hello(protocol.PROTOCOL_VERSION, sender_id, 0,
                              protocol.TransportInfo(kind="nixl", name=f"tx-{sender_id}"), fingerprint)

    b_endpoint, b_address = f"tcp://127.0.0.1:{pair.port}", f"127.0.0.1:{pair.port}"
    # A member signing as sender-x says Hello as sender-y (it reads the refusal addressed to sender-y).
    call, _, _, close = _member(b_endpoint, b"sender-y@spoof",
                                protocol.Codec(SECRET, identity="sender-x", names=["sender-x", "sender-y"]))
    try:
        reply = call(hello("sender-y"), b_address)
        assert isinstance(reply, protocol.ErrorReply) and "signed by 'sender-x'" in reply.message, reply
    finally:
        close()
    # Frames a member sent to receiver A (a real service in this process), replayed to the engine B.
    a_cfg = P2PConfig.from_mapping({"role": "receiver", "control_ports": [free_port()], "shared_secret": SECRET})
    transport_a = FakeTransport()
    transport_a.kind = "nixl"  # the engines' transport: the member's Hello fits A and B alike
    receiver_a = ReceiveService(a_cfg, tp_rank=0, tp_size=1, transport=transport_a, pool=SlotPool(4),
                                slot_bytes=4096, region_addr=0, chunk_tokens=256, dtype="bfloat16").start()
    codec_m = protocol.Codec(SECRET, identity="sender-m", names=["sender-m"])
    call, _, sent, close = _member(receiver_a.control_endpoint, b"sender-m@a", codec_m)
    try:
        welcome = call(hello("sender-m"), receiver_a.control_endpoint.removeprefix("tcp://"))
        assert isinstance(welcome, protocol.Welcome)
        grant = call(protocol.Alloc(1, "req-for-a", ["k-a"], [shape], True), welcome.receiver_id)
        assert isinstance(grant, protocol.Grant) and grant.slots[0] >= 0
    finally:
        close()
        receiver_a.close()
    _, replay, _, close = _member(b_endpoint, b"sender-m@tap", codec_m)
    try:
        for frames in sent:  # within the window, and B has never seen these nonces
            reply = replay(frames)
            assert isinstance(reply, protocol.ErrorReply) and "addressed to" in reply.message, reply
    finally:
        close()
    detail = pair.receiver.call(op="slots", detail=True)
    assert detail["rejected"] == {"spoofed": 1, "misaddressed": 2}, detail["rejected"]
    assert detail["free"] == detail["capacity"], detail  # nothing was reserved on B
    # The real signed pair still works.
    store(pair.sender, pair.port, seed=34, n=600, req_id="signed-after-replays")
    assert_received(pair.receiver, seed=34, n=600)
    assert all_free(pair.receiver)
    assert pair.receiver.call(op="slots", detail=True)["rejected"] == {"spoofed": 1, "misaddressed": 2}
