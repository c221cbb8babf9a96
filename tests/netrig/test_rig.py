"""The multi-host rig itself (no vLLM): hosts reach each other through the router, a partition drops
one pair only, a cut link isolates a host until it is restored, everything is deleted afterwards
(also after a failure), and a Gloo sender configured on loopback pairs from its route's address."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from rig import NETNS_DIR, NetRig, unavailable

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

ECHO = ("import socket,sys\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
        "s.bind((sys.argv[1],5000));s.listen()\nwhile True:\n c,_=s.accept();c.sendall(b'hi');c.close()")


REACH_S = 10.0  # a reach expected to succeed: a loaded machine's echo server and emulator may answer late
UNREACHABLE_S = 1.5  # a reach expected to fail: its packets are dropped, so it ends at this timeout


def _reaches(rig: NetRig, src: str, dst: str, timeout_s: float = REACH_S) -> bool:
    with rig.inside(src):
        try:
            with socket.create_connection((rig.addr(dst), 5000), timeout=timeout_s) as c:
                return c.recv(2) == b"hi"
        except OSError:
            return False


@pytest.fixture(scope="module")
def rig():
    with NetRig(["a", "b", "c"]) as built:
        server = subprocess.Popen(built.argv("b", [sys.executable, "-c", ECHO, built.addr("b")]))
        try:
            _wait_listening(built, server)
            yield built
        finally:
            server.kill()
            server.wait(10)


def _wait_listening(rig: NetRig, server: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Until the echo server on ``b`` answers ``a`` (a loaded machine can take seconds to start it: the tests
    below would then fail as unreachable)."""
    deadline = time.monotonic() + timeout_s
    while not _reaches(rig, "a", "b"):
        assert server.poll() is None, f"the echo server exited with {server.returncode}"
        assert time.monotonic() < deadline, f"the echo server on b did not answer within {timeout_s:.0f} s"
        time.sleep(0.1)


def test_hosts_have_their_own_addresses_and_reach_each_other(rig):
    assert len({rig.addr(h) for h in rig.hosts}) == 3
    assert all(rig.addr(h).startswith("198.18.") for h in rig.hosts)
    assert _reaches(rig, "a", "b") and _reaches(rig, "c", "b")


def test_a_partition_drops_one_pair_only_and_heals(rig):
    rig.partition("a", "b")
    try:
        assert not _reaches(rig, "a", "b", UNREACHABLE_S)
        assert _reaches(rig, "c", "b")
        assert rig.emulator_counts()["blocked"] > 0
    finally:
        rig.heal()
    assert _reaches(rig, "a", "b")


def test_a_cut_link_isolates_the_host_until_restored(rig):
    rig.cut("b")
    try:
        assert not _reaches(rig, "a", "b", UNREACHABLE_S) and not _reaches(rig, "c", "b", UNREACHABLE_S)
    finally:
        rig.restore("b")
    assert _reaches(rig, "a", "b", timeout_s=5)


def test_loss_drops_packets_yet_tcp_delivers(rig):
    rig.impair(loss=0.3)
    try:
        assert any(_reaches(rig, "a", "b", timeout_s=10) for _ in range(3))
        assert rig.emulator_counts()["lost"] > 0
    finally:
        rig.heal()


def test_a_gloo_sender_on_loopback_pairs_from_its_route_towards_the_peer(rig):
    from lmcache_p2p.transport.nccl.group import local_address_towards

    with rig.inside("a"):
        assert local_address_towards("127.0.0.1", rig.addr("b")) == rig.addr("a")
        assert local_address_towards("127.0.0.1", "127.0.0.1") == "127.0.0.1"


def test_everything_is_deleted_also_after_a_failure():
    with pytest.raises(RuntimeError, match="inside"):
        with NetRig(["x", "y"]) as rig:
            names = [rig.router, rig.ns("x"), rig.ns("y")]
            assert all((NETNS_DIR / n).exists() for n in names)
            raise RuntimeError("inside")
    assert not any((NETNS_DIR / n).exists() for n in names)


def test_an_instance_beyond_loopback_runs_ucx_on_the_device_holding_its_address(rig, monkeypatch):
    from lmcache_p2p.cli.vllm_env import net_device_of, ucx_devices_for

    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    with rig.inside("a"):
        assert net_device_of(rig.addr("a")) == "eth0"
        assert net_device_of("127.0.0.1") == "lo"
        assert ucx_devices_for(rig.addr("a")) == {"UCX_NET_DEVICES": "eth0"}
        assert ucx_devices_for("127.0.0.1") == {}  # the launcher's default, lo
        assert ucx_devices_for(rig.addr("a"), {"UCX_NET_DEVICES": "mlx5_0:1"}) == {}  # the user's choice wins
