"""Fake children for launcher tests: a tiny HTTP server stands in for vLLM and the proxy."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

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
