"""The handover path does not wait for the client: the decode request goes out while the first token is
still being written (a client that does not read), in one process and in a relay worker; a worker
makes few calls to its coordinator per request."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import pytest

from lmcache_p2p.protocol import KvFailCause
from lmcache_p2p.proxy.relay.link import CoordinatorLink
from lmcache_p2p.proxy.relay.tokenizers import Tokenizers
from lmcache_p2p.proxy.relay.worker import WorkerApp
from lmcache_p2p.proxy.upstream import Upstream

from ..conftest import eventually, make_cluster
from ..fakes import MODEL, PROMPT, FakeAgent, expected_text, generate, tokenize
from .test_flow import assert_idle

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

BODY = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "stream": True}


class StalledClient:
    """An ASGI client whose connection takes the response's head, then stalls on its first body bytes (a
    client that does not read: its socket buffers are full) until ``resume()``."""

    def __init__(self, body: dict[str, Any]) -> None:
        self._body = json.dumps(body).encode()
        self._request_sent = False
        self._resume = asyncio.Event()
        self._gone = asyncio.Event()
        self.stalled = asyncio.Event()
        self.chunks: list[bytes] = []

    def scope(self, path: str) -> dict[str, Any]:
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
                "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                "root_path": "", "headers": [(b"content-type", b"application/json")],
                "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000)}

    async def receive(self) -> dict[str, Any]:
        if not self._request_sent:
            self._request_sent = True
            return {"type": "http.request", "body": self._body, "more_body": False}
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            if not self.stalled.is_set():
                self.stalled.set()
                await self._resume.wait()
            self.chunks.append(message["body"])

    def resume(self) -> None:
        self._resume.set()

    def text(self) -> str:
        out = []
        for line in b"".join(self.chunks).decode().splitlines():
            if line.startswith("data: {"):
                out.append(json.loads(line[6:])["choices"][0]["text"])
        return "".join(out)


async def _decode_sent_while_stalled(app: Any, decoder_calls: Any) -> str:
    client = StalledClient(BODY)
    served = asyncio.ensure_future(app(client.scope("/v1/completions"), client.receive, client.send))
    try:
        await asyncio.wait_for(client.stalled.wait(), timeout=10)
        # The client has not taken the first token yet; the decoder already has its decode request.
        await eventually(lambda: len(decoder_calls()) == 1)
        assert not client.chunks
        client.resume()
        await asyncio.wait_for(served, timeout=10)
    finally:
        served.cancel()
    return client.text()


async def test_the_decode_request_goes_out_while_a_stalled_client_has_not_taken_the_first_token():
    async with make_cluster() as c:
        decoder = c.decoders[0].vllm
        text = await _decode_sent_while_stalled(c.proxy.app, lambda: decoder.calls("/v1/completions"))
        assert text == expected_text(tokenize(PROMPT), 6)
        decode = decoder.calls("/v1/completions")[0]
        assert decode["prompt"][:-1] == tokenize(PROMPT)  # prompt ids + the first token: the whole KV is used


async def test_a_relay_worker_sends_the_decode_while_a_stalled_client_has_not_taken_the_first_token():
    async with make_cluster(workers=2) as c:
        decoder = c.decoders[0].vllm
        uds = os.path.join(c.proxy._relay_dir, "coordinator.sock")
        link = CoordinatorLink(uds, 7, timeout_s=10.0, tokenizers=Tokenizers(load_timeout_s=10.0))  # a worker of this process, next to the proxy's two
        upstream = Upstream(connect_timeout_s=2.0)
        worker = WorkerApp(link, upstream, chars_per_token=4.0)
        try:
            text = await _decode_sent_while_stalled(worker.build(), lambda: decoder.calls("/v1/completions"))
        finally:
            await link.aclose()
            await upstream.aclose()
        assert text == expected_text(tokenize(PROMPT), 6)
        await eventually(lambda: len(c.proxy.coordinator) == 0)  # closed on the coordinator


async def test_a_relayed_request_takes_three_calls_on_the_coordinator_and_is_counted():
    async with make_cluster(workers=2) as c:
        n = 6
        for i in range(n):
            body = {**BODY, "stream": i % 2 == 0}
            if body["stream"]:
                events = await c.stream("/v1/completions", body)
                assert events[-1] == "[DONE]"
            else:
                assert (await c.post("/v1/completions", body)).status_code == 200
        bad = await c.client.post("/v1/completions", content=b"{not json")
        assert bad.status_code == 400
        await eventually(lambda: c.proxy.coordinator.calls["closed"] == n)
        calls = c.proxy.coordinator.calls
        # open (first token, then the plan on the same answer), started (not awaited), closed (with the counts)
        assert {step: calls[step] for step in ("open", "started", "closed")} == {"open": n, "started": n, "closed": n}
        # the malformed body's status and error alone (it has no request to close); they are not awaited
        await eventually(lambda: calls["count"] == 2)
        assert c.metric("lmcache_p2p_proxy_requests_total", endpoint="/v1/completions", status="200") == n
        assert c.metric("lmcache_p2p_proxy_requests_total", endpoint="/v1/completions", status="400") == 1
        assert len(c.proxy.coordinator) == 0


# ---- a handover that cannot happen fails over without waiting out --kv-timeout-s -------------------------
# The KV timeout is 60 s and the client's 10 s: a failover that waits for the timeout fails the test.

FAILOVER = dict(kv_timeout_s=60.0)
N = 6


def _decodes(node) -> list[dict[str, Any]]:
    """The decode requests an instance got (not prefills: those carry kv_transfer_params)."""
    return [b for b in node.vllm.calls("/v1/completions") if "kv_transfer_params" not in b]


def _continued_on_the_prefiller(c, prefiller) -> None:
    ids = tokenize(PROMPT)
    decode, = _decodes(prefiller)
    assert decode["prompt"] == ids + generate(ids, 1) and decode["max_tokens"] == N - 1
    assert c.metric("lmcache_p2p_proxy_failovers_total", phase="handover") == 1


@pytest.mark.timeout(20)
async def test_a_decoder_its_prefiller_cannot_reach_leaves_the_decode_to_the_prefiller_at_once():
    async with make_cluster(**FAILOVER) as c:
        decoder = c.decoders[0]
        decoder.agent.kv_mode, decoder.agent.kv_fail_cause = "fail", KvFailCause.UNREACHABLE
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": N})
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == expected_text(tokenize(PROMPT), N)
        assert not decoder.vllm.calls("/v1/completions")  # neither retried towards it nor recomputed on it
        assert len(c.prefillers[0].vllm.calls("/v1/completions")) == 2  # one prefill, then the decode
        _continued_on_the_prefiller(c, c.prefillers[0])
        assert c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="failed") == 1
        assert_idle(c)


@pytest.mark.timeout(20)
async def test_a_decoder_its_prefiller_cannot_reach_is_replaced_by_another_fed_from_the_same_prefiller():
    async with make_cluster(n_prefill=2, n_decode=2, **FAILOVER) as c:
        cut: list[FakeAgent] = []

        async def deliver(spec):  # the first decoder the KV goes to is cut off from the prefillers
            agent = next(n.agent for n in c.decoders if n.agent.control_port(0) == spec["receiver_alloc_port"][0])
            if not cut:
                cut.append(agent)
                agent.kv_mode, agent.kv_fail_cause = "fail", KvFailCause.UNREACHABLE
            await c.network.deliver(spec)

        for node in c.prefillers:
            node.vllm.kv_sink = deliver
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": N})
        assert resp.json()["choices"][0]["text"] == expected_text(tokenize(PROMPT), N)
        prefilled = [n for n in c.prefillers if n.vllm.calls("/v1/completions")]
        assert len(prefilled) == 1 and len(prefilled[0].vllm.calls("/v1/completions")) == 2  # its prefix cache: again
        retry = prefilled[0].vllm.calls("/v1/completions")[1]
        assert retry["prompt"] == tokenize(PROMPT) and retry["max_tokens"] == 1
        decoded_on = [n.agent for n in c.decoders if n.vllm.calls("/v1/completions")]
        assert len(decoded_on) == 1 and decoded_on[0] is not cut[0]
        assert c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="ready") == 1
        assert_idle(c)


@pytest.mark.timeout(20)
async def test_a_decoder_taken_out_of_rotation_mid_wait_ends_the_wait_and_the_prefiller_continues():
    async with make_cluster(kv_probe_after_s=0, **FAILOVER) as c:  # only the registry says it is down
        decoder = c.decoders[0]
        decoder.agent.kv_mode = "silent"
        inst, = [i for i in c.proxy.registry.instances() if i.instance_id == decoder.agent.instance_id]
        request = asyncio.ensure_future(c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": N}))
        await eventually(lambda: decoder.agent.kv_requests)  # the prefill ran: its KV is awaited
        for _ in range(c.proxy.settings.max_connect_failures):  # the proxy's connections to it failed
            c.proxy.registry.note_connect_failure(inst)
        resp = await request
        assert resp.json()["choices"][0]["text"] == expected_text(tokenize(PROMPT), N)
        assert not decoder.vllm.calls("/v1/completions")
        _continued_on_the_prefiller(c, c.prefillers[0])
        assert c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="decoder_down") == 1
        assert_idle(c)


@pytest.mark.timeout(20)
async def test_a_decoder_that_does_not_answer_while_its_kv_is_overdue_is_left_for_the_prefiller():
    async with make_cluster(kv_probe_after_s=0.1, **FAILOVER) as c:
        decoder = c.decoders[0]
        decoder.agent.kv_mode = "silent"
        await decoder.vllm.server.stop()  # gone; the registry does not know yet
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": N})
        assert resp.json()["choices"][0]["text"] == expected_text(tokenize(PROMPT), N)
        _continued_on_the_prefiller(c, c.prefillers[0])
        assert c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="decoder_down") == 1
        assert_idle(c)


async def test_with_nothing_known_the_kv_timeout_still_bounds_the_wait_and_a_healthy_decoder_recomputes():
    async with make_cluster(kv_timeout_s=0.5, kv_probe_after_s=0.05, on_kv_failure="recompute") as c:
        decoder = c.decoders[0]
        decoder.agent.kv_mode = "silent"  # it answers its probes: nothing says it is down
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": N})
        assert resp.json()["choices"][0]["text"] == expected_text(tokenize(PROMPT), N)
        ids = tokenize(PROMPT)
        decode, = decoder.vllm.calls("/v1/completions")
        assert decode["prompt"] == ids + generate(ids, 1)
        assert not _decodes(c.prefillers[0])
        assert c.metric("lmcache_p2p_proxy_kv_outcomes_total", outcome="timeout") == 1
        assert c.metric("lmcache_p2p_proxy_failovers_total", phase="handover") == 0
        assert_idle(c)
