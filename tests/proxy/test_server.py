"""The proxy as a process: starts from flags, answers, and exits cleanly on SIGTERM / SIGINT."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import httpx
import pytest

from .conftest import _PROXY_MAIN as _MAIN, ProxyProcess

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_process_serves_and_exits_cleanly_on_signal(sig):
    proxy = ProxyProcess("--prefill", "http://127.0.0.1:1", "--summary-interval-s", "0", "--tokenizer", "none")
    proc, url = proxy.proc, proxy.url
    try:
        health = httpx.get(url + "/health", timeout=5, trust_env=False).json()
        assert health["prefillers"] == 0 and health["decoders"] == 0  # nothing listens on :1: never healthy
        assert httpx.get(url + "/instances", timeout=5, trust_env=False).json() == []
        static, = httpx.get(url + "/instances?all=1", timeout=5, trust_env=False).json()
        assert static["http_url"] == "http://127.0.0.1:1" and static["health"] == "pending"
        assert static["routable"] is False
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0
        rest = proxy.rest_of_stderr()
        assert "shutting down" in rest and "Traceback" not in rest
    finally:
        proxy.kill()


@pytest.mark.anyio
async def test_accepted_http_connections_have_tcp_nodelay():
    """Small writes go out at once: without TCP_NODELAY a streamed chunk written after the response
    headers waited for the client's delayed ACK (~40 ms of TTFT). asyncio sets the option only on
    sockets accepted from a listener made with proto IPPROTO_TCP."""
    import asyncio
    import socket

    from lmcache_p2p.proxy.listener import bind_http

    accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    class Record(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            sock = transport.get_extra_info("socket")
            accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    listener = bind_http("127.0.0.1", 0)
    server = await asyncio.get_running_loop().create_server(Record, sock=listener)
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", listener.getsockname()[1])
        assert await asyncio.wait_for(accepted, 5) != 0
        writer.close()
    finally:
        server.close()
        await server.wait_closed()


# ---- exposure: the control socket and the admin endpoints ------------------------------------------


def test_process_refuses_to_serve_the_registry_beyond_loopback_without_a_secret():
    env = {k: v for k, v in os.environ.items() if k != "LMCACHE_P2P_SECRET"}
    proc = subprocess.run([sys.executable, "-c", _MAIN, "--port", "0", "--control-port", "0", "--host", "0.0.0.0"],
                          capture_output=True, text=True, timeout=20, env=env)
    assert proc.returncode == 2
    assert "proxy not started: --shared-secret:" in proc.stderr and "--insecure" in proc.stderr
    assert "control socket on 0.0.0.0" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("flags, exposed", [
    (dict(host="0.0.0.0", control_host="0.0.0.0"),
     ["control socket on 0.0.0.0:9101 (--control-host)", "HTTP/admin endpoints on 0.0.0.0:9100"]),
    (dict(control_host="10.0.0.1"), ["control socket on 10.0.0.1:9101 (--control-host)"]),
    (dict(host="10.0.0.1", control_host="127.0.0.1"), ["HTTP/admin endpoints on 10.0.0.1:9100 (--host)"]),
])
def test_settings_name_every_port_exposed_without_a_secret(flags, exposed):
    from lmcache_p2p.errors import ConfigError
    from lmcache_p2p.proxy.settings import ProxySettings

    with pytest.raises(ConfigError, match=r"^--shared-secret: .*pass --insecure") as err:
        ProxySettings(**flags)
    for port in exposed:
        assert port in str(err.value)
    assert ProxySettings(**flags, shared_secret="s").exposed_ports()
    assert ProxySettings(**flags, insecure=True).insecure
    assert ProxySettings().exposed_ports() == []


@pytest.mark.anyio
async def test_insecure_start_is_logged_loudly(caplog):
    from lmcache_p2p.proxy.server import Proxy
    from lmcache_p2p.proxy.settings import ProxySettings

    # Bound on loopback (tests never listen beyond it); the HTTP --host is only declared exposed.
    proxy = Proxy(ProxySettings(host="10.255.255.1", port=0, control_port=0, insecure=True, summary_interval_s=0))
    caplog.set_level("WARNING", logger="lmcache_p2p.proxy.server")
    try:
        await proxy.start()
        assert "INSECURE (--insecure): HTTP/admin endpoints on 10.255.255.1" in caplog.text
    finally:
        await proxy.close()


_ADMIN_CALLS = [("GET", "/instances?all=1", None), ("POST", "/instances/drain", {"instance_id": "nope"}),
                ("POST", "/stats/reset", None)]


@pytest.mark.anyio
@pytest.mark.parametrize("method, path, body", _ADMIN_CALLS)
async def test_admin_endpoints_need_the_secret(method, path, body):
    from .conftest import make_cluster

    async with make_cluster(n_prefill=0, n_decode=0, secret="s3cret") as c:
        before = c.proxy.registry.instances()
        missing = await c.client.request(method, path, json=body)
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        assert "Authorization: Bearer" in missing.json()["error"]["message"]
        wrong = await c.client.request(method, path, json=body, headers={"authorization": "Bearer guess"})
        assert wrong.status_code == 403 and "wrong admin secret" in wrong.json()["error"]["message"]
        assert c.proxy.registry.instances() == before
        right = await c.client.request(method, path, json=body, headers={"authorization": "Bearer s3cret"})
        assert right.status_code in (200, 404)  # 404: drain of an unknown id, i.e. the call got through
        for open_path in ("/health", "/metrics", "/stats"):
            assert (await c.client.get(open_path)).status_code == 200


@pytest.mark.anyio
async def test_drain_with_the_secret_takes_the_instance_out_of_rotation():
    from lmcache_p2p.config import Role

    from .conftest import make_cluster

    async with make_cluster(n_prefill=0, n_decode=1, secret="s3cret") as c:
        decoder, = c.proxy.registry.routable(Role.RECEIVER)
        refused = await c.client.post("/instances/drain", json={"instance_id": decoder.instance_id})
        assert refused.status_code == 401 and c.proxy.registry.routable(Role.RECEIVER) == [decoder]
        done = await c.client.post("/instances/drain", json={"instance_id": decoder.instance_id},
                                   headers={"authorization": "Bearer s3cret"})
        assert done.status_code == 200 and c.proxy.registry.routable(Role.RECEIVER) == []


@pytest.mark.anyio
async def test_without_a_secret_on_loopback_admin_stays_open():
    from .conftest import make_cluster

    async with make_cluster(n_prefill=0, n_decode=0) as c:
        assert (await c.client.get("/instances?all=1")).status_code == 200


def test_warm_up_loads_what_the_first_stream_and_the_first_probe_would_load_on_the_loop():
    """anyio imports its asyncio backend (~25 ms) at its first use, Starlette's first StreamingResponse, and aiohttp
    (seconds on a loaded machine) is imported at the first upstream call, a health probe's: a proxy process (one
    process, or each relay worker) does both at start, before anything runs on its loop."""
    modules = ("anyio._backends._asyncio", "aiohttp")
    code = ("import asyncio, sys\n"
            "from lmcache_p2p.proxy.listener import warm_up\n"
            f"before = [m in sys.modules for m in {modules!r}]\n"
            "asyncio.run(warm_up())\n"
            f"print(*before, *[m in sys.modules for m in {modules!r}])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "False", "True", "True"]


@pytest.mark.anyio
async def test_the_proxy_warms_up_before_its_probes_and_control_socket_run_on_the_loop(monkeypatch):
    from lmcache_p2p.proxy import server
    from lmcache_p2p.proxy.control import ControlListener
    from lmcache_p2p.proxy.router.health import HealthProber
    from lmcache_p2p.proxy.settings import ProxySettings

    order: list[str] = []

    async def warm_up() -> None:
        order.append("warm_up")

    def recorded(name: str, real):
        def call(self, *args, **kwargs):
            order.append(name)
            return real(self, *args, **kwargs)
        return call

    monkeypatch.setattr(server, "warm_up", warm_up)
    monkeypatch.setattr(HealthProber, "start", recorded("probes", HealthProber.start))
    monkeypatch.setattr(ControlListener, "start", recorded("control", ControlListener.start))
    proxy = server.Proxy(ProxySettings(port=0, control_port=0, summary_interval_s=0, tokenizer="none"))
    try:
        await proxy.start()
        await proxy.start_http()
    finally:
        await proxy.close()
    assert order == ["warm_up", "control", "probes"]
