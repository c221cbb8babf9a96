"""Health gating: instances take traffic only while their HTTP server answers; failed connections move on."""

from __future__ import annotations

import pytest

from lmcache_p2p.config import Role
from lmcache_p2p.proxy.router.registry import Health, Instance

from ..conftest import Cluster, Node, eventually, make_cluster
from ..fakes import MODEL, generate, token_text, tokenize

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

PROMPT = "hello world"
EXPECTED = "".join(token_text(t) for t in generate(tokenize(PROMPT), 4))


def instance(c: Cluster, node: Node) -> Instance:
    inst, = [i for i in c.proxy.registry.instances() if i.instance_id == node.agent.instance_id]
    return inst


async def complete_ok(c: Cluster, n: int) -> None:
    for _ in range(n):
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == EXPECTED


async def test_an_instance_whose_http_server_starts_late_gets_traffic_only_once_up():
    async with make_cluster() as c:
        late = await c.add_node(Role.RECEIVER, serve_http=False)  # announced; vLLM still loading
        await eventually(lambda: c.metric("lmcache_p2p_proxy_instances", role="receiver", state="pending") == 1)
        assert instance(c, late).health is Health.PENDING
        assert (await c.client.get("/health")).json()["decoders"] == 1
        listed = (await c.client.get("/instances")).json()
        assert late.agent.instance_id not in {i["instance_id"] for i in listed}
        await complete_ok(c, 4)
        assert not late.agent.kv_requests  # no KV, no request went its way

        await late.vllm.server.start()
        await eventually(lambda: instance(c, late).routable)
        assert (await c.client.get("/health")).json()["decoders"] == 2
        await complete_ok(c, 4)
        assert late.agent.kv_requests and late.vllm.calls("/v1/completions")
        assert c.metric("lmcache_p2p_proxy_connect_failures_total", role="receiver") == 0


async def test_a_decoder_whose_server_dies_is_taken_out_and_its_requests_decode_elsewhere():
    async with make_cluster(n_decode=2) as c:
        dead, alive = c.decoders
        await dead.vllm.server.stop()
        for _ in range(10):  # no client error while the proxy finds out
            await complete_ok(c, 1)
            if not instance(c, dead).routable:
                break
        assert instance(c, dead).health is Health.DOWN
        assert (await c.client.get("/health")).json()["decoders"] == 1
        assert c.metric("lmcache_p2p_proxy_connect_failures_total", role="receiver") == 2  # --max-connect-failures
        assert c.metric("lmcache_p2p_proxy_failovers_total", phase="decode") == 2
        assert len(dead.agent.kv_requests) == 2  # its KV was abandoned (cancelled) and recomputed on the other
        # a refused decode served nothing: the record names only the decoder that did
        decodes = (await c.client.get("/stats")).json()["recent_decodes"]
        assert [r["parts"] for r in decodes] == [[{"instance": alive.agent.instance_id, "from_token": 1}]] * len(decodes)
        # 2 abandoned on the dead one, and one free after the first token of every other decode that took KV
        ready = c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="ready")
        assert c.metric("lmcache_p2p_proxy_kv_cancels_total", result="sent") == ready
        served = len(alive.vllm.calls("/v1/completions"))
        await complete_ok(c, 3)
        assert len(alive.vllm.calls("/v1/completions")) == served + 3 and len(dead.agent.kv_requests) == 2

        await dead.vllm.server.start()  # back on the same port: a probe puts it back in rotation
        await eventually(lambda: instance(c, dead).routable)
        await complete_ok(c, 2)
        assert dead.vllm.calls("/v1/completions")


async def test_a_prefiller_whose_server_dies_is_taken_out_and_its_requests_prefill_elsewhere():
    async with make_cluster(n_prefill=2) as c:
        dead, alive = c.prefillers
        await dead.vllm.server.stop()
        await complete_ok(c, 4)
        assert instance(c, dead).health is Health.DOWN and instance(c, alive).routable
        assert c.metric("lmcache_p2p_proxy_failovers_total", phase="prefill") == 2
        # The KV came from the prefiller that answered, under the req_id the dead one never received.
        assert c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="ready") == 4
        # nothing abandoned; each decode frees what is left of its KV after its first token
        assert c.metric("lmcache_p2p_proxy_kv_cancels_total", result="sent") == 4


async def test_every_prefiller_unreachable_leaves_the_prompt_to_the_decoder():
    async with make_cluster() as c:
        await c.prefillers[0].vllm.server.stop()
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        assert resp.json()["choices"][0]["text"] == EXPECTED
        assert c.metric("lmcache_p2p_proxy_colocated_total", reason="no_prefiller", role="receiver") == 1
        assert c.metric("lmcache_p2p_proxy_kv_cancels_total", result="sent") == 0  # no KV can be on its way
        assert len(c.proxy.waiters) == 0
