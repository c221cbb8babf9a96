"""The proxy's endpoints and its live registry while requests flow."""

from __future__ import annotations

import asyncio

import pytest

from lmcache_p2p.config import Role
from lmcache_p2p.proxy import app as app_module
from lmcache_p2p.proxy.flow import flow as flow_module
from lmcache_p2p.proxy.router.registry import StaticInstance

from .conftest import eventually, make_cluster
from .fakes import MODEL, FakeAgent, FakeVllm, generate, token_text, tokenize
from .router.test_routing import assert_idle

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

BODY = {"model": MODEL, "prompt": "hello world", "max_tokens": 4}
EXPECTED = "".join(token_text(t) for t in generate(tokenize("hello world"), 4))


async def test_instances_join_and_leave_while_requests_flow():
    async with make_cluster(n_decode=0) as c:
        assert (await c.post("/v1/completions", BODY)).json()["choices"][0]["text"] == EXPECTED  # on the prefiller
        first = await c.add_node(Role.RECEIVER)
        assert (await c.post("/v1/completions", BODY)).json()["choices"][0]["text"] == EXPECTED

        # A slow request is in flight on the first decoder when it says goodbye.
        first.vllm.token_delay_s = 0.05
        in_flight = asyncio.ensure_future(c.post("/v1/completions", {**BODY, "max_tokens": 10}))
        await eventually(lambda: first.vllm.calls("/v1/completions")[1:])
        await first.agent.goodbye()
        await eventually(lambda: not c.proxy.registry.routable(Role.RECEIVER))
        # No new work for a draining decoder: the prefiller serves it alone.
        assert (await c.post("/v1/completions", BODY)).json()["choices"][0]["text"] == EXPECTED
        assert c.metric("lmcache_p2p_proxy_colocated_total", reason="no_decoder", role="sender") == 2

        second = await c.add_node(Role.RECEIVER)
        assert (await c.post("/v1/completions", BODY)).json()["choices"][0]["text"] == EXPECTED
        assert len(second.vllm.calls("/v1/completions")) == 1

        resp = await in_flight  # the draining decoder finished its work
        assert resp.json()["choices"][0]["text"] == "".join(
            token_text(t) for t in generate(tokenize("hello world"), 10))
        await eventually(lambda: all(i.instance_id != first.agent.instance_id
                                     for i in c.proxy.registry.instances()))


async def test_silent_instance_is_evicted_after_the_ttl():
    async with make_cluster(n_prefill=0, n_decode=0, instance_ttl_s=0.3) as c:
        node = await c.add_node(Role.RECEIVER, announce=False)

        async def heartbeats() -> None:
            while True:
                await node.agent.announce()
                await asyncio.sleep(0.05)

        # heartbeats until it is routable: a loaded machine may take longer than the TTL to probe its /health
        beating = asyncio.ensure_future(heartbeats())
        try:
            await eventually(lambda: c.proxy.registry.routable(Role.RECEIVER))
        finally:
            beating.cancel()
        await eventually(lambda: not c.proxy.registry.instances())  # silent from now on (the default TTL is 30 s)
        resp = await c.post("/v1/completions", BODY)
        assert resp.status_code == 503


async def test_control_messages_need_the_shared_secret():
    async with make_cluster(secret="s3cret") as c:
        await c.add_node(Role.RECEIVER, announce=False)
        intruder = FakeAgent(c.control_address, "receiver", "http://127.0.0.1:1", base_port=9999, secret="guess")
        try:
            await intruder.announce()
            await eventually(lambda: c.metric("lmcache_p2p_proxy_control_rejected_total", reason="auth") == 1)
            assert len(c.proxy.registry.routable(Role.RECEIVER)) == 1
            assert (await c.post("/v1/completions", BODY)).status_code == 200
        finally:
            intruder.close()


async def test_static_instances_from_flags_pair_once_their_plugins_announce():
    prefiller, decoder = FakeVllm("p"), FakeVllm("d")
    await prefiller.server.start()
    await decoder.server.start()
    statics = (StaticInstance(Role.SENDER, prefiller.url),
               StaticInstance(Role.RECEIVER, decoder.url, "127.0.0.1", (27300,), (27400,)))
    try:
        async with make_cluster(n_prefill=0, n_decode=0, static_instances=statics) as c:
            # Only an instance whose plugin announces itself is paired (a static entry has no proof that its
            # plugin runs): the plugins announce at the flags' URLs and take the static entries' places.
            agent = FakeAgent(c.control_address, "receiver", decoder.url, base_port=27300)
            sender = FakeAgent(c.control_address, "sender", prefiller.url)
            c.network.add(agent)
            prefiller.kv_sink = c.network.deliver
            await agent.announce()
            await sender.announce()
            try:
                await eventually(lambda: c.proxy.registry.routable(Role.SENDER) and c.proxy.registry.routable(
                    Role.RECEIVER) and not any(i.static for i in c.proxy.registry.routable(Role.SENDER)
                                               + c.proxy.registry.routable(Role.RECEIVER)))  # announced, probed
                resp = await c.post("/v1/completions", BODY)
                assert resp.json()["choices"][0]["text"] == EXPECTED
                assert c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="ready") == 1
                spec = prefiller.calls("/v1/completions")[0]["kv_transfer_params"]["disagg_spec"]
                assert spec["receiver_alloc_port"] == [27300] and spec["receiver_init_port"] == [27400]
            finally:
                agent.close()
                sender.close()
    finally:
        await prefiller.server.stop()
        await decoder.server.stop()


async def test_models_health_instances_metrics():
    async with make_cluster() as c:
        models = await c.client.get("/v1/models")
        assert models.json()["data"][0]["id"] == MODEL and models.json()["data"][0]["owned_by"].startswith("receiver")
        health = (await c.client.get("/health")).json()
        assert health == {"status": "ok", "ready": True, "prefillers": 1, "decoders": 1}
        await c.post("/v1/completions", BODY)
        await c.post("/v1/completions", {**BODY, "n": 2})
        instances = (await c.client.get("/instances")).json()
        assert {i["role"] for i in instances} == {"sender", "receiver"}
        text = (await c.client.get("/metrics")).text
        for line in (
            'lmcache_p2p_proxy_requests_total{endpoint="/v1/completions",status="200"} 1.0',
            'lmcache_p2p_proxy_requests_total{endpoint="/v1/completions",status="400"} 1.0',
            'lmcache_p2p_proxy_errors_total{endpoint="/v1/completions",kind="BadRequest"} 1.0',
            'lmcache_p2p_proxy_ttft_seconds_count{endpoint="/v1/completions"} 1.0',
            "lmcache_p2p_proxy_handover_seconds_count 1.0",
            "lmcache_p2p_proxy_kv_wait_seconds_count 1.0",
            'lmcache_p2p_proxy_instances{role="receiver",state="active"} 1.0',
            "lmcache_p2p_proxy_instance_inflight_requests{",
            "lmcache_p2p_proxy_instance_free_slots{",
        ):
            assert line in text, line


async def test_models_without_instances_is_503():
    async with make_cluster(n_prefill=0, n_decode=0) as c:
        resp = await c.client.get("/v1/models")
        assert resp.status_code == 503 and resp.json()["error"]["code"] == 503
        assert (await c.client.get("/health")).json()["ready"] is False


async def test_summary_line_reports_ttft_and_handover():
    async with make_cluster() as c:
        for _ in range(3):
            await c.post("/v1/completions", BODY)
        line = c.proxy.metrics.take_summary()
        assert line.startswith("TTFT n=3 mean") and "handover n=3" in line and "p99" in line
        assert c.proxy.metrics.take_summary() is None


async def test_stats_summarizes_every_request_since_start_or_reset():
    async with make_cluster() as c:
        empty = (await c.client.get("/stats")).json()
        assert empty["ttft_ms"] == {"count": 0, "mean": None, "p50": None, "p99": None}
        for _ in range(3):
            await c.post("/v1/completions", BODY)
        await c.stream("/v1/completions", {**BODY, "stream": True})
        assert c.proxy.metrics.take_summary() is not None  # the log summary does not empty /stats
        stats = (await c.client.get("/stats")).json()
        assert set(stats) == {"window_s", "ttft_ms", "handover_ms", "kv_wait_ms", "timeline_ms", "recent", "reuse",
                              "requests", "recent_decodes"}
        assert len(stats["recent_decodes"]) == 4
        assert stats["window_s"] > 0
        for key in ("ttft_ms", "handover_ms", "kv_wait_ms"):
            s = stats[key]
            assert s["count"] == 4, key
            assert 0 <= s["p50"] <= s["p99"] and s["mean"] >= 0, key
        assert (await c.client.get("/stats")).json()["ttft_ms"]["count"] == 4  # GET is read-only

        ended = (await c.client.post("/stats/reset")).json()
        assert ended["handover_ms"]["count"] == 4
        after = (await c.client.get("/stats")).json()
        assert after["ttft_ms"]["count"] == after["handover_ms"]["count"] == 0 and after["handover_ms"]["p50"] is None
        await c.post("/v1/completions", {**BODY, "max_tokens": 1})  # no decode: a TTFT, no handover
        after = (await c.client.get("/stats")).json()
        assert (after["ttft_ms"]["count"], after["handover_ms"]["count"], after["kv_wait_ms"]["count"]) == (1, 0, 0)
        assert after["recent_decodes"] == []  # reset, and the first token ended that one: no decode


async def test_a_prefill_that_ends_after_its_client_left_and_the_handler_gave_up_releases_what_it_took(monkeypatch):
    """A cancelled prefill that does not stop within ``_CANCEL_WAIT_S`` goes on to lease a decoder and register
    its KV waiter after the handler answered: both are released when it ends."""
    monkeypatch.setattr(app_module, "_CANCEL_WAIT_S", 0.01)
    measure = flow_module.measure
    entered = asyncio.Event()

    async def slow_to_stop(services, ctx, req):
        entered.set()
        try:
            await asyncio.sleep(20)  # the client leaves meanwhile
        except asyncio.CancelledError:  # does not stop at its cancel: the handler gives up waiting first
            asyncio.current_task().uncancel()
            await asyncio.sleep(0.5)
        return await measure(services, ctx, req)

    monkeypatch.setattr(flow_module, "measure", slow_to_stop)
    async with make_cluster() as c:
        post = asyncio.ensure_future(c.post("/v1/completions", BODY))
        await eventually(entered.is_set)
        post.cancel()  # the client leaves
        await asyncio.gather(post, return_exceptions=True)
        await eventually(lambda: c.prefillers[0].vllm.calls("/v1/completions"))  # the late prefill ran
        await eventually(lambda: len(c.proxy.waiters) == 0 and all(
            i.inflight_requests == 0 for i in c.proxy.registry.instances()))
        assert_idle(c)
        await eventually(lambda: c.metric("lmcache_p2p_proxy_requests_total", endpoint="/v1/completions",
                                          status="499") == 1)
