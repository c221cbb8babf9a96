"""``--workers N``: relay worker processes serve the HTTP port and stream the decodes; the coordinator
(this test's process, for in-process clusters) keeps the registry, routing and load accounting.

The client's bytes equal one process's (a stream's content, however its events were grouped); load returns to zero; a broken decode still migrates; a dead
worker is restarted (its requests closed), and a proxy whose workers keep dying exits with an error.
The whole suite also runs with ``LMCACHE_P2P_TEST_PROXY_WORKERS=2`` (conftest.py).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from lmcache_p2p.proxy.relay.coordinator import RelayCoordinator

from ..conftest import ProxyProcess, eventually, make_cluster
from ..fakes import MESSAGES, MODEL, PROMPT, expected_text, generate, tokenize
from ..flow.test_flow import assert_idle, cycling_model, use_model

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]

_VOLATILE = ("id", "created")


def _stable(value: Any) -> Any:
    """``value`` without response ids and timestamps (they differ between any two runs)."""
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k not in _VOLATILE}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value


def _joined(events: list[Any]) -> dict[str, Any]:
    """A stream's content, however its events were grouped: the proxy merges the decoder's events that one
    read brought (upstream.coalesce), so the grouping depends on timing, not the content."""
    out: dict[str, Any] = {"text": "", "token_ids": [], "logprobs": [], "finish": [], "other": []}
    for event in events:
        if not isinstance(event, dict) or not event.get("choices"):
            out["other"].append(_stable(event))
            continue
        choice = event["choices"][0]
        delta = choice.get("delta") or {}
        out["text"] += choice.get("text") or delta.get("content") or ""
        out["token_ids"] += choice.get("token_ids") or []
        lp = choice.get("logprobs") or {}
        out["logprobs"] += lp.get("content") or list(zip(lp.get("tokens") or [], lp.get("token_logprobs") or []))
        if delta.get("role"):
            out["other"].append(delta)
        if choice.get("finish_reason") is not None:
            out["finish"].append((choice["finish_reason"], choice.get("stop_reason")))
    return out


def _requests() -> list[tuple[str, dict[str, Any]]]:
    usage = {"stream_options": {"include_usage": True}, "return_token_ids": True}
    return [
        ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 9, "return_token_ids": True}),
        ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 7, "stream": True, **usage}),
        ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "logprobs": 1}),
        ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 30, "stop": ["☃"], "stream": True,
                             "return_token_ids": True}),
        ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 8}),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 9, "stream": True, **usage}),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "logprobs": True,
                                  "top_logprobs": 1, "stream": True}),
    ]


async def _answers(workers: int, tokenizer: Any) -> list[Any]:
    path, hf = tokenizer
    async with make_cluster(workers=workers, tokenizer=str(path)) as c:
        use_model(c, cycling_model(hf.encode("中文☃ ok", add_special_tokens=False)), hf)
        out = []
        for route, body in _requests():
            if body.get("stream"):
                out.append(_joined(await c.stream(route, body)))
            else:
                resp = await c.post(route, body)
                out.append((resp.status_code, _stable(resp.json())))
        decodes = c.decoders[0].vllm.calls("/v1/completions")
        out.append([_decode_request(body) for body in decodes])  # as the request's owner made them
        assert_idle(c)
        return out


def _decode_request(body: dict[str, Any]) -> dict[str, Any]:
    """A decode request without its KV handover's id (fresh per request)."""
    params = {k: v for k, v in (body.get("kv_transfer_params") or {}).items() if k != "req_id"}
    return {**body, "kv_transfer_params": params}


async def test_clients_get_the_same_bytes_from_two_workers_as_from_one_process(tokenizer_dir):
    one = await _answers(1, tokenizer_dir)
    two = await _answers(2, tokenizer_dir)
    assert two == one and len(one[-1]) >= 6  # the decoder got the same requests (a worker sends the owner's bytes)
    assert sum(isinstance(a, dict) and len(a["token_ids"]) > 3 for a in one) >= 2  # streams were compared


async def test_load_returns_to_zero_after_many_concurrent_requests_on_both_workers():
    async with make_cluster(workers=2, n_decode=2) as c:
        ids = tokenize(PROMPT)

        async def one(i: int) -> str:
            async with httpx.AsyncClient(base_url=c.client.base_url, timeout=30, trust_env=False) as own:  # own conn
                body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "stream": i % 2 == 0}
                resp = await own.post("/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                return resp.text if body["stream"] else resp.json()["choices"][0]["text"]

        answers = await asyncio.gather(*(one(i) for i in range(24)))
        assert all(a.endswith("data: [DONE]\n\n") for a in answers[0::2])
        assert answers[1::2] == [expected_text(ids, 6)] * 12
        # a worker tells the coordinator that a non-streamed answer closed after the client has it
        await eventually(lambda: len(c.proxy.coordinator) == 0)
        assert_idle(c)
        assert sorted(c.proxy.coordinator.opened_by_worker) == [0, 1]  # both workers served
        assert sum(c.proxy.coordinator.opened_by_worker.values()) == 24
        stats = (await c.client.get("/stats")).json()  # passed through a worker to the coordinator
        assert stats["ttft_ms"]["count"] == 24
        assert c.metric("lmcache_p2p_proxy_requests_total", endpoint="/v1/completions", status="200") == 24


@pytest.mark.parametrize("stream", [True, False])
async def test_a_decoder_dying_mid_stream_still_migrates(stream):
    async with make_cluster(workers=2, n_decode=2) as c:
        for node in c.decoders:
            node.vllm.die_after = 3
        ids = tokenize(PROMPT)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "return_token_ids": True, "stream": stream}
        if stream:
            events = await c.stream("/v1/completions", body)
            assert all("error" not in e for e in events[:-1])
            chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
            token_ids = [t for ch in chunks for t in ch["token_ids"]]
        else:
            resp = await c.post("/v1/completions", body)
            token_ids = resp.json()["choices"][0]["token_ids"]
        assert token_ids == generate(ids, 12)
        assert c.metric("lmcache_p2p_proxy_failovers_total", phase="migrate") == 2
        await eventually(lambda: len(c.proxy.coordinator) == 0)  # closed there after the client's answer
        assert_idle(c)


async def test_a_killed_worker_is_restarted_and_its_requests_are_closed():
    async with make_cluster(workers=2) as c:
        c.decoders[0].vllm.token_delay_s = 0.5  # streams of 50 s: all open when the worker is killed, until let go
        pool = c.proxy.workers
        before = dict(pool.pids)
        streams = [asyncio.ensure_future(_stream_until_cut(str(c.client.base_url))) for _ in range(6)]
        await eventually(lambda: len(c.proxy.coordinator) == 6)
        victim = max(before, key=c.proxy.coordinator.open_on)
        held = c.proxy.coordinator.open_on(victim)
        assert held > 0
        os.kill(before[victim], signal.SIGKILL)
        await eventually(lambda: pool.pids.get(victim) not in (None, before[victim]), timeout_s=60)
        assert c.proxy.coordinator.open_on(victim) == 0  # its requests were closed when it died
        c.decoders[0].vllm.token_delay_s = 0.0
        assert sum(await asyncio.gather(*streams)) == held  # its clients' streams broke, the others' did not
        await eventually(lambda: len(c.proxy.coordinator) == 0)
        ids = tokenize(PROMPT)
        for _ in range(4):  # whichever worker takes them, answers are whole
            async with httpx.AsyncClient(base_url=c.client.base_url, timeout=30, trust_env=False) as own:
                resp = await own.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 5})
                assert resp.json()["choices"][0]["text"] == expected_text(ids, 5)
        await eventually(lambda: len(c.proxy.coordinator) == 0)
        assert_idle(c)


async def test_a_worker_killed_while_its_requests_wait_for_their_kv_has_them_closed_and_their_kv_wait_stopped():
    async with make_cluster(workers=2, kv_timeout_s=60.0) as c:
        c.decoders[0].agent.kv_mode = "silent"  # the KV never comes: the coordinator plans on, for a minute
        pool = c.proxy.workers
        before = dict(pool.pids)
        streams = [asyncio.ensure_future(_stream_until_cut(str(c.client.base_url))) for _ in range(4)]
        await eventually(lambda: len(c.proxy.coordinator) == 4 and len(c.proxy.waiters) == 4)
        victim = max(before, key=c.proxy.coordinator.open_on)
        held = c.proxy.coordinator.open_on(victim)
        os.kill(before[victim], signal.SIGKILL)
        await eventually(lambda: pool.pids.get(victim) not in (None, before[victim]), timeout_s=60)
        assert c.proxy.coordinator.open_on(victim) == 0
        assert len(c.proxy.waiters) == 4 - held  # the dead worker's KV waits stopped with their requests
        c.decoders[0].agent.kv_mode = "ready"
        for stream in streams:
            if not stream.done():
                stream.cancel()  # the others' clients leave: their workers close them
        await asyncio.gather(*streams, return_exceptions=True)
        await eventually(lambda: len(c.proxy.coordinator) == 0)
        assert_idle(c)


class _CutAnswer:
    """An answer cut after its status line: the worker's read fails (a link error, as a dropped connection)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("arrived", [False, True])
async def test_a_closed_report_whose_answer_is_lost_is_sent_again_and_counted_once(monkeypatch, arrived, stream):
    """The first "closed" of the request gets no answer: lost before the coordinator took it (its lease stays),
    or taken and then its answer lost. Either way the worker sends it again: the lease is returned, the
    answer counted once."""
    closed_step = RelayCoordinator._closed_step
    cut: list[bool] = []

    async def first_answer_cut(self: RelayCoordinator, request: Any) -> Any:
        if cut:
            return await closed_step(self, request)
        cut.append(True)
        if arrived:
            await closed_step(self, request)
        return _CutAnswer()

    monkeypatch.setattr(RelayCoordinator, "_closed_step", first_answer_cut)  # before the routes are made
    async with make_cluster(workers=2) as c:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": stream}
        if stream:
            assert (await c.stream("/v1/completions", body))[-1] == "[DONE]"
        else:
            assert (await c.post("/v1/completions", body)).json()["choices"][0]["text"] == expected_text(
                tokenize(PROMPT), 5)
        await eventually(lambda: len(c.proxy.coordinator) == 0)
        assert_idle(c)
        assert c.proxy.coordinator.calls["closed"] == 2
        assert c.metric("lmcache_p2p_proxy_requests_total", endpoint="/v1/completions", status="200") == 1


async def _stream_until_cut(url: str) -> int:
    """A long stream on its own connection; 1 when it broke (the worker serving it died), 0 when it ended."""
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30, trust_env=False) as own:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 100, "stream": True}
            async with own.stream("POST", "/v1/completions", json=body) as resp:
                async for _ in resp.aiter_bytes():
                    pass
    except httpx.HTTPError:
        return 1
    return 0


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait(condition: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_a_proxy_whose_workers_keep_dying_exits_with_an_error():
    proxy = ProxyProcess("--workers", "2", "--summary-interval-s", "0", "--tokenizer", "none")
    try:
        killed: set[int] = set()
        deadline = time.monotonic() + 120
        while proxy.proc.poll() is None and time.monotonic() < deadline:
            for child in _children(proxy.proc.pid):
                if child not in killed and _alive(child):
                    os.kill(child, signal.SIGKILL)
                    killed.add(child)
            time.sleep(0.05)
        assert proxy.proc.wait(30) == 1
        assert "more than 5: stopping the proxy" in proxy.rest_of_stderr()
        _wait(lambda: not any(_alive(p) for p in killed | set(_children(proxy.proc.pid))))
    finally:
        proxy.kill()


def test_sigterm_stops_the_coordinator_and_every_worker():
    proxy = ProxyProcess("--workers", "2", "--summary-interval-s", "0", "--graceful-shutdown-s", "1",
                         "--tokenizer", "none")
    try:
        workers = [p for p in _children(proxy.proc.pid) if _alive(p)]
        assert len(workers) == 2
        assert httpx.get(proxy.url + "/health", timeout=10, trust_env=False).json()["status"] == "ok"
        proxy.proc.send_signal(signal.SIGTERM)
        assert proxy.proc.wait(30) == 0
        _wait(lambda: not any(_alive(p) for p in workers))
    finally:
        proxy.kill()


def test_launch_passes_proxy_workers_to_the_proxy_and_the_proxy_takes_it(tmp_path):
    import argparse

    from lmcache_p2p.cli import launch
    from lmcache_p2p.cli.main import build_parser
    from lmcache_p2p.errors import ConfigError
    from lmcache_p2p.proxy.server import add_arguments
    from lmcache_p2p.proxy.settings import ProxySettings

    args = build_parser().parse_args(["launch", "--model", str(tmp_path), "--proxy-workers", "3"])
    argv = list(launch.proxy_child(args, tmp_path).argv)
    proxy_argv = argv[argv.index("proxy") + 1:]
    assert proxy_argv[proxy_argv.index("--workers") + 1] == "3"
    assert proxy_argv[proxy_argv.index("--tokenizer") + 1] == str(tmp_path.resolve())  # workers load it first
    one = build_parser().parse_args(["launch", "--model", str(tmp_path)])
    assert "--tokenizer" not in launch.proxy_child(one, tmp_path).argv  # one process: as before
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert ProxySettings.from_args(parser.parse_args(proxy_argv)).workers == 3
    assert ProxySettings.from_args(parser.parse_args([])).workers == 1  # default: one process
    with pytest.raises(ConfigError, match="--workers"):
        ProxySettings(workers=0)
