"""The long form of the multi-host tests (``make test-long``; marker ``long``).

Deployments across rig hosts, the shared secret on, each run once with its scenarios
(``net_scenarios.py``), each scenario judged by its own test:

- 1P2D over NIXL (UCX tcp): every network fault;
- 1P2D over Gloo (``transport: nccl`` on CPU): no fault, a decoder cut mid-transfer, the
  prefiller partitioned from a decoder, a decoder host restarted on the same address;
- 2P2D over NIXL and over Gloo: no fault (both prefillers, both decoders, outputs equal the
  plain instance's).

Each row must show: no request hung, no unclean error, no wrong output, no slot held once the
load settled, the deployment serving again (the victim routable after the network came back and
loading KV). Scenarios marked ``all_succeed`` (no fault, packet loss, added RTT) must succeed whole.

Run (holding the machine's vLLM lock; needs root):
    flock /tmp/lmcache_p2p_vllm.lock .venv/bin/python -m pytest -m long tests/netrig -s
"""

from __future__ import annotations

import pytest

from rig import NetRig, unavailable

pytestmark = [pytest.mark.vllm, pytest.mark.long, pytest.mark.timeout(7200)]

REASON = unavailable()
NIXL_1P2D = ["across_hosts", "decoder_cut_mid_transfer", "decoder_cut_mid_stream", "partition_proxy_decoder",
             "partition_prefiller_decoder", "packet_loss_1pct", "rtt_20ms", "decoder_host_restart_same_address"]
GLOO_1P2D = ["across_hosts", "decoder_cut_mid_transfer", "partition_prefiller_decoder",
             "decoder_host_restart_same_address"]
DEPLOYMENTS = {
    "1P2D-nixl": (1, 2, "nixl", NIXL_1P2D),
    "1P2D-gloo": (1, 2, "nccl", GLOO_1P2D),
    "2P2D-nixl": (2, 2, "nixl", ["across_hosts"]),
    "2P2D-gloo": (2, 2, "nccl", ["across_hosts"]),
}
CASES = [(dep, name) for dep, (*_, names) in DEPLOYMENTS.items() for name in names]


_RUN: dict[str, dict] = {}  # deployment -> its rows: pytest sets the fixture up again for each case


@pytest.fixture(scope="module")
def rows(request, tiny_model_dir, tmp_path_factory):
    if REASON:
        pytest.skip(REASON)
    if request.param in _RUN:
        return _RUN[request.param]
    from mh_cluster import CLIENT, hosts_for  # first: it puts tests/faults on sys.path
    from fault_suite import print_table
    from net_suite import open_deployment

    dep_name = request.param
    prefill, decode, transport, names = DEPLOYMENTS[dep_name]
    log_dir = tmp_path_factory.mktemp(f"multihost-{dep_name}")
    with NetRig(hosts_for(prefill, decode, single=False)) as rig, rig.inside(CLIENT):
        with open_deployment(rig, tiny_model_dir, log_dir, prefill=prefill, decode=decode, transport=transport,
                             long=True) as dep:
            for name in names:
                dep.run_named(name)
    print(f"\n{dep_name} across hosts, logs in {log_dir}")
    print_table(list(dep.rows.values()))
    _RUN[dep_name] = dep.rows
    return dep.rows


@pytest.mark.parametrize(("rows", "name"), CASES, indirect=["rows"], ids=[f"{d}-{n}" for d, n in CASES])
def test_scenario(rows, name):
    from net_scenarios import BY_NAME

    row = rows[name]
    assert not row.notes.startswith("harness error"), row.notes
    assert row.hung == 0, row
    assert row.unclean_errors == 0, row
    assert row.wrong_outputs == 0, row
    assert row.leaked_slots == 0 and row.held_slots_after_settle == 0, row
    if BY_NAME[name].all_succeed:
        assert row.succeeded == row.requests, row
    assert row.recovered, row
