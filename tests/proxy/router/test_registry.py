from __future__ import annotations

import logging

import msgspec
import pytest

from lmcache_p2p.config import Role
from lmcache_p2p.errors import ProtocolError, VersionError
from lmcache_p2p.protocol import PROTOCOL_VERSION, Announce, Fingerprint, Goodbye
from lmcache_p2p.proxy.router.registry import (Health, Instance, InstanceState, Lease, RankInfo, Registry,
                                               StaticInstance)


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def announce(instance_id: str = "d1", *, rank: int = 0, tp: int = 1, role: str = "receiver", free: int = 10,
             capacity: int = 10, url: str = "http://127.0.0.1:8200", version: int = PROTOCOL_VERSION,
             fingerprint: Fingerprint | None = None) -> Announce:
    return Announce(version=version, instance_id=instance_id, role=role, http_url=url, tp_rank=rank, tp_size=tp,
                    control_host="127.0.0.1", control_port=7300 + rank, transport_port=7400 + rank,
                    capacity_slots=capacity, free_slots=free, slot_bytes=1 << 20, chunk_tokens=256,
                    fingerprint=fingerprint)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def registry(clock: Clock) -> Registry:
    """Health probes succeed at once (health gating has its own tests below)."""
    reg = Registry(ttl_s=5.0, clock=clock)
    reg.on_pending.append(reg.mark_up)
    return reg


class Events:
    """What the registry told its listeners (as the health prober and the cancel sockets hear it)."""

    def __init__(self, registry: Registry) -> None:
        self.pending: list[Instance] = []
        self.forgotten: list[Instance] = []
        registry.on_pending.append(self.pending.append)
        registry.on_forgotten.append(self.forgotten.append)


@pytest.fixture
def gated(clock: Clock) -> tuple[Registry, Events]:
    reg = Registry(ttl_s=5.0, clock=clock, max_connect_failures=2)
    return reg, Events(reg)


def test_ranks_aggregate_and_an_instance_is_routable_once_every_rank_announced(registry):
    registry.announce(announce(rank=1, tp=2))
    assert registry.routable(Role.RECEIVER) == []
    inst = registry.announce(announce(rank=0, tp=2))
    assert registry.routable(Role.RECEIVER) == [inst]
    assert inst.control_ports == [7300, 7301] and inst.transport_ports == [7400, 7401]
    assert registry.routable(Role.SENDER) == []


def test_decoder_without_receiver_ports_is_not_routable(registry):
    msg = Announce(version=PROTOCOL_VERSION, instance_id="d1", role="receiver", http_url="http://x:1", tp_rank=0,
                   tp_size=1)
    registry.announce(msg)
    assert registry.routable(Role.RECEIVER) == []


def test_control_host_defaults_to_the_http_host(registry):
    msg = Announce(version=PROTOCOL_VERSION, instance_id="d1", role="receiver", http_url="http://10.1.2.3:8200",
                   tp_rank=0, tp_size=1, control_port=7300, transport_port=7400)
    assert registry.announce(msg).control_host == "10.1.2.3"


def test_ttl_evicts_an_instance_when_any_rank_stops_heartbeating(registry, clock):
    registry.announce(announce(rank=0, tp=2))
    registry.announce(announce(rank=1, tp=2))
    clock.now_s += 4
    registry.announce(announce(rank=0, tp=2))  # rank 1 stays silent
    assert len(registry.routable(Role.RECEIVER)) == 1
    clock.now_s += 1.5
    assert registry.routable(Role.RECEIVER) == []
    assert registry.instances() == []


def test_heartbeats_keep_an_instance(registry, clock):
    for _ in range(5):
        registry.announce(announce())
        clock.now_s += 4
    assert len(registry.routable(Role.RECEIVER)) == 1


def test_goodbye_drains_then_forgets(registry):
    inst = registry.announce(announce())
    lease = registry.lease(inst, tokens=100)
    registry.goodbye(Goodbye(instance_id="d1"))
    assert inst.state is InstanceState.DRAINING
    assert registry.routable(Role.RECEIVER) == []
    assert registry.instances() == [inst]  # in-flight work continues
    lease.release()
    assert registry.instances() == []
    lease.release()  # idempotent
    assert inst.inflight_requests == 0 and inst.inflight_tokens == 0


def test_goodbye_without_work_forgets_at_once_and_unknown_goodbye_is_harmless(registry):
    registry.announce(announce())
    registry.goodbye(Goodbye(instance_id="d1"))
    assert registry.instances() == []
    assert registry.goodbye(Goodbye(instance_id="nobody")) is None


def test_restart_after_goodbye_is_active_again_only_when_every_rank_is_back(registry):
    for rank in (0, 1):
        registry.announce(announce(rank=rank, tp=2))
    inst = registry.routable(Role.RECEIVER)[0]
    lease = registry.lease(inst, tokens=1)
    registry.goodbye(Goodbye(instance_id="d1", tp_rank=0))
    registry.goodbye(Goodbye(instance_id="d1", tp_rank=1))
    registry.announce(announce(rank=0, tp=2))
    assert registry.routable(Role.RECEIVER) == []
    registry.announce(announce(rank=1, tp=2))
    assert registry.routable(Role.RECEIVER) == [inst]
    lease.release()
    assert registry.instances() == [inst]


def test_static_instance_never_expires_and_yields_to_an_announced_one(registry, clock):
    static = registry.add_static(StaticInstance(Role.RECEIVER, "http://127.0.0.1:8200", "127.0.0.1", (7300,),
                                                (7400,)))
    assert registry.routable(Role.RECEIVER) == [static]
    live = registry.announce(announce(url="http://127.0.0.1:8200/"))
    assert registry.routable(Role.RECEIVER) == [live]
    clock.now_s += 60
    assert registry.routable(Role.RECEIVER) == [static]


def test_one_url_may_be_a_static_prefiller_and_a_static_decoder(registry):
    prefiller = registry.add_static(StaticInstance(Role.SENDER, "http://127.0.0.1:8200"))
    decoder = registry.add_static(StaticInstance(Role.RECEIVER, "http://127.0.0.1:8200", "127.0.0.1", (1,), (2,)))
    assert registry.routable(Role.SENDER) == [prefiller] and registry.routable(Role.RECEIVER) == [decoder]


def test_promised_slots_count_until_a_heartbeat_after_the_kv_settled(registry, clock):
    inst = registry.announce(announce(free=10))
    lease = registry.lease(inst, tokens=1000, chunks=4)
    assert inst.free_slots() == 6
    clock.now_s += 1
    registry.announce(announce(free=10))  # the receiver has not reserved yet
    assert inst.free_slots() == 6
    lease.settle()
    assert inst.free_slots() == 6
    clock.now_s += 1
    registry.announce(announce(free=6))  # this heartbeat reflects the request
    assert inst.free_slots() == 6
    clock.now_s += 1
    lease.release()
    assert inst.free_slots() == 6  # the announcement holds it: free once the decoder says so
    clock.now_s += 1
    registry.announce(announce(free=10))
    assert inst.free_slots() == 10 and inst.commits == []


def test_returned_credit_is_never_counted_free_twice(registry, clock):
    inst = registry.announce(announce(free=8, capacity=8))
    credit_changes = []
    registry.on_credit.append(lambda: credit_changes.append(inst.free_slots()))
    a = registry.lease(inst, tokens=10, chunks=4)
    b = registry.lease(inst, tokens=10, chunks=4)
    assert inst.free_slots() == 0
    a.return_credit()  # its KV was loaded (or cancelled) before any heartbeat held it
    assert inst.free_slots() == 4 and credit_changes == [4]
    a.return_credit()  # idempotent
    a.release()
    assert inst.free_slots() == 4 and a.chunks == 4
    b.settle()
    clock.now_s += 1
    registry.announce(announce(free=4, capacity=8))  # holds b
    assert inst.free_slots() == 4
    clock.now_s += 1
    clock.now_s += 1
    registry.announce(announce(free=8, capacity=8))  # the decoder loaded b's KV and announced it at once
    assert inst.free_slots() == 8
    clock.now_s += 1
    b.return_credit()  # the first output arrives after that announcement: b's slots are not added again
    assert inst.free_slots() == 8
    clock.now_s += 1
    registry.announce(announce(free=8, capacity=8))
    b.release()
    assert inst.free_slots() == 8 and inst.commits == []


def test_credit_listeners_hear_of_heartbeats_releases_and_new_instances(registry):
    heard = []
    registry.on_credit.append(lambda: heard.append(1))
    inst = registry.announce(announce())
    assert heard
    heard.clear()
    lease = registry.lease(inst, tokens=1, chunks=1)
    assert not heard  # a new promise frees nothing
    lease.release()
    assert heard


def test_fingerprint_is_kept_and_mismatched_pairs_are_logged_once(registry, caplog):
    fp = Fingerprint(model="m", num_layers=2, kv_heads=2, head_size=32, dtype="bfloat16", chunk_tokens=256,
                     tp_size=1, tp_rank=0, kv_format="KV_2LTD")
    decoder = registry.announce(announce("d1", fingerprint=fp))
    same = registry.announce(announce("p1", role="sender", url="http://p1:1", fingerprint=fp))
    other = registry.announce(announce("p2", role="sender", url="http://p2:1",
                                       fingerprint=msgspec.structs.replace(fp, model="n", dtype="float16")))
    unknown = registry.announce(announce("p3", role="sender", url="http://p3:1"))
    assert decoder.fingerprint == fp and unknown.fingerprint is None
    assert registry.compatible(same, decoder) and registry.compatible(unknown, decoder)
    with caplog.at_level(logging.WARNING, logger="lmcache_p2p.proxy.router.registry"):
        assert not registry.compatible(other, decoder)
        assert not registry.compatible(other, decoder)
    mismatch, = [r for r in caplog.records if "never paired" in r.getMessage()]
    assert "p2" in mismatch.getMessage() and "d1" in mismatch.getMessage()
    assert "model: decoder 'm', prefiller 'n'" in mismatch.getMessage()
    assert "dtype: decoder 'bfloat16', prefiller 'float16'" in mismatch.getMessage()


def test_other_weights_under_the_same_model_name_are_never_paired(registry, caplog):
    fp = Fingerprint(model="/models/llama", num_layers=2, kv_heads=2, head_size=32, dtype="bfloat16",
                     chunk_tokens=256, tp_size=1, tp_rank=0, kv_format="KV_2LTD", weights="files:aa")
    decoder = registry.announce(announce("d1", fingerprint=fp))
    tuned = registry.announce(announce("p1", role="sender", url="http://p1:1",
                                       fingerprint=msgspec.structs.replace(fp, weights="files:bb")))
    older = registry.announce(announce("p2", role="sender", url="http://p2:1",
                                       fingerprint=msgspec.structs.replace(fp, weights="")))
    with caplog.at_level(logging.WARNING, logger="lmcache_p2p.proxy.router.registry"):
        assert not registry.compatible(tuned, decoder)
    assert "weights: decoder 'files:aa', prefiller 'files:bb'" in caplog.text
    assert registry.compatible(older, decoder)  # a peer that cannot tell its weights: the other fields decide


def test_a_tp_rank_alone_is_no_mismatch(registry):
    fp = Fingerprint(model="m", num_layers=2, kv_heads=2, head_size=32, dtype="bfloat16", chunk_tokens=256,
                     tp_size=2, tp_rank=0, kv_format="KV_2LTD")
    decoder = registry.announce(announce("d1", rank=1, tp=2, fingerprint=msgspec.structs.replace(fp, tp_rank=1)))
    prefiller = registry.announce(announce("p1", role="sender", url="http://p1:1", tp=2, fingerprint=fp))
    assert registry.compatible(prefiller, decoder)


@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (1, 2), (4, 2), (2, 4)])
def test_tp_sizes_that_divide_each_other_are_paired(registry, p_tp, d_tp):
    fp = Fingerprint(model="m", num_layers=2, kv_heads=4 // p_tp, head_size=32, dtype="bfloat16",
                     chunk_tokens=256, tp_size=p_tp, tp_rank=0, kv_format="KV_2LTD", kv_heads_total=4)
    decoder = registry.announce(announce("d1", tp=d_tp, fingerprint=msgspec.structs.replace(
        fp, tp_size=d_tp, kv_heads=4 // d_tp)))
    prefiller = registry.announce(announce("p1", role="sender", url="http://p1:1", tp=p_tp, fingerprint=fp))
    assert registry.compatible(prefiller, decoder)


@pytest.mark.parametrize("decoder_change, says", [
    ({"tp_size": 3, "kv_heads": 2, "kv_heads_total": 6}, "TP 2 and TP 3, neither divides the other"),
    ({"tp_size": 1, "kv_heads": 8, "kv_heads_total": 8}, "4 KV heads vs 8"),
    ({"tp_size": 1, "kv_heads": 1, "kv_heads_total": 1, "kv_format": "KV_MLA_FMT"}, "MLA on one side only"),
])
def test_irreconcilable_layouts_are_never_paired_and_the_log_names_both(registry, caplog, decoder_change, says):
    total = 6 if decoder_change["tp_size"] == 3 else 4
    fp = Fingerprint(model="m", num_layers=2, kv_heads=total // 2, head_size=32, dtype="bfloat16",
                     chunk_tokens=256, tp_size=2, tp_rank=0, kv_format="KV_2LTD", kv_heads_total=total)
    decoder = registry.announce(announce("d1", tp=decoder_change["tp_size"],
                                         fingerprint=msgspec.structs.replace(fp, **decoder_change)))
    prefiller = registry.announce(announce("p1", role="sender", url="http://p1:1", tp=2, fingerprint=fp))
    with caplog.at_level(logging.WARNING, logger="lmcache_p2p.proxy.router.pairing"):
        assert not registry.compatible(prefiller, decoder)
    assert says in caplog.text and "prefiller KV heads [0, " in caplog.text and "decoder " in caplog.text


def test_resize_commit_replaces_the_estimate(registry):
    inst = registry.announce(announce(free=10))
    lease = registry.lease(inst, tokens=10, chunks=2)
    lease.resize_commit(5)
    assert inst.free_slots() == 5


def test_static_decoder_commits_do_not_accumulate(registry):
    static = registry.add_static(StaticInstance(Role.RECEIVER, "http://h:1", "h", (1,), (2,)))
    for _ in range(3):
        registry.lease(static, tokens=10, chunks=3).release()
    assert static.commits == [] and static.free_slots() is None


def test_bad_announces_raise(registry):
    with pytest.raises(VersionError, match="protocol 99"):
        registry.announce(announce(version=99))
    with pytest.raises(ProtocolError, match="role 'router'"):
        registry.announce(announce(role="router"))
    with pytest.raises(ProtocolError, match="tp_rank 2"):
        registry.announce(announce(rank=2, tp=2))
    assert registry.instances() == []


# ---- health gating -------------------------------------------------------------------------------


def test_an_instance_is_routable_only_once_its_health_probe_succeeded(gated):
    registry, events = gated
    inst = registry.announce(announce())
    static = registry.add_static(StaticInstance(Role.SENDER, "http://127.0.0.1:8100"))
    assert events.pending == [inst, static] and inst.health is Health.PENDING
    assert registry.routable(Role.RECEIVER) == [] and registry.routable(Role.SENDER) == []
    registry.announce(announce())  # a heartbeat is no reason to probe again
    assert events.pending == [inst, static]
    registry.mark_up(inst)
    registry.mark_up(static)
    assert registry.routable(Role.RECEIVER) == [inst] and registry.routable(Role.SENDER) == [static]


def test_failed_connections_in_a_row_take_an_instance_out_until_a_probe_succeeds(gated):
    registry, events = gated
    inst = registry.announce(announce())
    registry.mark_up(inst)
    inst.makes_text = True  # an answer of it had text
    registry.note_connect_failure(inst)
    registry.note_connected(inst)  # a success resets the count
    registry.note_connect_failure(inst)
    assert registry.routable(Role.RECEIVER) == [inst] and inst.makes_text
    registry.note_connect_failure(inst)
    assert inst.health is Health.DOWN and registry.routable(Role.RECEIVER) == []
    assert not inst.makes_text  # it may come back restarted, without a tokenizer
    assert events.pending == [inst, inst]  # probed again
    registry.note_connect_failure(inst)  # in-flight requests failing too: no further probe asked for
    assert events.pending == [inst, inst]
    registry.mark_up(inst)
    assert registry.routable(Role.RECEIVER) == [inst] and inst.connect_failures == 0


def test_a_restart_after_goodbye_or_a_new_url_is_probed_again(gated):
    registry, events = gated
    inst = registry.announce(announce())
    registry.mark_up(inst)
    inst.makes_text = True
    registry.lease(inst, tokens=1)  # keeps it registered while draining
    registry.goodbye(Goodbye(instance_id="d1"))
    registry.announce(announce())  # its process restarted: the HTTP server is not up yet
    assert inst.state is InstanceState.ACTIVE and inst.health is Health.PENDING and not inst.makes_text
    assert registry.routable(Role.RECEIVER) == []
    registry.mark_up(inst)
    inst.makes_text = True
    registry.announce(announce(url="http://127.0.0.1:8201"))
    assert inst.health is Health.PENDING and events.pending == [inst, inst, inst] and not inst.makes_text


def test_listeners_hear_of_every_instance_the_registry_forgets(gated, clock):
    registry, events = gated
    drained = registry.announce(announce("a"))
    replaced = registry.announce(announce("b"))
    expired = registry.announce(announce("c"))
    registry.goodbye(Goodbye(instance_id="a"))
    registry.announce(announce("b", role="sender"))
    clock.now_s += 4
    registry.announce(announce("b", role="sender"))
    clock.now_s += 2
    registry.evict_expired()
    assert events.forgotten == [drained, replaced, expired]


def test_operator_drain_keeps_a_live_instance_out_until_it_stops(registry, clock):
    d1 = registry.announce(announce("d1"))
    d2 = registry.announce(announce("d2", url="http://127.0.0.1:8201"))
    lease = registry.lease(d1, tokens=100)
    assert registry.drain("d1") is d1
    assert registry.routable(Role.RECEIVER) == [d2]  # no new work ...
    assert d1 in registry.instances()  # ... while its request finishes
    lease.release()
    assert d1 not in registry.instances()
    clock.now_s += 2
    assert registry.announce(announce("d1")) is None  # its heartbeats do not bring it back
    assert registry.routable(Role.RECEIVER) == [d2]
    clock.now_s += 6  # silent for the TTL: it was stopped; a new start registers again
    registry.evict_expired()
    assert registry.announce(announce("d1")) is not None
    assert registry.drain("unknown") is None


def test_a_static_instance_is_never_paired_and_is_logged_once(registry, caplog):
    static = registry.add_static(StaticInstance(Role.RECEIVER, "http://127.0.0.1:8200", "127.0.0.1", (7300,),
                                                (7400,)))
    prefiller = registry.announce(announce("p1", role="sender", url="http://p1:1"))
    with caplog.at_level(logging.WARNING, logger="lmcache_p2p.proxy.router.registry"):
        assert registry.plugin_running(prefiller) and not registry.plugin_running(static)
        assert not registry.compatible(prefiller, static) and not registry.compatible(prefiller, static)
    logged, = [r.getMessage() for r in caplog.records if "LMCache plugin" in r.getMessage()]
    assert static.instance_id in logged and "never paired" in logged and "p2p.proxy_url" in logged
    plugged = registry.announce(announce("d1", url="http://127.0.0.1:8200"))  # its plugin announces: it takes over
    assert registry.routable(Role.RECEIVER) == [plugged] and registry.compatible(prefiller, plugged)


def test_an_instance_whose_ranks_stop_announcing_is_no_longer_paired(registry, clock):
    static = registry.add_static(StaticInstance(Role.RECEIVER, "http://127.0.0.1:8200", "127.0.0.1", (7300,),
                                                (7400,)))
    prefiller = registry.announce(announce("p1", role="sender", url="http://p1:1"))
    for rank in (0, 1):
        decoder = registry.announce(announce("d1", rank=rank, tp=2, url="http://127.0.0.1:8200"))
    assert registry.compatible(prefiller, decoder)
    clock.now_s += 6.0  # past the TTL: rank 1 went silent, rank 0 and the prefiller still announce
    registry.announce(announce("p1", role="sender", url="http://p1:1"))
    registry.announce(announce("d1", rank=0, tp=2, url="http://127.0.0.1:8200"))
    assert not registry.plugin_running(decoder) and not registry.compatible(prefiller, decoder)
    assert registry.routable(Role.RECEIVER) == [static]  # evicted; the static entry is back, still unpaired
    assert not registry.compatible(prefiller, static)


def test_an_instance_keeps_its_own_load_from_hold_to_release():
    inst = Instance("d", Role.RECEIVER, "http://d", tp_size=1, ranks={0: RankInfo(0)})  # heard of since forever
    commit = inst.hold(tokens=30, chunks=2)
    assert (inst.inflight_requests, inst.inflight_tokens, inst.commits) == (1, 30, [commit])
    assert inst.return_credit(commit, now_s=1.0) and not inst.return_credit(commit, now_s=2.0)
    assert commit.returned_at_s == 1.0
    inst.release(30, commit, now_s=3.0)
    assert (inst.inflight_requests, inst.inflight_tokens, inst.commits) == (0, 0, [])
    assert inst.hold(tokens=5, chunks=0) is None  # no KV comes with it: load only


# ---- registrations by URL (vLLM's NixlConnector) with a TTL: a lease -----------------------------------------

def nixl(url: str = "http://10.0.0.9:7200") -> StaticInstance:
    from lmcache_p2p.proxy.settings import registration

    return registration("decoder", url)


def test_a_registration_with_a_ttl_expires_unless_registered_again(registry, clock, caplog):
    inst = registry.register(nixl(), ttl_s=30)
    for _ in range(4):  # each registration refreshes it: 80 s in all, never 30 s without one
        clock.now_s += 20
        assert registry.register(nixl(), ttl_s=30) is inst
        assert registry.routable(Role.RECEIVER) == [inst]
    clock.now_s += 30
    assert registry.routable(Role.RECEIVER) == [inst]  # a registration exactly ttl_s old still holds
    clock.now_s += 0.5
    with caplog.at_level(logging.INFO, logger="lmcache_p2p.proxy.router.registry"):
        assert registry.routable(Role.RECEIVER) == []
    assert registry.instances() == []  # idle: forgotten at once
    said = [r for r in caplog.records if "ttl_s" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert inst.instance_id in said[0].getMessage() and "ttl_s 30 s" in said[0].getMessage()


def test_a_registration_without_a_ttl_never_expires_and_each_registration_sets_the_ttl(registry, clock):
    forever = registry.register(nixl("http://10.0.0.8:7200"))  # a flag's, or a one-off call's
    leased = registry.register(nixl(), ttl_s=10)
    assert registry.register(nixl(), ttl_s=60) is leased  # a longer lease from now on
    clock.now_s += 50
    assert registry.routable(Role.RECEIVER) == [forever, leased]
    registry.register(nixl())  # registered again without one: it stays too
    clock.now_s += 1e6
    registry.evict_expired()
    assert registry.routable(Role.RECEIVER) == [forever, leased] and leased.registration_ttl_s is None


def expired_with_a_request(registry: Registry, clock: Clock) -> tuple[Instance, Lease]:
    """A registration of ``ttl_s`` 10 that routed a request, then was not renewed: the proxy's sweep found it."""
    inst = registry.register(nixl(), ttl_s=10)
    registry.mark_up(inst)
    lease = registry.lease(inst, tokens=100)
    clock.now_s += 11
    registry.evict_expired()  # no request has to come
    return inst, lease


def test_an_expired_registration_keeps_its_requests_out_of_new_work_until_they_end(gated, clock):
    registry, events = gated
    inst, lease = expired_with_a_request(registry, clock)
    assert inst.state is InstanceState.DRAINING and registry.routable(Role.RECEIVER) == []
    assert registry.instances() == [inst] and events.forgotten == []  # listed while its request finishes
    clock.now_s += 100
    registry.evict_expired()  # expired once: not drained again, still waiting for its request
    assert registry.instances() == [inst]
    lease.release()
    assert registry.instances() == [] and events.forgotten == [inst]


def test_registered_again_while_draining_out_it_is_active_again_and_after_it_left_it_is_new(gated, clock):
    registry, events = gated
    inst, lease = expired_with_a_request(registry, clock)
    assert registry.register(nixl(), ttl_s=10) is inst  # its sidecar was only late: the same instance, active
    assert inst.state is InstanceState.ACTIVE and registry.routable(Role.RECEIVER) == [inst]
    lease.release()
    assert registry.instances() == [inst]  # active: a released lease does not forget it
    clock.now_s += 11
    registry.evict_expired()
    assert registry.instances() == [] and events.forgotten == [inst]
    back = registry.register(nixl(), ttl_s=10)
    assert back is not inst and back.health is Health.PENDING and events.pending == [inst, back]
    assert registry.routable(Role.RECEIVER) == []  # probed again before it takes work
    registry.mark_up(back)
    assert registry.routable(Role.RECEIVER) == [back]
