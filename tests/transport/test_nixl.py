"""NixlTransport specifics beyond the shared contract: start-up failure, registering once,
refusing bad peers and bad writes.

Everything runs in ONE child process (UCX's environment is set there only) that records each
outcome; the tests below assert on them. Two transports in that process talk to each other.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHILD = r"""
import json, sys, time
import torch
from lmcache_p2p.errors import P2PError
from lmcache_p2p.protocol import TransportInfo
from lmcache_p2p.transport.nixl.transport import NixlTransport

out = {}

def outcome(name, call):
    try:
        value = call()
        out[name] = ["ok", repr(value)]
    except (P2PError, ValueError) as exc:
        out[name] = [type(exc).__name__, str(exc)]

bad = NixlTransport("bad", backend_params={"ucx_error_handling_mode": "peer"})  # builds: nothing opened yet
outcome("bad_backend_params", bad.start)
outcome("start_after_failed_start", bad.start)
bad.close(); bad.close()
a, b = NixlTransport("a").start(), NixlTransport("b").start()
out["start_again"] = a.start() is a
buf = torch.zeros(1 << 20, dtype=torch.uint8)
regions = [b.register(buf), b.register(buf), b.register(buf[100:200])]
out["register_once"] = [len({(r.addr, r.length) for r in regions}), len(b.info().regions)]
peer = a.connect(b.info(), 1.0)
out["connect_again"] = a.connect(b.info(), 1.0) == peer
base = regions[0].addr
src = torch.arange(256, dtype=torch.uint8)
handle = a.write(peer, [src], [base + 10], b"n")
a.wait(handle, 5.0)
out["notif"] = [(n.peer, n.payload.decode()) for n in b.wait_notifications(5.0)]
out["landed"] = bool(torch.equal(buf[10:266], src))
outcome("garbage_metadata", lambda: a.connect(TransportInfo(kind="nixl", name="zz", metadata=b"garbage"), 1.0))
outcome("wrong_kind", lambda: a.connect(TransportInfo(kind="nccl", name="zz"), 1.0))
outcome("outside_region", lambda: a.write(peer, [src], [base + (1 << 20) - 10], b""))
outcome("length_mismatch", lambda: a.write(peer, [src, src], [base], b""))
outcome("unknown_peer", lambda: a.write("nobody", [src], [base], b""))
outcome("strided_source", lambda: a.write(peer, [src[::2]], [base], b""))
a.close(); b.close()
json.dump(out, sys.stdout)
"""


@pytest.fixture(scope="module")
def outcomes() -> dict:
    env = dict(os.environ, UCX_TLS="sm,self")
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_failed_start_raises_transport_error_naming_the_param(outcomes: dict) -> None:
    kind, message = outcomes["bad_backend_params"]
    assert kind == "TransportError"
    assert "ucx_error_handling_mode" in message


def test_a_failed_start_closes_and_a_second_start_does_nothing(outcomes: dict) -> None:
    assert outcomes["start_after_failed_start"] == ["ClosedError", "NIXL transport 'bad' is closed; build a new one "
                                                                   "to start again"]
    assert outcomes["start_again"] is True


def test_a_tensor_is_registered_once(outcomes: dict) -> None:
    assert outcomes["register_once"] == [1, 1]


def test_connect_is_idempotent_and_writes_land(outcomes: dict) -> None:
    assert outcomes["connect_again"] is True
    assert outcomes["notif"] == [["a", "n"]]
    assert outcomes["landed"] is True


@pytest.mark.parametrize(
    ("case", "error"),
    [
        ("garbage_metadata", "PeerUnreachable"),
        ("wrong_kind", "PeerUnreachable"),
        ("unknown_peer", "PeerUnreachable"),
        ("outside_region", "ValueError"),
        ("length_mismatch", "ValueError"),
        ("strided_source", "ValueError"),
    ],
)
def test_bad_peers_and_bad_writes_are_refused(outcomes: dict, case: str, error: str) -> None:
    assert outcomes[case][0] == error, outcomes[case]
