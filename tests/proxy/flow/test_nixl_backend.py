"""The proxy in front of instances running vLLM's own NixlConnector (``flow/backends.py``), against fakes that
keep NixlConnector's two-stage contract (``tests/proxy/nixl_fakes.py``)."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import pytest

from lmcache_p2p.config import Role
from lmcache_p2p.proxy.flow.backends import NIXL_PREFILL_PARAMS
from lmcache_p2p.proxy.router.instances import InstanceState
from lmcache_p2p.vllm_plugin.router_addressing import MARKER_KEY

from ..conftest import Cluster, eventually, make_cluster, tokenizer_dir  # noqa: F401 (a fixture)
from ..fakes import MESSAGES, MODEL, PROMPT, chat_prompt, generate, token_text, tokenize
from ..nixl_fakes import FakeNixlVllm, NixlNetwork

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

_side_channel_ports = itertools.count(5600)
NIXL = "vllm-nixl"


async def add_nixl(c: Cluster, network: NixlNetwork, role: str, *, wait: bool = True) -> FakeNixlVllm:
    """A fake NixlConnector instance, registered with the proxy by URL (``POST /instances/register``)."""
    vllm = FakeNixlVllm(f"nixl-{role}-{next(_side_channel_ports)}", network, next(_side_channel_ports))
    if c.encode is not None:
        vllm.encode = c.encode
    await vllm.server.start()
    resp = await c.post("/instances/register", {"role": role, "url": vllm.url, "backend": NIXL})
    assert resp.status_code == 200, resp.text
    assert resp.json()["backend"] == NIXL
    c.extra_servers.append(vllm)
    if wait:
        await eventually(lambda: routable(c, vllm.url))
    return vllm


def routable(c: Cluster, url: str) -> bool:
    return any(i.http_url == url and i.routable for i in c.proxy.registry.instances())


def client_tokens(events: list[dict[str, Any] | str]) -> list[int]:
    return [t for e in events if isinstance(e, dict) for ch in e.get("choices", []) for t in ch.get("token_ids") or ()]


def client_text(events: list[dict[str, Any] | str]) -> str:
    return "".join(ch.get("text") or "" for e in events if isinstance(e, dict) for ch in e.get("choices", []))


async def nixl_cluster(n_prefill: int = 1, n_decode: int = 1, **settings: Any):
    """A proxy with only NixlConnector instances (and their network); use as ``async with``."""
    network = NixlNetwork()
    settings = {"kv_metrics_interval_s": 0.05, "policy": "least_loaded", **settings}
    cm = make_cluster(0, 0, **settings)
    c = await cm.__aenter__()
    c.extra_servers = []
    try:
        prefillers = [await add_nixl(c, network, "prefiller") for _ in range(n_prefill)]
        decoders = [await add_nixl(c, network, "decoder") for _ in range(n_decode)]
    except BaseException:
        await _close(cm, c)
        raise
    return cm, c, network, prefillers, decoders


async def _close(cm: Any, c: Cluster) -> None:
    await cm.__aexit__(None, None, None)
    await asyncio.gather(*(s.server.stop() for s in c.extra_servers))


BODY = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "return_token_ids": True}


async def test_the_two_stage_flow_carries_the_prefillers_params_to_the_decoder():
    cm, c, network, (p,), (d,) = await nixl_cluster()
    try:
        events = await c.stream("/v1/completions", {**BODY, "stream": True})
        ids = tokenize(PROMPT)
        assert client_tokens(events) == generate(ids, 6)  # the first token once, as one instance
        assert client_text(events) == "".join(token_text(t) for t in generate(ids, 6))
        prefill, = p.calls("/v1/completions")
        assert prefill["kv_transfer_params"] == NIXL_PREFILL_PARAMS
        assert prefill["max_tokens"] == 1 and prefill["stream"] is False and prefill["return_token_ids"] is True
        decode, = d.calls("/v1/completions")
        assert decode["kv_transfer_params"]["remote_engine_id"] == p.engine_id
        assert decode["kv_transfer_params"]["do_remote_prefill"] is True
        assert prefill["prompt"] == PROMPT and decode["prompt"] == ids  # the prefill's prompt: its blocks cover it
        assert decode["max_tokens"] == 6  # it generates the first token again (dropped), then five more
        assert [who for who, _, _ in network.pulls] == [d.name] and not network.failed_pulls
        assert not c.proxy.orchestrator.waiters._waiters  # nothing waits for a KvReady
        assert c.metric("lmcache_p2p_proxy_backend_requests_total", backend=NIXL) == 1
        recent, = (await c.client.get("/stats")).json()["recent"]
        assert recent["backend"] == NIXL and recent["kv_wait"] == 0.0  # ready when the prefill answered
        # non-streaming too, and a sampled request: there the decoder's output is the client's, whole
        answer = (await c.post("/v1/completions", BODY)).json()
        assert answer["choices"][0]["text"] == "".join(token_text(t) for t in generate(ids, 6))
        sampled = (await c.post("/v1/completions", {**BODY, "temperature": 0.7})).json()
        assert sampled["choices"][0]["text"] == "".join(token_text(t) for t in generate(ids, 6))
        assert d.calls("/v1/completions")[-1]["prompt"] == ids and len(network.pulls) == 3
    finally:
        await _close(cm, c)


async def test_a_nixl_instance_is_never_paired_with_one_of_ours():
    cm, c, network, _, (d,) = await nixl_cluster(n_prefill=0, n_decode=1)
    try:
        ours = await c.add_node(Role.SENDER)  # an lmcache_p2p prefiller: announces itself
        for _ in range(3):
            answer = (await c.post("/v1/completions", BODY)).json()
            assert answer["choices"][0]["text"] == "".join(token_text(t) for t in generate(tokenize(PROMPT), 6))
        # no pair: one instance serves each request whole, with no kv_transfer_params of either kind
        assert all(b.get("kv_transfer_params") is None for _, b in ours.vllm.requests + d.requests)
        assert c.metric("lmcache_p2p_proxy_colocated_total", reason="no_compatible_decoder", role="sender") == 3
        assert not network.held and not network.pulls
    finally:
        await _close(cm, c)


@pytest.mark.parametrize("early_decode", [False, True])
async def test_mixed_backends_pair_only_within_each(early_decode):
    """--early-decode changes our pairs' decodes alone: a NixlConnector decode still waits for the prefill's
    answer and carries its pull parameters."""
    cm, c, network, (np_,), (nd,) = await nixl_cluster(early_decode=early_decode)
    try:
        ours_p = await c.add_node(Role.SENDER)
        ours_d = await c.add_node(Role.RECEIVER)
        for fake in (np_, nd, ours_p.vllm, ours_d.vllm):
            fake.token_delay_s = 0.01
        bodies = [{**BODY, "prompt": f"{PROMPT} {i}", "stream": True} for i in range(6)]
        results = await asyncio.gather(*(c.stream("/v1/completions", b) for b in bodies))
        for body, events in zip(bodies, results):
            assert client_tokens(events) == generate(tokenize(body["prompt"]), 6)
        kinds = lambda fake: {next((k for k in ("disagg_spec", MARKER_KEY) if k in kv), "nixl") for kv in  # noqa: E731
                              (b.get("kv_transfer_params") for _, b in fake.requests) if kv}
        assert kinds(np_) == {"nixl"} and kinds(nd) == {"nixl"}
        assert kinds(ours_p.vllm) == {"disagg_spec"}
        assert kinds(ours_d.vllm) == ({MARKER_KEY} if early_decode else set())
        assert c.metric("lmcache_p2p_proxy_backend_requests_total", backend=NIXL) >= 1
        assert c.metric("lmcache_p2p_proxy_backend_requests_total", backend="lmcache_p2p") >= 1
    finally:
        await _close(cm, c)


async def test_a_prefill_that_breaks_is_retried_on_another_nixl_prefiller():
    cm, c, network, prefillers, (d,) = await nixl_cluster(n_prefill=2)
    try:
        network.break_first_prefill = True  # whichever gets the prefill first dies with it in hand
        events = await c.stream("/v1/completions", {**BODY, "stream": True})
        assert client_tokens(events) == generate(tokenize(PROMPT), 6)
        assert sum(len(p.calls("/v1/completions")) for p in prefillers) == 2
        assert c.metric("lmcache_p2p_proxy_failovers_total", phase="prefill") == 1
        (_, pulled, _), = network.pulls
        assert d.calls("/v1/completions")[0]["kv_transfer_params"]["remote_request_id"] == pulled
    finally:
        await _close(cm, c)


async def test_a_decoder_that_dies_mid_stream_continues_on_another_after_a_prefill_of_the_output():
    cm, c, network, (p,), decoders = await nixl_cluster(n_decode=2)
    try:
        network.die_first_stream_after = 3
        n = 10
        events = await c.stream("/v1/completions", {**BODY, "max_tokens": n, "stream": True})
        ids = tokenize(PROMPT)
        assert client_tokens(events) == generate(ids, n)  # nothing twice, nothing missing
        assert client_text(events) == "".join(token_text(t) for t in generate(ids, n))
        first, second = p.calls("/v1/completions")
        assert first["prompt"] == PROMPT
        # the continuation's prefill: the prompt + what the client had (less the last token, generated again
        # without a tokenizer in the proxy: its text may be incomplete, see http/held_text.py)
        k = len(second["prompt"]) - len(ids)
        assert 1 <= k < 3 and second["prompt"] == ids + generate(ids, k)
        assert second["kv_transfer_params"] == NIXL_PREFILL_PARAMS
        dead = next(d for d in decoders if d.die_after is not None)
        alive = next(d for d in decoders if d is not dead)
        decode, = alive.calls("/v1/completions")
        assert decode["prompt"] == second["prompt"] and decode["max_tokens"] == n - k
        assert decode["kv_transfer_params"]["remote_request_id"] == network.pulls[-1][1]
        assert [who for who, _, _ in network.pulls] == [dead.name, alive.name] and not network.failed_pulls
        assert c.metric("lmcache_p2p_proxy_failovers_total", phase="migrate") == 1
        parts = (await c.client.get("/stats")).json()["recent_decodes"][0]["parts"]
        assert [part["from_token"] for part in parts] == [1, k]
    finally:
        await _close(cm, c)


async def test_with_the_proxys_tokenizer_the_first_token_is_dropped_once_and_a_migration_rewinds_nothing(
        tokenizer_dir):
    path, hf = tokenizer_dir
    cm, c, network, (p,), decoders = await nixl_cluster(n_decode=2, tokenizer=str(path))
    try:
        await eventually(lambda: c.proxy.orchestrator.tokenizers.settled)
        cycle = hf.encode(" the sea is wide", add_special_tokens=False)

        def model(ids: list[int]) -> int:  # ASCII text, so that every token's text is whole
            return cycle[(cycle.index(ids[-1]) + 1) % len(cycle)] if ids[-1] in cycle else cycle[0]

        for fake in (p, *decoders):
            fake.model, fake.text_of = model, hf.decode
        network.die_first_stream_after = 4
        n = 12
        events = await c.stream("/v1/completions", {**BODY, "max_tokens": n, "stream": True})
        ids = hf.encode(PROMPT)
        tokens: list[int] = []
        while len(tokens) < n:
            tokens.append(model(ids + tokens))
        assert client_tokens(events) == tokens and client_text(events) == hf.decode(tokens)
        first, second = p.calls("/v1/completions")
        assert first["prompt"] == ids  # the proxy's ids
        # the client had the first token and three more the dying decoder sent after its replayed first one
        assert second["prompt"] == ids + tokens[:4]
        alive = next(d for d in decoders if d.die_after is None)
        decode, = alive.calls("/v1/completions")
        assert decode["prompt"] == ids + tokens[:4] and decode["max_tokens"] == n - 4
        assert "stop" not in decode
    finally:
        await _close(cm, c)


async def test_a_decoder_that_cannot_pull_continues_elsewhere():
    cm, c, network, (p,), decoders = await nixl_cluster(n_decode=2)
    try:
        real_keep = network.keep

        def lose_first(engine: str, ids: list[int], request_id: str) -> str:  # gone before the pull
            network.keep = real_keep  # type: ignore[method-assign]
            return real_keep(engine, ids, request_id) + "-lost"

        network.keep = lose_first  # type: ignore[method-assign]
        events = await c.stream("/v1/completions", {**BODY, "stream": True})
        ids = tokenize(PROMPT)
        # vLLM fails the decode whose pull failed (an error event before any output); the proxy prefills again
        # and another decoder pulls that (the prompt alone: without a tokenizer the proxy has the last token the
        # client got generated again, http/held_text.py, and drops it from the stream)
        assert client_tokens(events) == generate(ids, 6)
        (failed_on, why), = network.failed_pulls
        (pulled_by, _, pulled_prompt), = network.pulls
        assert failed_on != pulled_by and "no such blocks" in why
        assert pulled_prompt == ids
        assert len(p.calls("/v1/completions")) == 2
    finally:
        await _close(cm, c)


@pytest.mark.parametrize("hang", ["hang_first_pull", "hang_first_pull_headers"])
async def test_a_pull_that_hangs_moves_the_decode_after_the_kv_timeout(hang):
    """The decoder holds the decode's first event, or its response headers too, while its pull stalls."""
    # --kv-timeout-s also bounds the first event of the decode that moves on: no shorter than a loaded machine's step
    cm, c, network, (p,), decoders = await nixl_cluster(n_decode=2, kv_timeout_s=3.0, decode_idle_timeout_s=60.0)
    try:
        setattr(network, hang, True)
        started = time.monotonic()
        events = await c.stream("/v1/completions", {**BODY, "stream": True})
        assert time.monotonic() - started < 30.0  # --kv-timeout-s, not --decode-idle-timeout-s
        assert client_tokens(events) == generate(tokenize(PROMPT), 6)
        hung = next(d for d in decoders if d.calls("/v1/completions") and d.name not in [w for w, _, _ in network.pulls])
        assert len(hung.calls("/v1/completions")) == 1 and len(network.pulls) == 1
        assert len(p.calls("/v1/completions")) == 2  # the continuation was prefilled again for the other decoder
        assert c.metric("lmcache_p2p_proxy_failovers_total", phase="migrate") == 1
    finally:
        await _close(cm, c)


@pytest.mark.parametrize("workers", [1, 2])  # 2: the decode's X-Request-Id crosses the relay to its worker
async def test_a_push_connector_decode_gets_the_kv_its_own_prefill_wrote(workers):
    # NixlPushConnector pairs a prefill and its decode by vLLM's request id: they must carry one X-Request-Id
    # (the cluster's --kv-timeout-s bounds each decode's first event; a push that never came is in unmatched_pushes)
    cm, c, network, (p,), (d,) = await nixl_cluster(decode_idle_timeout_s=30.0, workers=workers)
    network.push = True
    try:
        ids = tokenize(PROMPT)
        events = await c.stream("/v1/completions", {**BODY, "stream": True})
        answer = (await c.post("/v1/completions", BODY)).json()
        assert client_tokens(events) == generate(ids, 6)
        assert answer["choices"][0]["text"] == "".join(token_text(t) for t in generate(ids, 6))
        assert not network.unmatched_pushes  # no decode waited out --kv-timeout-s for a push that never came
        assert [prompt for who, _, prompt in network.pulls] == [ids, ids] and {w for w, _, _ in network.pulls} == {d.name}
        assert c.metric("lmcache_p2p_proxy_failovers_total", phase="migrate") == 0
        assert len(p.calls("/v1/completions")) == 2 and len(d.calls("/v1/completions")) == 2
    finally:
        await _close(cm, c)


async def test_a_chat_prefill_on_a_push_pair_is_retried_as_a_completion_its_decode_pairs_with():
    # a chat prefill's vLLM id (chatcmpl-...) never pairs with the decode's (cmpl-...): waiting for that push
    # would cost --kv-timeout-s (the cluster's bounds the retry's first event too), so the KV counts as failed at once
    # and the retry prefills the prompt ids
    cm, c, network, (p,), (d,) = await nixl_cluster(decode_idle_timeout_s=30.0)
    network.push = True
    try:
        ids = tokenize(chat_prompt(MESSAGES))
        answer = (await c.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 5,
                                                        "temperature": 0, "return_token_ids": True})).json()
        assert answer["choices"][0]["token_ids"] == generate(ids, 5)
        assert len(p.calls("/v1/chat/completions")) == 1
        retry, = p.calls("/v1/completions")
        assert retry["prompt"] == ids and retry["kv_transfer_params"] == NIXL_PREFILL_PARAMS
        assert not network.unmatched_pushes and [prompt for _, _, prompt in network.pulls] == [ids]
        assert c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="failed") == 1
        assert c.metric("lmcache_p2p_proxy_failovers_total", phase="migrate") == 0
    finally:
        await _close(cm, c)


async def test_once_a_prefiller_is_known_to_push_its_chat_prefills_go_as_completions_of_the_prompt_ids():
    # the first chat prefill teaches the proxy that the prefiller pushes (transfer_mode in its answer); from then
    # on a chat prefill is one /v1/completions of the ids its /tokenize renders, named like its decode: no
    # prefill twice, no KV failure
    cm, c, network, (p,), (d,) = await nixl_cluster(decode_idle_timeout_s=30.0)
    network.push = True
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "temperature": 0, "return_token_ids": True}
    try:
        ids = tokenize(chat_prompt(MESSAGES))
        await c.post("/v1/chat/completions", chat)  # learns: one chat prefill, its retry as a completion
        assert len(p.calls("/v1/chat/completions")) == 1 and len(p.calls("/v1/completions")) == 1
        answer = (await c.post("/v1/chat/completions", chat)).json()
        events = await c.stream("/v1/chat/completions", {**chat, "stream": True})
        assert answer["choices"][0]["token_ids"] == generate(ids, 5)
        assert answer["choices"][0]["message"]["content"] == "".join(token_text(t) for t in generate(ids, 5))
        assert client_tokens(events) == generate(ids, 5)
        assert len(p.calls("/v1/chat/completions")) == 1  # none since it was learnt
        learnt = p.calls("/v1/completions")[1:]
        assert [b["prompt"] for b in learnt] == [ids, ids] and all(b["max_tokens"] == 1 for b in learnt)
        assert all(b["kv_transfer_params"] == NIXL_PREFILL_PARAMS and b["temperature"] == 0 for b in learnt)
        assert len(p.calls("/tokenize")) == 2  # vLLM renders the chat template: the ids its chat endpoint uses
        assert c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="failed") == 1  # the first request's alone
        assert not network.unmatched_pushes and [prompt for _, _, prompt in network.pulls] == [ids, ids, ids]
        # with tools vLLM's chat endpoint may render the prompt unlike its /tokenize: the chat prefill again,
        # and its KV retried from the ids that prefill answered with
        tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        answer = (await c.post("/v1/chat/completions", {**chat, "tools": tools, "tool_choice": "none"})).json()
        assert answer["choices"][0]["token_ids"] == generate(ids, 5)
        assert len(p.calls("/v1/chat/completions")) == 2 and len(p.calls("/tokenize")) == 2
        assert c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="failed") == 2
    finally:
        await _close(cm, c)


@pytest.mark.parametrize("push", [False, True])
async def test_a_chat_the_decoder_renders_takes_the_prefills_kv_on_its_chat_endpoint(push):
    # tools with tool_choice auto: the decoder's tool parser makes the answer, so the decode is a chat prompted with
    # the prefill's ids (kv_transfer_params.prompt_token_ids beside the pull's): it pulls the blocks of exactly
    # that prompt, and a push prefill (chatcmpl-) pairs with it (chatcmpl-), so no KV fails
    cm, c, network, (p,), (d,) = await nixl_cluster(decode_idle_timeout_s=30.0)
    network.push = push
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    chat = {"model": MODEL, "messages": MESSAGES, "tools": tools, "max_tokens": 5, "temperature": 0}
    try:
        ids = tokenize(chat_prompt(MESSAGES))
        for _ in range(2):  # the second after a push prefiller is known as one
            answer = (await c.post("/v1/chat/completions", chat)).json()
            call, = answer["choices"][0]["message"]["tool_calls"]
            assert call["function"]["arguments"] == "".join(token_text(t) for t in generate(ids, 5))
        assert len(p.calls("/v1/chat/completions")) == 2 and not p.calls("/v1/completions")
        decodes = d.calls("/v1/chat/completions")
        assert [b["kv_transfer_params"]["prompt_token_ids"] for b in decodes] == [ids, ids]
        assert all(b["kv_transfer_params"]["do_remote_prefill"] for b in decodes) and not d.calls("/v1/completions")
        assert not network.unmatched_pushes and [prompt for _, _, prompt in network.pulls] == [ids, ids]
        assert c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="failed") == 0
    finally:
        await _close(cm, c)


async def test_join_and_drain_live():
    cm, c, network, _, _ = await nixl_cluster(n_prefill=0, n_decode=0)
    try:
        p = await add_nixl(c, network, "prefiller")
        d = await add_nixl(c, network, "decoder")
        again = await c.post("/instances/register", {"role": "decoder", "url": d.url, "backend": NIXL})
        assert again.status_code == 200 and len(c.proxy.registry.instances()) == 2  # idempotent
        await c.stream("/v1/completions", {**BODY, "stream": True})
        assert len(network.pulls) == 1
        listed = (await c.client.get("/instances")).json()
        decoder_id = next(i["instance_id"] for i in listed if i["role"] == "receiver")
        assert (await c.post("/instances/drain", {"instance_id": decoder_id})).status_code == 200
        assert all(i.http_url != d.url for i in c.proxy.registry.instances())  # idle: forgotten at once
        answer = (await c.post("/v1/completions", BODY)).json()  # no decoder: the prefiller serves it whole
        assert answer["choices"][0]["text"] == "".join(token_text(t) for t in generate(tokenize(PROMPT), 6))
        assert len(network.pulls) == 1 and d.calls("/v1/completions") == [d.calls("/v1/completions")[0]]
        back = await c.post("/instances/register", {"role": "decoder", "url": d.url, "backend": NIXL})
        assert back.status_code == 200
        await eventually(lambda: routable(c, d.url))
        await c.stream("/v1/completions", {**BODY, "stream": True})
        assert len(network.pulls) == 2
    finally:
        await _close(cm, c)


@pytest.mark.parametrize("body, message", [
    ({"role": "decoder", "url": "http://127.0.0.1:1", "backend": "lmcache_p2p"}, "register themselves"),
    ({"role": "router", "url": "http://127.0.0.1:1"}, "prefiller or decoder"),
    ({"role": "decoder", "url": "127.0.0.1:1"}, "http(s) URL"),
    ({"url": "http://127.0.0.1:1"}, "JSON object"),
])
async def test_register_refuses_what_it_cannot_drive(body, message):
    async with make_cluster(0, 0) as c:
        resp = await c.post("/instances/register", body)
        assert resp.status_code == 400 and message in resp.json()["error"]["message"]
        assert c.proxy.registry.instances() == []


@pytest.mark.parametrize("ttl_s", [0, -5, "30", True])
async def test_register_refuses_a_ttl_that_is_not_a_positive_number(ttl_s):
    async with make_cluster(0, 0) as c:
        resp = await c.post("/instances/register", {"role": "decoder", "url": "http://127.0.0.1:1", "ttl_s": ttl_s})
        assert resp.status_code == 400
        assert resp.json()["error"]["message"].startswith("ttl_s: must be a positive number of seconds")
        assert c.proxy.registry.instances() == []


async def test_a_registration_not_renewed_within_its_ttl_drains_out_without_any_request():
    """The sweep every --instance-ttl-s / 4 finds it: no request has to come."""
    cm, c, network, _, _ = await nixl_cluster(n_prefill=0, n_decode=0, instance_ttl_s=0.2)
    try:
        d = await add_nixl(c, network, "decoder")  # registered without a ttl_s: it stays
        resp = await c.post("/instances/register", {"role": "decoder", "url": "http://127.0.0.1:1", "backend": NIXL,
                                                    "ttl_s": 2})
        assert resp.status_code == 200 and resp.json()["ttl_s"] == 2
        inst = next(i for i in c.proxy.registry.instances() if i.http_url == "http://127.0.0.1:1")
        lease = c.proxy.registry.lease(inst, tokens=1)  # a request still in flight on it
        listed = {i["http_url"]: i for i in (await c.client.get("/instances", params={"all": "1"})).json()}
        assert (listed[inst.http_url]["ttl_s"], listed[d.url]["ttl_s"]) == (2, None)
        await eventually(lambda: inst.state is InstanceState.DRAINING)  # not registered again: no new work ...
        listed = {i["http_url"]: i for i in (await c.client.get("/instances", params={"all": "1"})).json()}
        assert listed[inst.http_url]["state"] == "draining"  # ... listed while its request finishes
        assert [i["http_url"] for i in (await c.client.get("/instances")).json()] == [d.url]
        assert c.metric("lmcache_p2p_proxy_instances", role="receiver", state="draining") == 1
        lease.release()
        assert [i.http_url for i in c.proxy.registry.instances()] == [d.url]
        assert c.metric("lmcache_p2p_proxy_instances", role="receiver", state="draining") == 0
        assert c.metric("lmcache_p2p_proxy_instances", role="receiver", state="active") == 1
    finally:
        await _close(cm, c)


async def test_a_dead_nixl_instance_leaves_rotation_through_its_metrics_poll():
    cm, c, network, (p,), (d,) = await nixl_cluster(max_connect_failures=2)
    try:
        await d.server.stop()  # killed: its port refuses connections
        await eventually(lambda: not routable(c, d.url))
        await d.server.start()  # restarted on the same port: back once GET /health answers
        await eventually(lambda: routable(c, d.url))
    finally:
        await _close(cm, c)


async def test_a_slow_or_failing_metrics_answer_does_not_take_an_instance_out():
    # the probe's 1 s also bounds each poll's connect: a loaded machine's connect stays well inside it
    cm, c, network, (p,), (d,) = await nixl_cluster(max_connect_failures=2, health_probe_timeout_s=1.0)
    try:
        decoder = next(i for i in c.proxy.registry.instances() if i.http_url == d.url)
        await eventually(lambda: decoder.capacity_slots == 64)
        taken_out: list[str] = []
        c.proxy.registry.on_pending.append(lambda inst: taken_out.append(inst.instance_id))
        d.metrics_delay_s = 3.0  # a busy engine's API server answers later than the poll waits
        asked = d.metrics_asked
        await eventually(lambda: d.metrics_asked >= asked + 3, timeout_s=30)  # two polls timed out, a third asks
        d.metrics_delay_s, d.metrics_status = 0.0, 500
        asked = d.metrics_asked
        await eventually(lambda: d.metrics_asked >= asked + 3, timeout_s=30)  # and polls answered 500
        assert taken_out == [] and decoder.connect_failures == 0  # never out of rotation, not even briefly
        assert routable(c, d.url) and decoder.capacity_slots == 64  # the last reading stands
        events = await c.stream("/v1/completions", {**BODY, "stream": True})
        assert client_tokens(events) == generate(tokenize(PROMPT), 6) and len(network.pulls) == 1
    finally:
        await _close(cm, c)


async def test_admission_waits_for_free_blocks_in_the_decoders_metrics():
    cm, c, network, (p,), (d,) = await nixl_cluster(admission_timeout_s=10.0)
    try:
        d.blocks, d.block_size, d.usage = 10, 16, 0.9  # 1 free block of 16 tokens
        decoder = next(i for i in c.proxy.registry.instances() if i.http_url == d.url)
        await eventually(lambda: decoder.free_slots() == 1 and decoder.capacity_slots == 10)
        prompt = [7] * 41  # 3 blocks
        task = asyncio.create_task(c.stream("/v1/completions", {**BODY, "prompt": prompt, "stream": True}))
        await eventually(lambda: c.proxy.orchestrator.admission.__len__() == 1)
        assert not p.calls("/v1/completions")  # waiting for credit, nothing sent
        d.usage = 0.0
        events = await task
        assert client_tokens(events) == generate(prompt, 6)
        assert len(network.pulls) == 1  # disaggregated once the blocks were free
        assert c.metric("lmcache_p2p_proxy_admission_total", outcome="admitted") == 1
    finally:
        await _close(cm, c)
