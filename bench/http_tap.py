"""A timestamping HTTP relay between a router and one vLLM server (``bench/anchor.py``'s vllm-nixl).

vllm-router is a compiled binary with no per-request timeline, so the handover of the stack behind it
is timed on the wire: a tap in front of the prefiller and one in front of the decoder, the router
pointed at the taps. Per request body (keyed by its ``prompt``) each tap records when the request
came, when the first response bytes holding ``data:`` came back (the first streamed token), and
when the whole answer had come back. The handover is then ``decoder tap: first data`` minus
``prefiller tap: answer done``: the prefill answer reaching the router -> the first decoded byte
reaching it, the definition lmcache_p2p's proxy uses for its own ``/stats``.

    python bench/http_tap.py --port 8401 --upstream http://127.0.0.1:8101

``GET /_tap/records`` returns the records (a JSON list), ``POST /_tap/reset`` clears them; every
other path is relayed as it is. Binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from typing import Any

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "content-encoding"}
UPSTREAM_TIMEOUT_S = 900  # a relayed request never outlives the bench's own load limit


def prompt_key(raw: bytes) -> str | None:
    """A short digest of a JSON body's ``prompt`` (string or token ids), None for other bodies."""
    try:
        prompt = json.loads(raw).get("prompt")
    except (ValueError, AttributeError):
        return None
    if prompt is None:
        return None
    return hashlib.sha1(json.dumps(prompt).encode()).hexdigest()[:16]


def make_app(upstream: str) -> web.Application:
    records: list[dict[str, Any]] = []
    app = web.Application(client_max_size=64 << 20)

    async def start(app: web.Application) -> None:
        app["session"] = ClientSession(connector=TCPConnector(limit=0), timeout=ClientTimeout(total=UPSTREAM_TIMEOUT_S),
                                       auto_decompress=False)

    async def stop(app: web.Application) -> None:
        await app["session"].close()

    async def relay(request: web.Request) -> web.StreamResponse:
        if request.path == "/_tap/records":
            return web.json_response(records)
        if request.path == "/_tap/reset":
            records.clear()
            return web.json_response({"ok": True})
        raw = await request.read()
        rec: dict[str, Any] = {"key": prompt_key(raw), "path": request.path, "t_request": time.time(),
                               "t_first_data": None, "t_done": None, "status": None}
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        async with app["session"].request(request.method, upstream + request.path_qs, data=raw,
                                          headers=headers) as up:
            rec["status"] = up.status
            resp = web.StreamResponse(status=up.status, headers={k: v for k, v in up.headers.items()
                                                                 if k.lower() not in HOP_HEADERS})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                now = time.time()
                if rec["t_first_data"] is None and b"data:" in chunk:
                    rec["t_first_data"] = now
                rec["t_done"] = now
                await resp.write(chunk)
            await resp.write_eof()
        if rec["key"] is not None:
            records.append(rec)
        return resp

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_route("*", "/{tail:.*}", relay)
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True, help="the server relayed to, e.g. http://127.0.0.1:8101")
    p.add_argument("--host", default="127.0.0.1")
    a = p.parse_args()
    web.run_app(make_app(a.upstream.rstrip("/")), host=a.host, port=a.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
