from __future__ import annotations

import pytest

from lmcache_p2p.config import Role
from lmcache_p2p.protocol import PROTOCOL_VERSION, Announce
from lmcache_p2p.proxy.errors import NoCapacity, NoInstanceAvailable
from lmcache_p2p.proxy.registry import Registry
from lmcache_p2p.proxy.routing import Policy, RequestCost, Router, chunks_needed


def add(registry: Registry, name: str, *, role: str = "receiver", free: int = 100, capacity: int = 100,
        chunk_tokens: int = 256):
    inst = registry.announce(Announce(
        version=PROTOCOL_VERSION, instance_id=name, role=role, http_url=f"http://{name}:1", tp_rank=0, tp_size=1,
        control_host="127.0.0.1", control_port=7300, transport_port=7400, capacity_slots=capacity, free_slots=free,
        chunk_tokens=chunk_tokens))
    registry.mark_up(inst)  # as if its GET /health answered 200
    return inst


COST = RequestCost(prompt_tokens=1000, max_output_tokens=100)  # 4 chunks of 256


def test_chunks_needed():
    assert chunks_needed(1000, 256) == 4 and chunks_needed(1024, 256) == 4 and chunks_needed(1, 256) == 1
    assert chunks_needed(1000, 0) == 0


def test_round_robin_cycles_in_id_order():
    registry, router = Registry(10), Router(Policy.ROUND_ROBIN)
    for name in ("c", "a", "b"):
        add(registry, name)
    picks = [router.pick_decoder(registry.routable(Role.RECEIVER), COST).instance_id for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_least_loaded_picks_fewest_inflight_tokens_and_spreads_ties():
    registry, router = Registry(10), Router(Policy.LEAST_LOADED)
    a, b, c = (add(registry, n) for n in "abc")
    registry.lease(a, tokens=500)
    registry.lease(c, tokens=100)
    assert router.pick_decoder(registry.routable(Role.RECEIVER), COST) is b
    registry.lease(b, tokens=100)
    picks = {router.pick_decoder(registry.routable(Role.RECEIVER), COST).instance_id for _ in range(4)}
    assert picks == {"b", "c"}


def test_a_burst_does_not_oversubscribe_a_decoder_buffer():
    registry, router = Registry(10), Router(Policy.LEAST_LOADED)
    a = add(registry, "a", free=10)
    b = add(registry, "b", free=5)
    chosen = []
    for _ in range(3):  # 4 chunks each, no heartbeat in between
        d = router.pick_decoder(registry.routable(Role.RECEIVER), COST)
        registry.lease(d, tokens=COST.decode_tokens, chunks=4)
        chosen.append(d)
    assert chosen.count(a) == 2 and chosen.count(b) == 1
    with pytest.raises(NoCapacity, match="every decoder buffer is busy: the request needs 4 KV chunks"):
        router.pick_decoder(registry.routable(Role.RECEIVER), COST)


def test_buffer_fit_filter_skips_a_decoder_too_full_for_the_request():
    registry, router = Registry(10), Router(Policy.LEAST_LOADED)
    add(registry, "a", free=3)
    b = add(registry, "b", free=4)
    registry.lease(b, tokens=10_000)  # more loaded, but the only one that fits
    assert router.pick_decoder(registry.routable(Role.RECEIVER), COST) is b


def test_request_larger_than_every_buffer_names_the_setting():
    registry, router = Registry(10), Router(Policy.LEAST_LOADED)
    add(registry, "a", free=2, capacity=2)
    with pytest.raises(NoCapacity, match=r"needs 4 KV chunks .* holds 2 chunks: raise p2p.buffer_size") as info:
        router.pick_decoder(registry.routable(Role.RECEIVER), COST)
    assert info.value.status_code == 503


def test_no_instances_is_503():
    router = Router(Policy.LEAST_LOADED)
    with pytest.raises(NoInstanceAvailable, match="no decoder") as info:
        router.pick_decoder([], COST)
    assert info.value.status_code == 503
    with pytest.raises(NoInstanceAvailable, match="no prefiller"):
        router.pick_prefiller([])


def test_exclude_is_a_preference():
    registry, router = Registry(10), Router(Policy.LEAST_LOADED)
    a, b = add(registry, "a", role="sender"), add(registry, "b", role="sender")
    registry.lease(b, tokens=1000)
    assert router.pick_prefiller(registry.routable(Role.SENDER), exclude={"a"}) is b
    assert router.pick_prefiller([a], exclude={"a"}) is a


def test_a_decoder_that_recomputes_needs_no_buffer_room():
    registry, router = Registry(10), Router(Policy.LEAST_LOADED)
    full = add(registry, "a", free=0)
    assert router.pick_decoder(registry.routable(Role.RECEIVER), COST, needs_kv=False) is full
    with pytest.raises(NoCapacity):
        router.pick_decoder(registry.routable(Role.RECEIVER), COST)


def test_decoder_with_unknown_capacity_is_always_eligible():
    registry, router = Registry(10), Router(Policy.LEAST_LOADED)
    inst = add(registry, "a", free=0, capacity=0)
    assert router.pick_decoder(registry.routable(Role.RECEIVER), COST) is inst
