"""The handover path does not wait for the client: the decode request goes out while the first token is
still being written (a client that does not read), in one process and in a relay worker; a worker
makes few calls to its coordinator per request."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import pytest

from lmcache_p2p.proxy.relay.link import CoordinatorLink
from lmcache_p2p.proxy.relay.tokenizers import Tokenizers
from lmcache_p2p.proxy.relay.worker import WorkerApp
from lmcache_p2p.proxy.upstream import Upstream

from ..conftest import eventually, make_cluster
from ..fakes import MODEL, PROMPT, expected_text, tokenize

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
