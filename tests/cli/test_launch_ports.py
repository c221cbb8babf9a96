"""The launcher's readiness: every port checked before anything starts, and a child counted up only
when the answer on its port comes from the child itself."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_p2p.cli import launch, ports
from lmcache_p2p.cli.main import build_parser
from lmcache_p2p.cli.processes import Child, StartupError, wait_healthy
from .conftest import FAKE_SERVER, fake_argv, free_port, pids_of


@pytest.fixture
def held_port():
    """A port this test process listens on (as a server of another deployment would)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture
def foreign_server(tmp_path: Path):
    """A server the launcher did not start, answering GET /health with 200 on its port."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(FAKE_SERVER), "--port", str(port)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and "fake server pid" in proc.stdout.readline()
    yield port, proc.pid
    proc.kill()
    proc.wait(10)


def test_every_port_is_planned_with_what_it_is_for() -> None:
    args = build_parser().parse_args(["launch", "--prefill", "1", "--decode", "2", "--transport", "nccl",
                                      "--vllm-arg=--tensor-parallel-size=2"])
    uses = {u.port: u.purpose for u in launch.planned_ports(args)}
    assert uses[9100] == "the proxy's HTTP (--proxy-port)"
    assert uses[9101] == "the proxy's registry (--proxy-control-port)"
    assert "prefiller-0's HTTP" in uses[7100] and "decoder-1's HTTP" in uses[7201]
    assert "decoder-0 rank 1's KV control port" in uses[7301]
    assert "decoder-1 rank 0's KV control port" in uses[7310]
    assert "decoder-0 rank 0's NCCL store" in uses[7400] and "decoder-1 rank 1's NCCL store" in uses[7411]
    nixl = build_parser().parse_args(["launch"])
    assert 7400 not in {u.port for u in launch.planned_ports(nixl)}  # NIXL listens on no transport port


def test_a_held_port_is_named_with_its_holder() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(StartupError) as err:
            ports.check_ports_free([ports.PortUse(port, "decoder-0's HTTP (--decode-port)")])
    message = str(err.value)
    assert f"port {port} for decoder-0's HTTP (--decode-port) is in use by pid {os.getpid()} (" in message
    assert "nothing was started" in message


def test_a_port_planned_twice_is_refused() -> None:
    with pytest.raises(StartupError, match="port 7201 is planned twice: a and b"):
        ports.check_ports_free([ports.PortUse(7201, "a"), ports.PortUse(7201, "b")])


def test_launch_refuses_to_start_anything_when_a_port_is_held(fake_launch, held_port, caplog) -> None:
    build, pid_dir = fake_launch
    args = build("--kv-port", str(held_port))

    assert launch.run(args) == 1

    assert list(pid_dir.iterdir()) == []  # not even the proxy was started
    assert f"port {held_port} for decoder-0 rank 0's KV control port (--kv-port) is in use by pid {os.getpid()}" \
        in caplog.text


def test_a_foreign_server_on_the_childs_port_is_not_counted_up(tmp_path, foreign_server) -> None:
    port, foreign_pid = foreign_server
    child = Child("decoder-0", [sys.executable, "-c", "import time; time.sleep(60)"], {}, tmp_path / "d.log",
                  f"http://127.0.0.1:{port}/health")
    child.start()
    try:
        with pytest.raises(StartupError) as err:
            wait_healthy([child], timeout_s=30)
    finally:
        child.stop(grace_s=5)
    assert f"decoder-0: port {port} is answered by pid {foreign_pid} (" in str(err.value)
    assert f"not by the child the launcher started (pid {child.proc.pid})" in str(err.value)


def test_the_childs_own_server_is_counted_up(tmp_path) -> None:
    port = free_port()
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    child = Child("prefiller-0", fake_argv(port, pid_dir), {}, tmp_path / "p.log", f"http://127.0.0.1:{port}/health")
    child.start()
    try:
        wait_healthy([child], timeout_s=30)
        assert child.healthy() and pids_of(pid_dir, port) == [child.proc.pid]
    finally:
        child.stop(grace_s=5)


def test_a_server_the_child_started_in_its_own_session_is_counted_up(tmp_path) -> None:
    """The proxy's relay workers: the child's children, each in a session of its own, listen on its port."""
    port = free_port()
    spawn = ("import subprocess, sys, time; subprocess.Popen([sys.executable, sys.argv[1], '--port', sys.argv[2]], "
             "start_new_session=True, stdout=subprocess.DEVNULL); time.sleep(60)")
    child = Child("proxy", [sys.executable, "-c", spawn, str(FAKE_SERVER), str(port)], {}, tmp_path / "p.log",
                  f"http://127.0.0.1:{port}/health")
    child.start()
    try:
        wait_healthy([child], timeout_s=30)
        (worker,) = ports.holders_of(port)
        assert worker.pid != child.proc.pid and os.getsid(worker.pid) == worker.pid and child.healthy()
    finally:
        for holder in ports.holders_of(port):
            os.kill(holder.pid, 9)
        child.stop(grace_s=5)
