"""``--early-decode``: an lmcache_p2p pair's decode goes out when the prefill answered, carrying the marker the
decoder holds it by until its KV arrived, while the proxy's KV wait runs beside it. In one process and with
relay workers (``--workers 2``): the fake decoder parks a marked decode until its agent reported the KV
(``FakeAgent.parked``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from lmcache_p2p.protocol import KvFailCause, KvFailed
from lmcache_p2p.vllm_plugin.router_addressing import MARKER_KEY, marker_of

from ..conftest import eventually, make_cluster
from ..fakes import MODEL, PROMPT, FakeAgent, expected_text, generate, tokenize
from .test_flow import assert_idle

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

N = 6
IDS = tokenize(PROMPT)


@pytest.fixture(params=[1, 2], ids=["one-process", "relay-workers"])
def workers(request) -> int:
    return request.param


def early(workers: int, **settings: Any) -> Any:
    return make_cluster(early_decode=True, workers=workers, **settings)


def decodes(node) -> list[dict[str, Any]]:
    """The decode requests an instance got (a prefill carries a disagg_spec)."""
    return [b for b in node.vllm.calls("/v1/completions")
            if "disagg_spec" not in (b.get("kv_transfer_params") or {})]


def streamed_ids(events: list[Any]) -> list[int]:
    return [t for e in events[:-1] if e["choices"] for t in e["choices"][0]["token_ids"]]


def early_count(c, first: str) -> float:
    return c.metric("lmcache_p2p_proxy_early_decodes_total", first=first)


async def test_the_decode_goes_before_the_kv_is_ready_carrying_the_marker_and_outputs_as_one_instance(workers):
    async with early(workers) as c:
        decoder = c.decoders[0]
        decoder.agent.kv_mode = "silent"  # reported below, once the decode is parked on the decoder
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": N, "stream": True, "return_token_ids": True}
        request = asyncio.ensure_future(c.stream("/v1/completions", body))
        await eventually(lambda: decodes(decoder))  # on the decoder, its KV not ready
        req_id = c.network.specs[-1]["req_id"]
        await asyncio.sleep(0.1)
        assert not request.done()  # held by the decoder while its KV is missing
        inst, = [i for i in c.proxy.registry.instances() if i.instance_id == decoder.agent.instance_id]
        assert inst.free_slots() < decoder.agent.capacity_slots  # its KV's credit is held, as for a later decode
        await decoder.agent.report_ready(req_id)
        events = await request
        assert events[-1] == "[DONE]" and streamed_ids(events) == generate(IDS, N)
        decode, = decodes(decoder)
        assert decode["prompt"] == IDS + generate(IDS, 1) and decode["max_tokens"] == N - 1
        assert decode["kv_transfer_params"] == {MARKER_KEY: {"req_id": req_id, "prompt_tokens": len(IDS)}}
        marker = marker_of(decode["kv_transfer_params"], "cmpl-x")  # what the decoder's plugin reads of it
        assert marker is not None and (marker.key, marker.prompt_tokens) == (req_id, len(IDS))
        assert early_count(c, "kv_ready") == 1
        assert c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="ready") == 1
        recent, = (await c.client.get("/stats")).json()["recent"]
        assert recent["decode_start"] < recent["kv_wait"]  # sent before the KV was ready
        assert recent["kv_after_decode"] >= 100 and recent["kv_wait"] >= recent["kv_after_decode"]
        assert inst.free_slots() == decoder.agent.capacity_slots  # returned at the first output
        if workers > 1:  # the KV's outcome came on open's answer: no call of its own
            calls = c.proxy.coordinator.calls
            await eventually(lambda: calls["closed"] == 1)
            steps = {step: n for step, n in calls.items() if step not in ("hello", "tokenizer")}  # workers' own
            assert steps == {"open": 1, "started": 1, "closed": 1}
        assert_idle(c)


async def test_a_non_streamed_early_decode_answers_as_one_instance(workers):
    async with early(workers) as c:
        c.decoders[0].agent.kv_delay_s = 0.1
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": N})
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == expected_text(IDS, N)
        assert MARKER_KEY in decodes(c.decoders[0])[0]["kv_transfer_params"]
        if workers > 1:  # a worker tells the coordinator that a non-streamed answer closed after the client has it
            await eventually(lambda: len(c.proxy.coordinator) == 0)
        assert_idle(c)


def fail_when_parked(node, cause: KvFailCause = KvFailCause.UNKNOWN) -> None:
    """The decoder's KV fails once its early decode is parked there (nothing else is reported)."""
    agent = node.agent
    agent.kv_mode = "silent"

    async def park(marker: dict[str, Any]) -> None:
        await agent.send(KvFailed(req_id=marker["req_id"], instance_id=agent.instance_id, tp_rank=0,
                                  reason="the prefiller's write failed", cause=cause))
        await agent.parked(marker)

    node.vllm.kv_park = park


def _cut_first_decoder(c) -> list[FakeAgent]:
    """The first decoder a prefill sends KV to fails it (its prefiller cannot reach it) once the early decode is
    parked there."""
    cut: list[FakeAgent] = []

    async def deliver(spec):
        node = next(n for n in c.decoders if n.agent.control_port(0) == spec["receiver_alloc_port"][0])
        if not cut:
            cut.append(node.agent)
            fail_when_parked(node, KvFailCause.UNREACHABLE)
        await c.network.deliver(spec)

    for node in c.prefillers:
        node.vllm.kv_sink = deliver
    return cut


@pytest.mark.timeout(30)
async def test_a_kv_failure_before_the_first_output_closes_the_early_decode_and_retries_on_another_decoder(workers):
    async with early(workers, n_decode=2, kv_timeout_s=60.0) as c:  # a failover that waits for the timeout fails
        cut = _cut_first_decoder(c)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": N, "stream": True, "return_token_ids": True}
        events = await c.stream("/v1/completions", body)
        assert streamed_ids(events) == generate(IDS, N)  # every token once, in order
        text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
        assert text == expected_text(IDS, N)
        given_up, = [n for n in c.decoders if n.agent is cut[0]]
        served, = [n for n in c.decoders if n.agent is not cut[0]]
        early_decode, = decodes(given_up)
        assert MARKER_KEY in early_decode["kv_transfer_params"]
        await eventually(lambda: given_up.vllm.cancelled_streams == 1)  # closed: vLLM aborts the request
        assert given_up.vllm.finished_streams == 0
        retried, = decodes(served)
        assert retried["prompt"] == IDS + generate(IDS, 1) and "kv_transfer_params" not in retried
        prefill, again = c.prefillers[0].vllm.calls("/v1/completions")  # the prompt's prefiller, towards the other
        assert again["kv_transfer_params"]["disagg_spec"]["receiver_alloc_port"] == [served.agent.control_port(0)]
        assert early_count(c, "kv_failed") == 1
        assert c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="failed") == 1
        assert c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="ready") == 1
        decodes_record = (await c.client.get("/stats")).json()["recent_decodes"]
        assert [r["parts"] for r in decodes_record] == [[{"instance": served.agent.instance_id, "from_token": 1}]]
        assert_idle(c)


@pytest.mark.timeout(30)
async def test_with_on_kv_failure_fail_an_early_decode_whose_kv_failed_is_closed_and_answered_502(workers):
    async with early(workers, on_kv_failure="fail", kv_timeout_s=60.0) as c:
        decoder = c.decoders[0]
        fail_when_parked(decoder)
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": N})
        assert resp.status_code == 502 and "--on-kv-failure=fail" in resp.json()["error"]["message"]
        assert len(decodes(decoder)) == 1
        await eventually(lambda: decoder.vllm.cancelled_streams == 1)
        assert early_count(c, "kv_failed") == 1
        await eventually(lambda: len(c.proxy.waiters) == 0)
        assert_idle(c)


async def test_a_first_output_before_the_kv_is_ready_takes_the_handover(workers):
    """The decoder's wait for the KV ran out (it computed what it lacked): its output comes before the KvReady,
    the handover is taken as usual and the KV's outcome, arriving while it decodes, still counts."""
    async with early(workers) as c:
        decoder = c.decoders[0]
        decoder.vllm.kv_park = None  # it does not hold the decode
        decoder.vllm.token_delay_s = 0.2
        decoder.agent.kv_mode = "silent"  # reported below, once the proxy saw the first output
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": N, "stream": True, "return_token_ids": True}
        request = asyncio.ensure_future(c.stream("/v1/completions", body))
        await eventually(lambda: early_count(c, "decode_first") == 1)
        await decoder.agent.report_ready(c.network.specs[-1]["req_id"])
        events = await request
        assert streamed_ids(events) == generate(IDS, N)
        assert early_count(c, "kv_ready") == 0 and early_count(c, "kv_failed") == 0
        assert c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="ready") == 1  # the wait ran on beside it
        assert decoder.vllm.finished_streams == 1
        assert_idle(c)


async def test_a_decoder_that_refuses_an_early_decode_leaves_it_to_another_without_the_marker(workers):
    async with early(workers, n_decode=2) as c:
        dead, alive = c.decoders
        await dead.vllm.server.stop()  # the registry still routes to it
        for _ in range(10):
            resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": N})
            assert resp.json()["choices"][0]["text"] == expected_text(IDS, N)
            if dead.agent.kv_requests:
                break
        assert dead.agent.kv_requests  # a request's KV went to the dead decoder: its early decode was refused
        marked = [d for d in decodes(alive) if MARKER_KEY in (d.get("kv_transfer_params") or {})]
        assert [d["kv_transfer_params"][MARKER_KEY]["req_id"] for d in marked] == alive.agent.kv_requests
        recomputed = [d for d in decodes(alive) if "kv_transfer_params" not in d]
        assert len(recomputed) == len(dead.agent.kv_requests)  # its KV stays where it went: never awaited here
        assert c.metric("lmcache_p2p_proxy_failovers_total", phase="decode") == len(dead.agent.kv_requests)
        await eventually(lambda: len(c.proxy.waiters) == 0)
        assert_idle(c)


async def test_a_client_that_leaves_while_its_early_decode_waits_for_the_kv_releases_everything(workers):
    async with early(workers) as c:
        decoder = c.decoders[0]
        decoder.agent.kv_mode = "silent"  # the KV never comes: the decode stays parked
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": N, "stream": True}
        async with c.client.stream("POST", "/v1/completions", json=body) as resp:
            chunks = resp.aiter_raw()
            assert (await anext(chunks)).startswith(b"data: ")  # the first token came
            await eventually(lambda: decodes(decoder))  # the decode is parked on the decoder
        # the client's connection is closed
        await eventually(lambda: decoder.vllm.cancelled_streams == 1)  # the proxy closed the decode
        await eventually(lambda: len(c.proxy.waiters) == 0 and all(
            i.inflight_requests == 0 for i in c.proxy.registry.instances()))
        assert_idle(c)


async def test_without_the_flag_the_decode_waits_for_the_kv_and_carries_no_marker(workers):
    async with make_cluster(workers=workers) as c:
        decoder = c.decoders[0]
        decoder.agent.kv_delay_s = 0.2
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": N})
        assert resp.json()["choices"][0]["text"] == expected_text(IDS, N)
        decode, = decodes(decoder)
        assert "kv_transfer_params" not in decode
        assert early_count(c, "kv_ready") == 0
