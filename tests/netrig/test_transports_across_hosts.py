"""The transports between two rig hosts (no vLLM): NIXL over UCX tcp on each host's eth0, and the
NCCL transport on Gloo with the receiver's store on its host address and the sender left on its
default ``host`` (loopback), as a prefiller configured without ``p2p.host`` is. Scattered chunks land
byte for byte with one notification; writes towards a receiver whose host was cut off fail within
the transport's deadline instead of hanging. Each peer is ``tests/transport/transport_peer.py`` in
a spawned process that moved into its host's namespace first (``netpeer.serve_in``)."""

from __future__ import annotations

import multiprocessing
import sys
import uuid
from typing import Any

import pytest

import netpeer
from rig import NETNS_DIR, NetRig, unavailable

REASON = unavailable()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.long, pytest.mark.timeout(300)]

NIXL = "lmcache_p2p.transport.nixl.transport:NixlTransport"
NCCL = "lmcache_p2p.transport.nccl.transport:NcclTransport"
SLOT_BYTES = 2 << 20
SLOTS = 8
FILL = 0xA5


class Peer:
    def __init__(self, rig: NetRig, host: str, name: str, factory: str, env: dict, kwargs: dict) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=netpeer.serve_in, daemon=True,
                                   args=(str(NETNS_DIR / rig.ns(host)), child, env, factory, name, kwargs, "cpu", ""))
        self.process.start()
        child.close()
        self.reply("start", 60.0)

    def begin(self, op: str, *args: Any) -> None:
        self.conn.send((op, args))

    def reply(self, op: str, timeout_s: float = 60.0) -> Any:
        assert self.conn.poll(timeout_s), f"{self.name} did not answer {op} within {timeout_s}s"
        reply = self.conn.recv()
        assert reply[0] == "ok", f"{self.name} {op}: {reply[1:]}"
        return reply[1]

    def call(self, op: str, *args: Any, timeout_s: float = 60.0) -> Any:
        self.begin(op, *args)
        return self.reply(op, timeout_s)

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.call("exit", timeout_s=10)
            except (AssertionError, OSError, EOFError):
                pass
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)


@pytest.fixture(scope="module")
def rig():
    with NetRig(["tx", "rx"]) as built:
        yield built


@pytest.fixture(scope="module", params=["nixl-tcp", "nccl-gloo"])  # the cut test, last, ends its pair
def pair(request, rig):
    if netpeer.TRANSPORT_TESTS not in sys.path:
        sys.path.insert(0, netpeer.TRANSPORT_TESTS)
    import transport_peer

    if request.param == "nixl-tcp":
        factory, env, rx_kw, tx_kw = NIXL, {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0"}, {}, {}
    else:
        factory, env = NCCL, {}
        rx_kw = {"device": "cpu", "timeout_s": 10.0, "host": rig.addr("rx")}
        tx_kw = {"device": "cpu", "timeout_s": 10.0}  # host left at its default, 127.0.0.1
    tag = uuid.uuid4().hex[:8]
    peers = []
    try:
        rx = Peer(rig, "rx", f"rx-{tag}", factory, env, rx_kw)
        peers.append(rx)
        tx = Peer(rig, "tx", f"tx-{tag}", factory, env, tx_kw)
        peers.append(tx)
        rx_info = rx.call("setup", SLOT_BYTES * SLOTS, FILL)
        tx_info = tx.call("setup", 16 << 20, 0)
        rx.call("accept", tx_info)
        peer = tx.call("connect", rx_info, 20.0)
        base = transport_peer.decode_info(rx_info).regions[0].addr
        yield rx, tx, peer, base
    finally:
        rig.restore("rx")
        for p in reversed(peers):
            p.stop()


def test_chunks_land_exactly_across_hosts(pair):
    rx, tx, peer, base = pair
    chunks = [(13, 4093), (3 * SLOT_BYTES + 13, SLOT_BYTES - 13), (5 * SLOT_BYTES, 65536)]
    slots = [6, 1, 3]
    notif = f"n-{uuid.uuid4().hex}".encode()
    handle, digests = tx.call("write", peer, chunks, [base + s * SLOT_BYTES for s in slots], notif, True)
    rx.begin("notifications", 1, 20.0)
    tx.call("wait", handle, 20.0)
    assert rx.reply("notifications", 25.0) == [(tx.name, notif)]
    landed, stray = rx.call("check", [(s * SLOT_BYTES, n) for s, (_, n) in zip(slots, chunks)], FILL)
    assert landed == digests, "bytes in the receiver's slots differ from what was sent"
    assert stray == 0


def test_writes_to_a_cut_host_fail_within_their_deadline(pair, rig):
    rx, tx, peer, base = pair
    rig.cut("rx")
    err = tx.call("write_until_error", peer, SLOT_BYTES, base, 5.0, 60.0, timeout_s=90.0)
    assert err in ("TransportTimeout", "PeerUnreachable", "TransportError"), err
