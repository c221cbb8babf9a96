"""Which instances serve a request: the router's choices, and colocated serving / retries through the proxy."""

from __future__ import annotations

import logging

import pytest

from lmcache_p2p.config import Role
from lmcache_p2p.protocol import PROTOCOL_VERSION, Announce
from lmcache_p2p.proxy.errors import NoCapacity, NoInstanceAvailable
from lmcache_p2p.proxy.router.registry import Registry, StaticInstance
from lmcache_p2p.proxy.router.routing import Policy, RequestCost, Router, chunks_needed, exceeds_every_buffer

from ..conftest import eventually, make_cluster
from ..fakes import (MESSAGES, MODEL, PROMPT, FakeReceiverControl, FakeVllm, chat_prompt, expected_text, fingerprint, generate,
                    token_text, tokenize)

def assert_idle(cluster) -> None:
    """Every lease released, every waiter dropped, no credit held."""
    assert len(cluster.proxy.waiters) == 0
    for inst in cluster.proxy.registry.instances():
        assert (inst.inflight_requests, inst.inflight_tokens) == (0, 0), inst.instance_id
        assert inst.free_slots() in (None, inst.capacity_slots), inst.instance_id


def add(registry: Registry, name: str, *, role: str = "receiver", free: int = 100, capacity: int = 100,
        chunk_tokens: int = 256):
    inst = registry.announce(Announce(
        version=PROTOCOL_VERSION, instance_id=name, role=role, http_url=f"http://{name}:1", tp_rank=0, tp_size=1,
        control_host="127.0.0.1", control_port=7300, transport_port=7400, capacity_slots=capacity, free_slots=free,
        chunk_tokens=chunk_tokens))
    registry.mark_up(inst)  # as if its GET /health answered 200
    return inst


COST = RequestCost(prompt_tokens=1000, max_output_tokens=100)  # 4 chunks of 256


def test_chunks_needed():
    assert chunks_needed(1000, 256) == 4 and chunks_needed(1024, 256) == 4 and chunks_needed(1, 256) == 1
    assert chunks_needed(1000, 0) == 0


def test_round_robin_cycles_in_id_order():
    registry, router = Registry(10), Router(Policy.ROUND_ROBIN)
    for name in ("c", "a", "b"):
        add(registry, name)
    picks = [router.pick_decoder(registry.routable(Role.RECEIVER), COST).instance_id for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_least_loaded_picks_fewest_inflight_tokens_and_spreads_ties():
    registry, router = Registry(10), Router(Policy.LEAST_LOADED)
    a, b, c = (add(registry, n) for n in "abc")
    registry.lease(a, tokens=500)
    registry.lease(c, tokens=100)
    assert router.pick_decoder(registry.routable(Role.RECEIVER), COST) is b
    registry.lease(b, tokens=100)
    picks = {router.pick_decoder(registry.routable(Role.RECEIVER), COST).instance_id for _ in range(4)}
    assert picks == {"b", "c"}


def test_a_burst_does_not_oversubscribe_a_decoder_buffer():
    registry, router = Registry(10), Router(Policy.LEAST_LOADED)
    a = add(registry, "a", free=10)
    b = add(registry, "b", free=5)
    chosen = []
    for _ in range(3):  # 4 chunks each, no heartbeat in between
        d = router.pick_decoder(registry.routable(Role.RECEIVER), COST)
        registry.lease(d, tokens=COST.decode_tokens, chunks=4)
        chosen.append(d)
    assert chosen.count(a) == 2 and chosen.count(b) == 1
    with pytest.raises(NoCapacity, match="every decoder buffer is busy: the request needs 4 KV chunks"):
        router.pick_decoder(registry.routable(Role.RECEIVER), COST)


def test_buffer_fit_filter_skips_a_decoder_too_full_for_the_request():
    registry, router = Registry(10), Router(Policy.LEAST_LOADED)
    add(registry, "a", free=3)
    b = add(registry, "b", free=4)
    registry.lease(b, tokens=10_000)  # more loaded, but the only one that fits
    assert router.pick_decoder(registry.routable(Role.RECEIVER), COST) is b


def test_request_larger_than_every_buffer_names_the_setting():
    registry, router = Registry(10), Router(Policy.LEAST_LOADED)
    add(registry, "a", free=2, capacity=2)
    with pytest.raises(NoCapacity, match=r"needs 4 KV chunks .* holds 2 chunks: raise p2p.buffer_size") as info:
        router.pick_decoder(registry.routable(Role.RECEIVER), COST)
    assert info.value.status_code == 503


def test_no_instances_is_503():
    router = Router(Policy.LEAST_LOADED)
    with pytest.raises(NoInstanceAvailable, match="no decoder") as info:
        router.pick_decoder([], COST)
    assert info.value.status_code == 503
    with pytest.raises(NoInstanceAvailable, match="no prefiller"):
        router.pick_prefiller([])


def test_exclude_is_a_preference():
    registry, router = Registry(10), Router(Policy.LEAST_LOADED)
    a, b = add(registry, "a", role="sender"), add(registry, "b", role="sender")
    registry.lease(b, tokens=1000)
    assert router.pick_prefiller(registry.routable(Role.SENDER), exclude={"a"}) is b
    assert router.pick_prefiller([a], exclude={"a"}) is a


def test_a_decoder_that_recomputes_needs_no_buffer_room():
    registry, router = Registry(10), Router(Policy.LEAST_LOADED)
    full = add(registry, "a", free=0)
    assert router.pick_decoder(registry.routable(Role.RECEIVER), COST, needs_kv=False) is full
    with pytest.raises(NoCapacity):
        router.pick_decoder(registry.routable(Role.RECEIVER), COST)


def test_decoder_with_unknown_capacity_is_always_eligible():
    registry, router = Registry(10), Router(Policy.LEAST_LOADED)
    inst = add(registry, "a", free=0, capacity=0)
    assert router.pick_decoder(registry.routable(Role.RECEIVER), COST) is inst


def test_least_loaded_breaks_load_ties_by_free_credit():
    registry, router = Registry(10), Router(Policy.LEAST_LOADED)
    add(registry, "a", free=10)
    b = add(registry, "b", free=30)
    add(registry, "c", free=20)
    assert [router.pick_decoder(registry.routable(Role.RECEIVER), COST) for _ in range(3)] == [b, b, b]


def test_decoder_with_room_and_exceeds_every_buffer():
    registry, router = Registry(10), Router(Policy.LEAST_LOADED)
    full = add(registry, "a", free=0, capacity=8)
    small = add(registry, "b", free=3, capacity=3)
    assert router.decoder_with_room([full, small], COST) is None
    assert not exceeds_every_buffer([full, small], COST.prompt_tokens)  # a's buffer could hold it later
    assert exceeds_every_buffer([small], COST.prompt_tokens)
    assert not exceeds_every_buffer([], COST.prompt_tokens)
    static = add(registry, "c", free=0, capacity=0)  # capacity unknown: it may fit
    assert not exceeds_every_buffer([small, static], COST.prompt_tokens)
    assert router.decoder_with_room([full, small, static], COST) is static


# ---- who serves a request, through the proxy --------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_only_a_prefiller_alive_serves_requests_colocated():
    async with make_cluster(n_decode=0) as c:
        prefiller = c.prefillers[0].vllm
        ids = tokenize(PROMPT)
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 6,
                                                "return_token_ids": True})
        choice = resp.json()["choices"][0]
        assert choice["text"] == expected_text(ids, 6) and choice["token_ids"] == generate(ids, 6)
        assert resp.json()["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 6,
                                        "total_tokens": len(ids) + 6}
        events = await c.stream("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 4,
                                                         "stream": True, "stream_options": {"include_usage": True}})
        chat_ids = tokenize(chat_prompt(MESSAGES))
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])
        assert text == expected_text(chat_ids, 4) and events[-2]["usage"]["completion_tokens"] == 4
        calls = prefiller.calls("/v1/completions")
        assert len(calls) == 2 and all("kv_transfer_params" not in b and b["stream"] for b in calls)
        assert calls[0]["prompt"] == ids and calls[0]["max_tokens"] == 6
        assert c.metric("lmcache_p2p_proxy_colocated_total", reason="no_decoder", role="sender") == 2
        assert c.metric("lmcache_p2p_proxy_ttft_seconds_count", endpoint="/v1/completions") == 1
        assert_idle(c)


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_only_a_decoder_alive_computes_the_prompt_itself():
    async with make_cluster(n_prefill=0) as c:
        decoder = c.decoders[0].vllm
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 5})
        assert resp.json()["choices"][0]["text"] == expected_text(tokenize(PROMPT), 5)
        one = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 1})
        assert one.json()["choices"][0]["text"] == expected_text(tokenize(PROMPT), 1)
        assert all("kv_transfer_params" not in b for b in decoder.calls("/v1/completions"))
        assert c.metric("lmcache_p2p_proxy_colocated_total", reason="no_prefiller", role="receiver") == 2
        assert c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="timeout") == 0  # nothing waited for KV
        assert_idle(c)


async def cluster_with_cancels(n_prefill: int):
    """``n_prefill`` prefillers and one decoder whose receiver control socket records Cancels."""
    cm = make_cluster(n_prefill=n_prefill, n_decode=0)
    c = await cm.__aenter__()
    control = FakeReceiverControl(1)
    node = await c.add_node(Role.RECEIVER, base_port=control.port)
    control.agent = node.agent
    return cm, c, control


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_prefill_that_breaks_after_it_was_sent_is_retried_on_another_prefiller():
    cm, c, control = await cluster_with_cancels(2)
    try:
        first, second = c.prefillers
        first.vllm.break_next = 1
        other = next(i for i in c.proxy.registry.routable(Role.SENDER) if i.http_url == second.vllm.url)
        busy = c.proxy.registry.lease(other, tokens=10**6)  # so the first pick is the one that breaks
        try:
            events = await c.stream("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 5,
                                                        "stream": True})
        finally:
            busy.release()
        assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected_text(tokenize(PROMPT), 5)
        broken_id, retry_id = (s["req_id"] for s in c.network.specs)
        assert first.vllm.calls("/v1/completions") and second.vllm.calls("/v1/completions")
        # the broken attempt's KV is freed; the retry's leftover KV is freed after the decode's first token
        await eventually(lambda: control.req_ids() == [broken_id, retry_id])
        assert retry_id != broken_id
        assert c.metric("lmcache_p2p_proxy_failovers_total", phase="prefill") == 1
        assert c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="ready") == 1
        assert_idle(c)
    finally:
        await control.close()
        await cm.__aexit__(None, None, None)


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_broken_prefill_with_no_other_prefiller_is_computed_by_the_decoder():
    cm, c, control = await cluster_with_cancels(1)
    try:
        c.prefillers[0].vllm.break_next = 1
        resp = await c.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 4})
        ids = tokenize(chat_prompt(MESSAGES))
        assert resp.json()["choices"][0]["message"]["content"] == expected_text(ids, 4)
        broken_id, = (s["req_id"] for s in c.network.specs)
        await eventually(lambda: control.req_ids() == [broken_id])
        decode, = c.decoders[0].vllm.calls("/v1/completions")
        assert decode["prompt"] == ids and decode["max_tokens"] == 4
        assert c.metric("lmcache_p2p_proxy_colocated_total", reason="prefill_failed", role="receiver") == 1
        assert_idle(c)
    finally:
        await control.close()
        await cm.__aexit__(None, None, None)


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_prefill_that_breaks_twice_fails_cleanly():
    async with make_cluster(n_prefill=2) as c:
        for node in c.prefillers:
            node.vllm.break_next = 1
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        assert resp.status_code == 502 and "payload is not completed" in resp.json()["error"]["message"]
        assert not c.decoders[0].vllm.requests  # a request that kills engines does not go round the cluster
        assert_idle(c)


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_prefillers_and_decoders_pair_only_when_their_fingerprints_agree(caplog):
    async with make_cluster(n_prefill=0, n_decode=0) as c:
        other = await c.add_node(Role.SENDER, fingerprint=fingerprint("other-model"))
        same = await c.add_node(Role.SENDER, fingerprint=fingerprint())
        decoder = await c.add_node(Role.RECEIVER, fingerprint=fingerprint())
        with caplog.at_level(logging.WARNING, logger="lmcache_p2p.proxy.router.registry"):
            for _ in range(4):
                resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3})
                assert resp.json()["choices"][0]["text"] == expected_text(tokenize(PROMPT), 3)
        assert not other.vllm.requests and len(same.vllm.calls("/v1/completions")) == 4
        assert len(decoder.vllm.calls("/v1/completions")) == 4
        assert c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="ready") == 4
        mismatch, = [r.getMessage() for r in caplog.records if "never paired" in r.getMessage()]
        assert other.agent.instance_id in mismatch and "model: decoder 'fake-model', prefiller 'other-model'" in mismatch
        listed = {i["instance_id"]: i for i in (await c.client.get("/instances")).json()}
        assert listed[decoder.agent.instance_id]["fingerprint"]["model"] == MODEL
        assert listed[other.agent.instance_id]["fingerprint"]["model"] == "other-model"


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_prefiller_with_no_compatible_decoder_serves_colocated():
    async with make_cluster(n_prefill=0, n_decode=0) as c:
        prefiller = await c.add_node(Role.SENDER, fingerprint=fingerprint(dtype="float16"))
        decoder = await c.add_node(Role.RECEIVER, fingerprint=fingerprint())
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3})
        assert resp.json()["choices"][0]["text"] == expected_text(tokenize(PROMPT), 3)
        call, = prefiller.vllm.calls("/v1/completions")
        assert "kv_transfer_params" not in call and not decoder.vllm.requests and not c.network.specs
        assert c.metric("lmcache_p2p_proxy_colocated_total", reason="no_compatible_decoder", role="sender") == 1


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_prefiller_whose_tp_split_cannot_be_reconciled_serves_colocated():
    async with make_cluster(n_prefill=0, n_decode=0) as c:
        prefiller = await c.add_node(Role.SENDER, fingerprint=fingerprint(kv_heads=3, tp_size=2, kv_heads_total=6))
        decoder = await c.add_node(Role.RECEIVER, fingerprint=fingerprint(kv_heads=2, tp_size=3, kv_heads_total=6))
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3})
        assert resp.json()["choices"][0]["text"] == expected_text(tokenize(PROMPT), 3)
        assert not decoder.vllm.requests and not c.network.specs
        assert "kv_transfer_params" not in prefiller.vllm.calls("/v1/completions")[0]
        assert c.metric("lmcache_p2p_proxy_colocated_total", reason="no_compatible_decoder", role="sender") == 1


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_static_decoder_that_never_announced_is_not_paired_and_one_instance_serves(caplog):
    decoder = FakeVllm("static-decoder")
    await decoder.server.start()
    statics = (StaticInstance(Role.RECEIVER, decoder.url, "127.0.0.1", (27500,), (27600,)),)
    try:
        async with make_cluster(n_prefill=1, n_decode=0, static_instances=statics) as c:
            await eventually(lambda: c.proxy.registry.routable(Role.RECEIVER))  # its /health answered 200
            with caplog.at_level(logging.WARNING, logger="lmcache_p2p.proxy.router.registry"):
                for _ in range(2):
                    resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3})
                    assert resp.json()["choices"][0]["text"] == expected_text(tokenize(PROMPT), 3)
            calls = decoder.calls("/v1/completions")
            assert len(calls) == 2 and all("kv_transfer_params" not in b for b in calls)
            assert not c.prefillers[0].vllm.calls("/v1/completions") and not c.network.specs
            assert c.metric("lmcache_p2p_proxy_colocated_total", reason="plugin_not_running", role="receiver") == 2
            logged, = [r.getMessage() for r in caplog.records if "LMCache plugin" in r.getMessage()]
            assert decoder.url in logged
            assert_idle(c)
    finally:
        await decoder.server.stop()


def test_a_prompt_larger_than_every_buffer_is_refused_with_how_to_size_the_buffer():
    from lmcache_p2p.proxy.router.lease import no_capacity

    registry = Registry(10)
    small = add(registry, "b", free=3, capacity=3)
    message = str(no_capacity([small], COST.prompt_tokens))
    needed = chunks_needed(COST.prompt_tokens, small.chunk_tokens)
    assert f"needs {needed} KV chunks" in message and "holds 3 chunks" in message
    assert f"lmcache-p2p launch --buffer-size) to at least {needed} chunks' worth" in message
