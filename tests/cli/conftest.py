"""Fake children for launcher tests: a tiny HTTP server stands in for vLLM and the proxy."""

from __future__ import annotations

import http.server
import json
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lmcache_p2p.cli import instance, launch
from lmcache_p2p.cli.main import build_parser
from lmcache_p2p.cli.processes import Child, stop_all

FAKE_SERVER = Path(__file__).with_name("fake_server.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_argv(port: int, pid_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, str(FAKE_SERVER), "--port", str(port), "--pid-dir", str(pid_dir), *extra]


def pids_of(pid_dir: Path, port: int) -> list[int]:
    """Every pid that ever served ``port`` (a restart adds one)."""
    return sorted(int(p.name.split(".")[1]) for p in pid_dir.glob(f"{port}.*"))


@pytest.fixture
def make_child(tmp_path: Path):
    """``make_child(name, *extra)``: a fake server Child on a free port; all are stopped afterwards."""
    children: list[Child] = []
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()

    def make(name: str, *extra: str) -> Child:
        port = free_port()
        child = Child(name, fake_argv(port, pid_dir, *extra), {}, tmp_path / f"{name}.log",
                      f"http://127.0.0.1:{port}/health")
        children.append(child)
        return child

    make.pid_dir = pid_dir  # type: ignore[attr-defined]
    yield make
    stop_all(children, grace_s=5)


@pytest.fixture
def fake_launch(tmp_path: Path, monkeypatch):
    """Patch vLLM and the proxy into fake servers; return (args builder, pid dir). A flag given to the
    builder wins over the free ports it picks."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({}))
    monkeypatch.setattr(instance, "vllm_argv", lambda _model, port, *_extra, **_kw: fake_argv(port, pid_dir))

    def fake_proxy(args, log_dir: Path) -> Child:
        return Child("proxy", fake_argv(args.proxy_port, pid_dir), {}, log_dir / "proxy.log",
                     f"http://127.0.0.1:{args.proxy_port}/health")

    monkeypatch.setattr(launch, "proxy_child", fake_proxy)
    monkeypatch.setattr(launch, "wait_registered", lambda *a, **k: None)
    old_term, old_int = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    yield lambda *extra: build_parser().parse_args([
        "launch", "--model", str(model), "--log-dir", str(tmp_path / "logs"), "--proxy-port", str(free_port()),
        "--prefill-port", str(free_port()), "--decode-port", str(free_port()), "--startup-timeout-s", "60",
        "--proxy-control-port", str(free_port()), "--kv-port", str(free_port()),
        *extra]), pid_dir
    signal.signal(signal.SIGTERM, old_term)
    signal.signal(signal.SIGINT, old_int)


class StubHandler(http.server.BaseHTTPRequestHandler):
    """A stand-in HTTP server's handler: ``routes`` maps (method, path) to a body; anything else is 404."""

    routes: dict[tuple[str, str], str] = {}

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._answer("GET")

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._answer("POST")

    def _answer(self, method: str) -> None:
        body = self.routes.get((method, self.path))
        data = (body or "").encode()
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_args: object) -> None:
        pass


@pytest.fixture
def stub_server() -> Callable[[dict[tuple[str, str], str]], str]:
    """``stub_server(routes)``: serve ``routes`` (see StubHandler) on a free port; its base URL."""
    servers: list[http.server.HTTPServer] = []

    def serve(routes: dict[tuple[str, str], str]) -> str:
        handler = type("Routes", (StubHandler,), {"routes": dict(routes)})
        server = http.server.HTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield serve
    for server in servers:
        server.shutdown()


class Health(http.server.BaseHTTPRequestHandler):
    """What LMCache's HTTP API answers on /healthcheck: 503 until its engine is up, then 200 (``status``)."""

    status = 503
    delay_s = 0.0  # before each answer: a busy server

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        time.sleep(type(self).delay_s)
        self.send_response(type(self).status)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def health() -> Iterator[tuple[type[Health], int]]:
    """A fake LMCache HTTP API on a free port: its handler class (set ``status``) and its port."""
    handler = type("H", (Health,), {"status": 503, "delay_s": 0.0})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="fake-lmcache-http", daemon=True)
    thread.start()
    try:
        yield handler, server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
