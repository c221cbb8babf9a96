"""The backend's reports to the proxy: a dropped heartbeat is tried again soon, never an interval later."""

from __future__ import annotations

import time
import types

import pytest

from lmcache_p2p import protocol
from lmcache_p2p.backend.announcer import Announcer

from engines import free_port
from fake_proxy import FakeProxy

pytestmark = pytest.mark.timeout(30)


def _announce() -> protocol.Announce:
    return protocol.Announce(protocol.PROTOCOL_VERSION, "decoder-x", "receiver", "http://127.0.0.1:8200", 0, 1,
                             "127.0.0.1", 7300, 7400)


def test_a_start_announcement_dropped_before_the_proxy_listens_is_sent_again_long_before_the_interval() -> None:
    """The first heartbeat races the TCP connect: the socket queues nothing until the proxy is
    connected, so it is dropped. The proxy must still hear of the instance at once, not a whole
    heartbeat interval (here 60 s) later."""
    port = free_port()
    announcer = Announcer(f"tcp://127.0.0.1:{port}", protocol.Codec(), interval_s=60)
    proxy = None
    try:
        assert announcer.heartbeat(_announce()) is False  # nobody listens: dropped, not queued
        proxy = FakeProxy(port=port)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the service thread's loop, as it calls the announcer
            if announcer.heartbeat_due() and announcer.heartbeat(_announce()):
                break
            time.sleep(0.01)
        assert proxy.recv(protocol.Announce, timeout_s=5).instance_id == "decoder-x"
        assert not announcer.heartbeat_due()  # sent: the next one is an interval away
    finally:
        announcer.close()
        if proxy is not None:
            proxy.close()


def test_dropped_heartbeats_back_off_doubling_up_to_the_interval_and_a_sent_one_resets_the_pace(monkeypatch):
    clock = types.SimpleNamespace(now=1000.0)  # the test's own monotonic clock
    sent: list[bool] = []
    announcer = Announcer(f"tcp://127.0.0.1:{free_port()}", protocol.Codec(), interval_s=0.5,
                          clock=lambda: clock.now)
    monkeypatch.setattr(announcer, "send", lambda msg: sent[-1])

    def gap_after(delivered: bool) -> float:
        sent.append(delivered)
        start = clock.now
        announcer.heartbeat(_announce())
        step = 0.001
        while not announcer.heartbeat_due():
            clock.now += step
        return clock.now - start

    try:
        assert [gap_after(False) for _ in range(6)] == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.5, 0.5], abs=0.002)
        assert gap_after(True) == pytest.approx(0.5, abs=0.002)
        assert gap_after(False) == pytest.approx(0.05, abs=0.002)  # the proxy went away again: retried at the fast pace from the start
    finally:
        announcer.close()
