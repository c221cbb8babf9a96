"""Which HTTP client the proxy uses for its upstream calls: aiohttp against httpx, on loopback.

The proxy calls its instances in three ways: health probes (``GET /health``, status only), JSON
calls (a prefill: a token-id prompt in, one JSON answer out; ``/tokenize``) and decode streams
(SSE, one event per token; the hot path). This bench runs a fake instance in a child process
(aiohttp.web on 127.0.0.1, so the server's cost is the same for both clients) and measures, in
this process, what each client library costs the proxy:

  probe_us     client CPU time (user + system of this process) per ``GET /health``
  probe_p50_ms wall time of one probe, median
  call_us      client CPU time per JSON call (1024 prompt token ids in, a prefill-like answer out)
  call_p50_ms  wall time of one JSON call, median
  stream_us_event  client CPU time per SSE event relayed (read, split into events, JSON-decoded)
  stream_us_read   client CPU time per read of the stream (the server writes one event per write,
                   ``--pace-ms`` apart, so a read mostly finds one event: the GPU case)
  events_per_read  what each read found

Calls are sequential (one in flight), so the figures are per-call overhead, not throughput. The two
clients alternate in rounds, so drift on a shared machine hits both alike.

    PYTHONPATH=$PWD .venv/bin/python bench/proxy_client.py [--calls 2000] [--streams 20] [--events 1000]

Writes ``bench/results/proxy_client.json`` (``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec

HOST = "127.0.0.1"
PROMPT_IDS = list(range(1000, 2024))
SERVER_START_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 30.0


# ---- the fake instance (child process) ------------------------------------------------------------


def serve(port: int, events: int, pace_s: float) -> None:
    from aiohttp import web

    answer = msgspec.json.encode({"id": "cmpl-1", "object": "text_completion", "model": "fake",
                                  "choices": [{"index": 0, "text": "x", "token_ids": [7], "finish_reason": "length",
                                               "prompt_token_ids": PROMPT_IDS}],
                                  "usage": {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": 1}})
    event = b"data: " + msgspec.json.encode({"id": "cmpl-1", "object": "text_completion", "model": "fake",
                                             "choices": [{"index": 0, "text": " tok", "token_ids": [42],
                                                          "finish_reason": None}]}) + b"\n\n"

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def completion(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=answer, content_type="application/json")

    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(events):
            await resp.write(event)
            await asyncio.sleep(pace_s)  # one event per write, paced as decode steps are
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completion)
    app.router.add_post("/stream", stream)
    web.run_app(app, host=HOST, port=port, print=None, access_log=None)


# ---- the clients ----------------------------------------------------------------------------------


class AiohttpClient:
    name = "aiohttp"

    def __init__(self) -> None:
        import aiohttp

        self._aiohttp = aiohttp
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0),
                                              trust_env=False, auto_decompress=False)

    async def probe(self, url: str) -> int:
        async with self._session.get(url, timeout=self._aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)) as resp:
            await resp.read()
            return resp.status

    async def call(self, url: str, body: bytes) -> dict[str, Any]:
        async with self._session.post(url, data=body, headers={"content-type": "application/json"},
                                      timeout=self._aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)) as resp:
            return msgspec.json.decode(await resp.read())

    async def stream(self, url: str, body: bytes) -> tuple[int, int]:
        timeout = self._aiohttp.ClientTimeout(total=None, sock_read=CALL_TIMEOUT_S)
        async with self._session.post(url, data=body, headers={"content-type": "application/json"},
                                      timeout=timeout) as resp:
            return await _count_events(resp.content.iter_any())

    async def aclose(self) -> None:
        await self._session.close()


class HttpxClient:
    name = "httpx"

    def __init__(self) -> None:
        import httpx

        self._httpx = httpx
        self._client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
                                         trust_env=False)

    async def probe(self, url: str) -> int:
        return (await self._client.get(url, timeout=CALL_TIMEOUT_S)).status_code

    async def call(self, url: str, body: bytes) -> dict[str, Any]:
        resp = await self._client.post(url, content=body, headers={"content-type": "application/json"},
                                       timeout=CALL_TIMEOUT_S)
        return msgspec.json.decode(resp.content)

    async def stream(self, url: str, body: bytes) -> tuple[int, int]:
        timeout = self._httpx.Timeout(CALL_TIMEOUT_S)
        async with self._client.stream("POST", url, content=body, headers={"content-type": "application/json"},
                                       timeout=timeout) as resp:
            return await _count_events(resp.aiter_raw())

    async def aclose(self) -> None:
        await self._client.aclose()


async def _count_events(chunks: Any) -> tuple[int, int]:
    """(events, reads): the stream split into SSE data lines and decoded, as the proxy does."""
    events = reads = 0
    rest = b""
    async for chunk in chunks:
        reads += 1
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):
                data = line[5:].strip()
                if data != b"[DONE]":
                    msgspec.json.decode(data)
                    events += 1
    return events, reads


# ---- measuring ------------------------------------------------------------------------------------


def _cpu_s() -> float:
    return time.process_time()  # user + system of this process, at the clock's full resolution


async def _timed(n: int, one: Callable[[], Awaitable[Any]]) -> tuple[float, list[float]]:
    """(CPU seconds of this process, wall seconds of each call) over ``n`` sequential calls."""
    walls = []
    cpu0 = _cpu_s()
    for _ in range(n):
        t0 = time.perf_counter()
        await one()
        walls.append(time.perf_counter() - t0)
    return _cpu_s() - cpu0, walls


async def measure(client: Any, base: str, calls: int, streams: int) -> dict[str, float]:
    body = msgspec.json.encode({"model": "fake", "prompt": PROMPT_IDS, "max_tokens": 1})
    for _ in range(50):  # warm: connections open, code paths hot
        await client.probe(base + "/health")
        await client.call(base + "/v1/completions", body)
    probe_cpu, probe_walls = await _timed(calls, lambda: client.probe(base + "/health"))
    call_cpu, call_walls = await _timed(calls, lambda: client.call(base + "/v1/completions", body))
    events = reads = 0
    cpu0 = _cpu_s()
    for _ in range(streams):
        e, r = await client.stream(base + "/stream", body)
        events, reads = events + e, reads + r
    stream_cpu = _cpu_s() - cpu0
    return {"probe_us": probe_cpu / calls * 1e6, "probe_p50_ms": statistics.median(probe_walls) * 1e3,
            "call_us": call_cpu / calls * 1e6, "call_p50_ms": statistics.median(call_walls) * 1e3,
            "stream_us_event": stream_cpu / events * 1e6, "stream_us_read": stream_cpu / reads * 1e6,
            "events_per_read": events / reads}


async def run(args: argparse.Namespace, base: str) -> dict[str, list[dict[str, float]]]:
    rows: dict[str, list[dict[str, float]]] = {"aiohttp": [], "httpx": []}
    for _ in range(args.rounds):
        for make in (AiohttpClient, HttpxClient):
            client = make()
            try:
                rows[client.name].append(await measure(client, base, args.calls, args.streams))
            finally:
                await client.aclose()
    return rows


def _wait_listening(port: int) -> None:
    import socket

    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            socket.create_connection((HOST, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"the fake instance did not listen on {HOST}:{port} within {SERVER_START_TIMEOUT_S:.0f} s")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=2000, help="sequential probes and JSON calls per round")
    p.add_argument("--streams", type=int, default=20, help="streams per round")
    p.add_argument("--events", type=int, default=1000, help="SSE events per stream")
    p.add_argument("--pace-ms", type=float, default=0.5,
                   help="the fake decoder's pause between events (0: as fast as it can write)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the clients alternating")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "proxy_client.json")
    p.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)  # the child: serve on this port
    args = p.parse_args()
    if args.serve is not None:
        serve(args.serve, args.events, args.pace_ms / 1e3)
        return
    port = _free_port()
    child = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--events", str(args.events),
                              "--pace-ms", str(args.pace_ms)])
    try:
        _wait_listening(port)
        rows = asyncio.run(run(args, f"http://{HOST}:{port}"))
    finally:
        child.terminate()
        child.wait(timeout=10)
    medians = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in rows.items()}
    keys = list(medians["aiohttp"])
    print(f"{'client':8} " + " ".join(f"{k:>16}" for k in keys))
    for name, m in medians.items():
        print(f"{name:8} " + " ".join(f"{m[k]:16.3f}" for k in keys))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": {k: v for k, v in vars(args).items() if k not in ("out", "serve")},
                                    "median_of_rounds": medians, "rounds": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
