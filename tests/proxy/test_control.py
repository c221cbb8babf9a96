"""The control socket over real ZMQ, and the KV waiters it feeds."""

from __future__ import annotations

import asyncio
import logging

import pytest

from lmcache_p2p.backend.announcer import Announcer
from lmcache_p2p.config import Role
from lmcache_p2p.errors import ConfigError
from lmcache_p2p.protocol import (PROTOCOL_VERSION, Announce, Codec, Hello, KvFailed, KvReady, TransportInfo,
                                  dialled_name)
from lmcache_p2p.proxy.control import ControlListener
from lmcache_p2p.proxy.observe.metrics import ProxyMetrics
from lmcache_p2p.proxy.router.registry import Registry
from lmcache_p2p.proxy.settings import ProxySettings
from lmcache_p2p.proxy.handover.waiters import KvStatus, KvWaiters

from .conftest import EVENTUALLY_TIMEOUT_S, eventually
from .fakes import FakeAgent

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(20)]


class Plane:
    def __init__(self, secret: str | None) -> None:
        self.registry = Registry(ttl_s=30)
        self.waiters = KvWaiters()
        self.metrics = ProxyMetrics(self.registry.instances)
        self.listener = ControlListener("127.0.0.1", 0, Codec(secret), self.registry, self.waiters, self.metrics)

    def rejected(self, reason: str) -> float:
        return self.metrics.registry.get_sample_value("lmcache_p2p_proxy_control_rejected_total",
                                                      {"reason": reason}) or 0.0


@pytest.fixture
async def plane():
    p = Plane("s3cret")
    p.listener.start()
    yield p
    await p.listener.close()


async def test_announce_and_kv_ready_arrive_over_zmq(plane):
    agent = FakeAgent(plane.listener.address, "receiver", "http://127.0.0.1:8200", tp_size=2, base_port=7300,
                      secret="s3cret")
    try:
        waiter = plane.waiters.register("req-1", tp_size=2)
        await agent.announce()
        await eventually(lambda: any(i.complete for i in plane.registry.instances()))
        agent.on_kv({"req_id": "req-1"})
        outcome = await waiter.wait(timeout_s=EVENTUALLY_TIMEOUT_S)  # a loaded machine can take seconds to deliver
        assert outcome.status is KvStatus.READY and outcome.nbytes == 2 * (3 << 20) and outcome.chunks == 3
    finally:
        agent.close()


async def test_wrong_secret_is_rejected_counted_and_logged(plane, caplog):
    caplog.set_level(logging.WARNING, logger="lmcache_p2p.proxy.control")
    intruder = FakeAgent(plane.listener.address, "receiver", "http://evil:1", base_port=7300, secret="wrong")
    unsigned = FakeAgent(plane.listener.address, "receiver", "http://evil:2", base_port=7300, secret=None)
    try:
        await intruder.announce()
        await unsigned.announce()
        await eventually(lambda: plane.rejected("auth") == 2)
        assert plane.registry.instances() == []
        assert len(caplog.records) == 1 and "shared-secret" in caplog.text  # then rate-limited
    finally:
        intruder.close()
        unsigned.close()


async def test_malformed_and_foreign_messages_are_rejected_and_the_listener_keeps_going(plane):
    codec = Codec("s3cret")
    to = dialled_name(plane.listener.address)
    plane.listener.handle([b"only one frame"])
    plane.listener.handle(codec.pack(Hello(version=1, sender_id="s", tp_rank=0,
                                           transport=TransportInfo(kind="nixl", name="n")), to))
    plane.listener.handle(codec.seal(b"\x93garbage", to))
    assert plane.rejected("malformed") == 3
    agent = FakeAgent(plane.listener.address, "sender", "http://127.0.0.1:8100", secret="s3cret")
    try:
        await agent.announce()
        await eventually(lambda: [i.role for i in plane.registry.instances()] == [Role.SENDER])
    finally:
        agent.close()


async def test_replayed_stale_and_oversized_frames_are_rejected_by_reason(plane):
    """A captured Goodbye replayed later must not unregister the instance; each refusal has its own label."""
    import zmq
    import zmq.asyncio

    from lmcache_p2p.protocol import MAX_MESSAGE_BYTES, PROTOCOL_VERSION, Announce, Goodbye

    codec = Codec("s3cret", identity="decoder-a")
    to = dialled_name(plane.listener.address)
    announce = Announce(PROTOCOL_VERSION, "decoder-a", "receiver", "http://127.0.0.1:8200", 0, 1, "127.0.0.1", 7300)
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(plane.listener.address)
    try:
        goodbye = codec.pack(Goodbye("decoder-a"), to)
        await sock.send_multipart(codec.pack(announce, to))
        await sock.send_multipart(goodbye)
        await eventually(lambda: plane.registry.instances() == [])
        await sock.send_multipart(codec.pack(announce, to))
        await eventually(lambda: len(plane.registry.instances()) == 1)
        await sock.send_multipart(goodbye)  # the captured frame, replayed
        old = Codec("s3cret", clock=lambda: __import__("time").time() - 60)
        await sock.send_multipart(old.pack(Goodbye("decoder-a"), to))
        await sock.send_multipart(codec.seal(b"\x00" * MAX_MESSAGE_BYTES, to))
        await eventually(lambda: (plane.rejected("replay"), plane.rejected("stale"), plane.rejected("oversized"))
                         == (1, 1, 1))
        assert [i.instance_id for i in plane.registry.instances()] == ["decoder-a"]
    finally:
        sock.close(linger=0)
        ctx.term()


class TapCodec(Codec):
    """An instance's codec that keeps every frame it made: what a wire tap between it and its proxy sees."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[list[bytes]] = []

    def pack(self, msg, to="", *, signer=None) -> list[bytes]:
        frames = super().pack(msg, to, signer=signer)
        self.sent.append(frames)
        return frames


async def _send_until_taken(announcer: Announcer, msg) -> None:
    """Announcer.send drops a frame until its PUSH socket is connected (IMMEDIATE): retry until sent."""
    while not announcer.send(msg):
        await asyncio.sleep(0.01)


def _announce(instance_id: str) -> Announce:
    return Announce(PROTOCOL_VERSION, instance_id, "receiver", "http://127.0.0.1:8200", 0, 1, "127.0.0.1", 7300,
                    7400)


async def test_an_instances_frames_captured_for_one_proxy_are_refused_by_another(plane, caplog):
    caplog.set_level(logging.WARNING, logger="lmcache_p2p.proxy.control")
    other = Plane("s3cret")  # a second proxy of the same members (same secret)
    other.listener.start()
    tap = TapCodec("s3cret", identity="decoder-x/r0/1")
    announcer = Announcer(plane.listener.address, tap, interval_s=60)
    try:
        await _send_until_taken(announcer, _announce("decoder-x"))
        announcer.send(KvReady(req_id="req-1", instance_id="decoder-x", tp_rank=0, chunks=1, nbytes=10))
        await eventually(lambda: len(plane.registry.instances()) == 1 and plane.waiters.unmatched == 1)
        captured = tap.sent[-2:]
        replayer = FakeAgent(other.listener.address, "receiver", "http://127.0.0.1:8200", secret="s3cret")
        try:
            for frames in captured:  # replayed to the other proxy within the window, as captured
                await replayer._sock.send_multipart(frames)
            await eventually(lambda: other.rejected("misaddressed") == 2)
        finally:
            replayer.close()
        assert other.registry.instances() == [] and other.waiters.unmatched == 0
        assert plane.rejected("misaddressed") == 0
        warnings = [r.getMessage() for r in caplog.records if "misaddressed" in r.getMessage()]
        assert len(warnings) == 1  # rate-limited: one line for both
        assert f"addressed to '{dialled_name(plane.listener.address)}'" in warnings[0]
        assert f"'{dialled_name(other.listener.address)}'" in warnings[0]
    finally:
        announcer.close()
        await other.listener.close()


async def test_a_restarted_proxy_refuses_frames_of_its_earlier_incarnation_and_takes_new_ones():
    first = Plane("s3cret")
    first.listener.start()
    port = first.listener.port
    tap = TapCodec("s3cret", identity="decoder-x/r0/1")
    announcer = Announcer(first.listener.address, tap, interval_s=60)
    try:
        await _send_until_taken(announcer, _announce("decoder-x"))
        await eventually(lambda: len(first.registry.instances()) == 1)
        captured = tap.sent[-1]
        await first.listener.close()
        await asyncio.sleep(0.01)  # the restart comes after the capture, by the clock that stamps frames
        restarted = Plane("s3cret")
        restarted.listener = ControlListener("127.0.0.1", port, restarted.listener._codec, restarted.registry,
                                             restarted.waiters, restarted.metrics)
        restarted.listener.start()
        try:
            replayer = FakeAgent(restarted.listener.address, "receiver", "http://127.0.0.1:8200", secret="s3cret")
            try:
                await replayer._sock.send_multipart(captured)
                await eventually(lambda: restarted.rejected("stale") == 1)
            finally:
                replayer.close()
            assert restarted.registry.instances() == []
            await _send_until_taken(announcer, _announce("decoder-x"))  # the instance's own frames still go
            await eventually(lambda: len(restarted.registry.instances()) == 1)
        finally:
            await restarted.listener.close()
    finally:
        announcer.close()


def test_the_proxy_answers_to_its_advertised_hosts_and_its_bind_host():
    settings = ProxySettings(control_host="10.0.0.5", advertise_hosts=("proxy.example",), shared_secret="s")
    assert settings.control_name_hosts == ("proxy.example", "10.0.0.5")
    assert "localhost" in ProxySettings().control_name_hosts  # loopback: either spelling
    with pytest.raises(ConfigError, match="--advertise-host"):
        ProxySettings(advertise_hosts=("0.0.0.0",))


async def test_close_is_idempotent_and_frees_the_port():
    p = Plane(None)
    p.listener.start()
    port = p.listener.port
    await p.listener.close()
    await p.listener.close()
    again = ControlListener("127.0.0.1", port, Codec(None), p.registry, p.waiters, p.metrics)
    again.start()
    await again.close()


# ---- waiters --------------------------------------------------------------------------------------


def ready(req_id: str, rank: int) -> KvReady:
    return KvReady(req_id=req_id, instance_id="d", tp_rank=rank, chunks=2, nbytes=100)


async def test_waiter_needs_every_rank_and_times_out_otherwise():
    waiters = KvWaiters()
    waiter = waiters.register("r", tp_size=2)
    waiters.deliver(ready("r", 0))
    waiters.deliver(ready("r", 0))  # a duplicate does not count twice
    outcome = await waiter.wait(timeout_s=0.05)
    assert outcome.status is KvStatus.TIMEOUT and "ranks ready: [0]" in outcome.reason
    waiters.deliver(ready("r", 1))
    assert (await waiter.wait(timeout_s=1)).status is KvStatus.READY


async def test_waiter_failure_and_drop():
    waiters = KvWaiters()
    waiter = waiters.register("r", tp_size=4)
    waiters.deliver(KvFailed(req_id="r", instance_id="d", tp_rank=3, reason="refused: full"))
    outcome = await waiter.wait(timeout_s=1)
    assert outcome.status is KvStatus.FAILED and "rank 3 of d: refused: full" in outcome.reason
    waiter.drop()
    waiter.drop()
    assert len(waiters) == 0
    assert waiters.deliver(ready("r", 0)) is False and waiters.unmatched == 1
    with pytest.raises(ValueError):
        waiters.register("x", 1), waiters.register("x", 1)


async def test_notice_before_the_wait_is_kept():
    waiters = KvWaiters()
    waiter = waiters.register("r", tp_size=1)
    waiters.deliver(ready("r", 0))
    await asyncio.sleep(0)
    assert (await waiter.wait(timeout_s=0.01)).status is KvStatus.READY


async def test_a_forged_reply_to_a_cancel_is_counted_as_rejected():
    """The proxy's Cancel sockets read replies too: one signed with another secret is refused and counted."""
    import zmq
    import zmq.asyncio

    from lmcache_p2p.protocol import PROTOCOL_VERSION, Ack, Announce
    from lmcache_p2p.proxy.handover.cancel import KvCanceller

    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    registry = Registry(ttl_s=30)
    metrics = ProxyMetrics(registry.instances)
    canceller = KvCanceller(Codec("s3cret"), metrics)
    try:
        decoder = registry.announce(Announce(
            version=PROTOCOL_VERSION, instance_id="d", role="receiver", http_url="http://127.0.0.1:1", tp_rank=0,
            tp_size=1, control_host="127.0.0.1", control_port=port, transport_port=1))
        canceller.cancel(decoder, "r1", "test")
        identity, *frames = await asyncio.wait_for(router.recv_multipart(), 10)
        msg = Codec("s3cret", names=[f"127.0.0.1:{port}"]).unpack(frames)  # a Cancel names the rank's address
        await router.send_multipart([identity, *Codec("forged").pack(Ack(msg.seq))])
        await asyncio.sleep(0.1)

        def rejected() -> float:
            canceller.cancel(decoder, "r2", "test")  # replies are read before each send
            return metrics.registry.get_sample_value("lmcache_p2p_proxy_control_rejected_total",
                                                     {"reason": "auth"}) or 0.0

        await eventually(lambda: rejected() == 1)
    finally:
        canceller.close()
        router.close(linger=0)
        ctx.term()
