"""KV the proxy will not use is cancelled on every rank of its decoder, at once."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from lmcache_p2p.config import Role
from lmcache_p2p.protocol import PROTOCOL_VERSION, Announce, Codec
from lmcache_p2p.proxy.handover.cancel import KvCanceller
from lmcache_p2p.proxy.observe.metrics import ProxyMetrics
from lmcache_p2p.proxy.router.registry import Registry

from ..conftest import Cluster, eventually, make_cluster
from ..fakes import MODEL, FakeReceiverControl, generate, token_text, tokenize

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

SECRET = "s3cret"
PROMPT = "The quick brown fox"
BODY = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5}


@asynccontextmanager
async def cluster_with_receiver(tp_size: int = 2, **settings: Any
                                ) -> AsyncIterator[tuple[Cluster, FakeReceiverControl]]:
    """One prefiller, one decoder of ``tp_size`` ranks whose receiver control sockets are real ROUTERs."""
    async with make_cluster(n_decode=0, secret=SECRET, **settings) as c:
        control = FakeReceiverControl(tp_size, secret=SECRET)
        try:
            node = await c.add_node(Role.RECEIVER, tp_size=tp_size, base_port=control.port)
            control.agent = node.agent
            yield c, control
        finally:
            await control.close()


def sent(c: Cluster) -> float:
    return c.metric("lmcache_p2p_proxy_kv_cancels_total", result="sent")


async def test_first_token_that_ends_the_output_cancels_on_every_rank(caplog):
    caplog.set_level(logging.DEBUG, logger="lmcache_p2p.proxy")
    async with cluster_with_receiver() as (c, control):
        c.decoders[0].agent.kv_mode = "silent"  # the KV has not been reported ready yet
        c.prefillers[0].vllm.eos_at = 0
        resp = await c.post("/v1/completions", BODY)
        assert resp.json()["choices"][0]["finish_reason"] == "stop"
        req_id = c.network.specs[-1]["req_id"]
        await eventually(lambda: len(control.cancels) == 2)
        assert control.req_ids(0) == control.req_ids(1) == [req_id]
        assert "first token ended the output" in control.cancels[0][1].reason
        # signed with the name the decoder addresses the proxy by: the one signer a receiver takes it from
        assert control.signers == [c.decoders[0].agent.proxy_name] * 2
        assert not c.decoders[0].vllm.requests
        # The receiver's KvFailed for the cancelled request (one per rank) is dropped quietly.
        await eventually(lambda: c.proxy.waiters.unmatched == 2)
        noisy = [r for r in caplog.records if r.levelno > logging.DEBUG and req_id in r.getMessage()]
        assert noisy == []
        assert sent(c) == 2


async def test_kv_timeout_cancels_before_the_decoder_recomputes():
    async with cluster_with_receiver(kv_timeout_s=0.2, on_kv_failure="recompute") as (c, control):
        c.decoders[0].agent.kv_mode = "silent"
        resp = await c.post("/v1/completions", BODY)
        assert resp.json()["choices"][0]["text"] == "".join(token_text(t) for t in generate(tokenize(PROMPT), 5))
        req_id = c.network.specs[-1]["req_id"]
        await eventually(lambda: len(control.cancels) == 2)
        assert control.req_ids(0) == control.req_ids(1) == [req_id]
        assert "KV timeout" in control.cancels[0][1].reason
        assert len(c.decoders[0].vllm.calls("/v1/completions")) == 1


async def test_kv_timeout_then_retry_cancels_the_first_attempt_only():
    # the short KV timeout is for the first attempt: the retry's KvReady is heard before its prefill answers
    async with cluster_with_receiver(kv_timeout_s=0.2, kv_before_answers=True) as (c, control):
        agent = c.decoders[0].agent
        agent.kv_mode = "silent"
        original = agent.on_kv

        def first_silent(spec: dict[str, Any]) -> None:
            if agent.kv_requests:
                agent.kv_mode = "ready"  # the retry's KV arrives
            original(spec)

        agent.on_kv = first_silent
        resp = await c.post("/v1/completions", BODY)
        assert resp.status_code == 200
        first, retry = (spec["req_id"] for spec in c.network.specs)
        # The first attempt is abandoned; the retry's KV is taken by the decode, then freed after its first token.
        await eventually(lambda: len(control.cancels) == 4)
        await asyncio.sleep(0.1)
        assert control.req_ids(0) == control.req_ids(1) == [first, retry]
        assert c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="ready") == 1 and retry != first


async def test_a_decode_frees_what_is_left_of_its_kv_after_its_first_token():
    """The decode's engine has loaded what it will load once it produced a token: the proxy cancels the req_id,
    so a slot the engine did not load (e.g. a partial last chunk) is not held until the lease expires."""
    async with cluster_with_receiver() as (c, control):
        for stream in (False, True):
            resp = await c.post("/v1/completions", {**BODY, "stream": stream})
            assert resp.status_code == 200
        req_ids = [spec["req_id"] for spec in c.network.specs]
        await eventually(lambda: len(control.cancels) == 4)
        await asyncio.sleep(0.1)
        assert control.req_ids(0) == control.req_ids(1) == req_ids
        assert all("decode is running" in msg.reason for _, msg in control.cancels)
        assert sent(c) == 4 and c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="ready") == 2
        assert len(c.decoders[0].vllm.calls("/v1/completions")) == 2  # each decode had reached the decoder


async def test_a_request_ending_at_one_token_sends_no_decode_and_no_free():
    async with cluster_with_receiver() as (c, control):
        resp = await c.post("/v1/completions", {**BODY, "max_tokens": 1})
        assert resp.status_code == 200
        await asyncio.sleep(0.2)
        assert control.cancels == [] and sent(c) == 0


async def test_cancel_sockets_close_with_the_decoder_and_after_close_cancels_are_dropped():
    control = FakeReceiverControl(tp_size=1)
    now_s = [0.0]
    registry = Registry(ttl_s=30, clock=lambda: now_s[0])
    metrics = ProxyMetrics(registry.instances)
    canceller = KvCanceller(Codec(None), metrics)
    registry.on_forgotten.append(canceller.forget)
    try:
        decoder = registry.announce(Announce(
            version=PROTOCOL_VERSION, instance_id="d", role="receiver", http_url="http://127.0.0.1:1", tp_rank=0,
            tp_size=1, control_host="127.0.0.1", control_port=control.port, transport_port=1))
        canceller.cancel(decoder, "r1", "test")
        canceller.cancel(decoder, "r2", "test")
        await eventually(lambda: [m.req_id for _, m in control.cancels] == ["r1", "r2"])
        assert canceller.open_sockets == 1
        now_s[0] += 31
        registry.evict_expired()
        assert canceller.open_sockets == 0
        canceller.close()
        canceller.close()
        canceller.cancel(decoder, "r3", "test")
        value = metrics.registry.get_sample_value
        assert value("lmcache_p2p_proxy_kv_cancels_total", {"result": "sent"}) == 2
        assert value("lmcache_p2p_proxy_kv_cancels_total", {"result": "dropped"}) == 1
    finally:
        canceller.close()
        await control.close()


def _registry_and_canceller(now_s: list[float]) -> tuple[Registry, KvCanceller, ProxyMetrics]:
    """A registry on a test clock whose forgotten and announced decoders its canceller hears of."""
    registry = Registry(ttl_s=30, clock=lambda: now_s[0])
    metrics = ProxyMetrics(registry.instances)
    canceller = KvCanceller(Codec(None), metrics, clock=lambda: now_s[0])
    registry.on_forgotten.append(canceller.forget)
    registry.on_announced.append(canceller.heard)
    return registry, canceller, metrics


def _announce_decoder(registry: Registry, port: int):
    return registry.announce(Announce(
        version=PROTOCOL_VERSION, instance_id="d", role="receiver", http_url="http://127.0.0.1:1", tp_rank=0,
        tp_size=1, control_host="127.0.0.1", control_port=port, transport_port=1))


async def test_cancels_lost_while_a_decoder_was_cut_off_are_sent_again_when_it_is_back():
    """A decoder whose heartbeats stopped (a cut link) is forgotten; the Cancels sent to it before (queued on a
    socket that never connected, closed by ``forget``) and while it was away reach it once it announces again."""
    control = FakeReceiverControl(tp_size=1)
    now_s = [0.0]
    registry, canceller, metrics = _registry_and_canceller(now_s)

    def announce(port: int):
        return _announce_decoder(registry, port)

    try:
        unreachable = announce(control.port + 1 if control.port < 65535 else control.port - 1)  # nothing listens
        canceller.cancel(unreachable, "before-cut", "test")
        now_s[0] += 31
        registry.evict_expired()  # forgotten: its socket, with the Cancel queued, is closed
        canceller.cancel(unreachable, "while-away", "test")
        assert canceller.open_sockets == 0
        await asyncio.sleep(0.2)
        assert control.cancels == []
        now_s[0] += 10
        back = announce(control.port)
        await eventually(lambda: [m.req_id for _, m in control.cancels] == ["before-cut", "while-away"])
        canceller.cancel(back, "after", "test")
        announce(control.port)  # a heartbeat: nothing owed twice
        await eventually(lambda: [m.req_id for _, m in control.cancels][2:] == ["after"])
        await asyncio.sleep(0.2)
        assert len(control.cancels) == 3
        value = metrics.registry.get_sample_value
        assert value("lmcache_p2p_proxy_kv_cancels_total", {"result": "replayed"}) == 2
        assert value("lmcache_p2p_proxy_kv_cancels_total", {"result": "deferred"}) == 1
    finally:
        canceller.close()
        await control.close()


async def test_cancels_older_than_the_replay_window_are_not_sent_again():
    from lmcache_p2p.proxy.handover.cancel import REPLAY_WINDOW_S

    control = FakeReceiverControl(tp_size=1)
    now_s = [0.0]
    registry, canceller, _ = _registry_and_canceller(now_s)

    def announce():
        return _announce_decoder(registry, control.port)

    try:
        decoder = announce()
        canceller.cancel(decoder, "old", "test")
        await eventually(lambda: len(control.cancels) == 1)
        now_s[0] += REPLAY_WINDOW_S - 20
        canceller.cancel(decoder, "recent", "test")
        await eventually(lambda: len(control.cancels) == 2)
        now_s[0] += 31
        registry.evict_expired()
        announce()
        await eventually(lambda: len(control.cancels) == 3)
        await asyncio.sleep(0.2)
        assert [m.req_id for _, m in control.cancels] == ["old", "recent", "recent"]
    finally:
        canceller.close()
        await control.close()
