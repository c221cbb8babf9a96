"""PD across hosts: the proxy, the prefiller and the decoder each on a network namespace of its own
(``rig.NetRig``), the client on another, the shared secret on, NIXL over UCX TCP.

The short form (CI, ``make test``): one 1P1D deployment across hosts. Instances announce their own
addresses to the proxy's registry on another host; every listener of ours binds its host's address;
greedy outputs through the proxy equal a plain vLLM instance with the same flags, with the prompt's
KV loaded on the decoder; then the decoder's host is cut off while streams run on it: every request
ends within its deadline (no hang), no slot stays held, no wrong output, and once the link is back
the decoder serves again within the proxy's instance TTL.

The long form (``make test-long``, or ``pytest -m long tests/netrig``): ``test_multihost_long.py``.
Both need root (network namespaces); without it they skip, saying so.
"""

from __future__ import annotations

import pytest

from rig import NetRig, unavailable

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

REASON = unavailable()


@pytest.fixture(scope="module")
def rig():
    if REASON:
        pytest.skip(REASON)
    from mh_cluster import hosts_for

    with NetRig(hosts_for(1, 1, single=False)) as built:
        yield built


@pytest.fixture(scope="module")
def deployment(rig, tiny_model_dir, tmp_path_factory):
    from mh_cluster import CLIENT
    from net_suite import open_deployment

    log_dir = tmp_path_factory.mktemp("multihost")
    with rig.inside(CLIENT):
        with open_deployment(rig, tiny_model_dir, log_dir, prefill=1, decode=1, transport="nixl") as dep:
            yield dep


def test_instances_announce_their_own_hosts_and_bind_only_them(rig, deployment):
    from net_suite import bound_listeners, registry_view

    view = registry_view(deployment)
    for name, inst in deployment.cluster.instances.items():
        assert view[name]["http_url"] == f"http://{rig.addr(name)}:{inst.http_port}"
        if inst.role == "decoder":
            assert view[name]["control_host"] == rig.addr(name)
    for host, ports in deployment.planned_listeners().items():
        bound = bound_listeners(rig, host)
        for port in ports:
            assert bound.get(port) == rig.addr(host), (host, port, bound)
        assert not [p for p, a in bound.items() if a in ("0.0.0.0", "::") and p in ports], bound


def test_outputs_equal_a_single_instance_with_kv_loaded_across_hosts(rig, deployment):
    from mh_cluster import CLIENT
    from net_suite import kv_loads_in

    with rig.inside(CLIENT):
        row = deployment.run_named("across_hosts")
    assert row.hung == 0 and row.wrong_outputs == 0, row
    assert row.succeeded == row.requests, row
    loads = kv_loads_in(row)
    assert loads and all(loaded > 0 for _, loaded in loads.values()), row.notes
    assert row.leaked_slots == 0 and row.held_slots_after_settle == 0, row


def test_decoder_host_cut_mid_stream_then_back(rig, deployment):
    from mh_cluster import CLIENT

    with rig.inside(CLIENT):
        row = deployment.run_named("decoder_cut_mid_stream")
    assert row.hung == 0 and row.unclean_errors == 0, row
    assert row.wrong_outputs == 0, row
    assert row.leaked_slots == 0 and row.held_slots_after_settle == 0, row
    assert row.recovered, row


def test_requests_sent_into_a_cut_decoder_do_not_wait_out_the_kv_timeout(rig, deployment):
    """The handover cannot happen: the proxy fails over (the prefiller continues) as soon as it knows the
    decoder is down, not after --kv-timeout-s."""
    from mh_cluster import CLIENT
    from net_scenarios import KV_TIMEOUT_S, into_cut_slowest_s

    with rig.inside(CLIENT):
        row = deployment.run_named("requests_into_a_cut_decoder")
    assert row.hung == 0 and row.unclean_errors == 0 and row.wrong_outputs == 0, row
    assert row.succeeded == row.requests, row
    slowest = into_cut_slowest_s(row.notes)
    assert slowest is not None and slowest < KV_TIMEOUT_S, row.notes
