"""Prompt prefixes in the proxy: LMCache's chunk hashes, the bounded per-instance index, the ``prefix`` policy."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lmcache_p2p.config import Role
from lmcache_p2p.protocol import PROTOCOL_VERSION, Announce
from lmcache_p2p.proxy.router.prefix import PrefixIndex, PrefixSettings, chunk_hashes, none_hash, str_hash
from lmcache_p2p.proxy.router.registry import Registry
from lmcache_p2p.proxy.router.routing import Policy, PrefixDecision, RequestCost, Router

from ..conftest import eventually, make_cluster
from ..fakes import MODEL, fingerprint
from .test_routing import add

SUBPROCESS_TIMEOUT_S = 300


def _python(code: str, seed: int) -> str:
    env = {**os.environ, "PYTHONHASHSEED": str(seed)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                          timeout=SUBPROCESS_TIMEOUT_S).stdout


@pytest.mark.parametrize("seed", [0, 1, 42, 4294967295])
def test_str_hash_equals_cpython_under_that_seed(seed):
    texts = ["0", str(seed), "", "abcdefgh", "abcdefghijklmnopq", "hé", "日本", "🙂x"]
    theirs = json.loads(_python(f"import json; print(json.dumps([hash(t) for t in {texts!r}]))", seed))
    assert [str_hash(t, seed) for t in texts] == theirs


_LMCACHE_CHAIN = """
import json, sys
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.token_database import ChunkedTokenDatabase
out = {}
for chunk in (256, 16):
    db = ChunkedTokenDatabase(LMCacheEngineConfig.from_defaults(chunk_size=chunk, save_unfull_chunk=True))
    for n in (1, 15, 16, 17, 255, 256, 257, 700):
        tokens = [(i * 7919) % 32000 for i in range(n)]
        out[f"{chunk}/{n}"] = [h for _, _, h in db.process_tokens(tokens=tokens, make_key=False)]
print("RESULT" + json.dumps(out))
"""


@pytest.mark.parametrize("seed", [0, 7])
def test_chunk_hashes_equal_lmcache_own(seed):
    """The proxy's chain equals LMCache 0.5.6's ``ChunkedTokenDatabase`` in an instance-like process
    (its PYTHONHASHSEED set, NONE_HASH from vLLM), full and partial last chunks, whatever our own seed."""
    pytest.importorskip("lmcache")
    line = next(l for l in _python(_LMCACHE_CHAIN, seed).splitlines() if l.startswith("RESULT"))
    theirs = json.loads(line[len("RESULT"):])
    start = none_hash(seed)
    for key, expected in theirs.items():
        chunk, n = (int(x) for x in key.split("/"))
        tokens = [(i * 7919) % 32000 for i in range(n)]
        assert chunk_hashes(tokens, chunk, start) == expected, key


def test_chain_names_the_whole_prefix():
    a = chunk_hashes(list(range(40)), 16, none_hash(0))
    b = chunk_hashes(list(range(32)) + [999] * 8, 16, none_hash(0))
    c = chunk_hashes([5] + list(range(1, 40)), 16, none_hash(0))
    assert a[:2] == b[:2] and a[2] != b[2]  # the same first 32 tokens, a different tail
    assert all(x != y for x, y in zip(a, c))  # one token differs in chunk 0: no chunk matches


# ---- the index -----------------------------------------------------------------------------------


def test_index_matches_the_leading_run_only():
    index = PrefixIndex(max_chunks=100)
    index.record("d0", [1, 2, 3])
    assert index.matched_chunks("d0", [1, 2, 3, 4]) == 3
    assert index.matched_chunks("d0", [1, 9, 3]) == 1
    assert index.matched_chunks("d0", [9, 2, 3]) == 0
    assert index.matched_chunks("d1", [1, 2, 3]) == 0


def test_index_is_bounded_per_instance_and_drops_tails_first():
    index = PrefixIndex(max_chunks=4)
    index.record("d0", [1, 2, 3])
    index.record("d0", [10, 11, 12])  # 6 chunks for 4 places: the oldest sequence's tail goes first
    assert index.chunks_held("d0") == 4
    assert index.matched_chunks("d0", [10, 11, 12]) == 3
    assert index.matched_chunks("d0", [1, 2, 3]) == 1
    index.record("d1", [1, 2, 3, 4, 5, 6])
    assert index.chunks_held("d1") == 4 and index.matched_chunks("d1", [1, 2, 3, 4, 5, 6]) == 4
    assert index.chunks_held("d0") == 4  # a bound per instance, not shared


def test_index_forgets_an_instance():
    index = PrefixIndex(max_chunks=10)
    index.record("d0", [1, 2])
    index.record("d1", [1, 2])
    index.forget("d0")
    index.forget("gone")  # unknown: no error
    assert index.matched_chunks("d0", [1, 2]) == 0 and index.matched_chunks("d1", [1, 2]) == 2
    assert index.instances() == ["d1"]


def test_router_forgets_instances_the_registry_drops_or_restarts():
    registry, router = Registry(10), Router(Policy.PREFIX)
    registry.on_forgotten.append(router.forget)
    registry.on_pending.append(router.forget)
    d0 = add(registry, "d0", chunk_tokens=4)
    router.remember(d0, router.prompt_prefix(list(range(16))))
    assert router.index.chunks_held("d0") == 4
    registry.drain("d0")  # nothing in flight: forgotten at once
    assert router.index.chunks_held("d0") == 0


# ---- the policy ----------------------------------------------------------------------------------


PROMPT = list(range(1000, 1100))  # 100 tokens: 6 full chunks of 16 and a partial one
COST = RequestCost(prompt_tokens=len(PROMPT), max_output_tokens=10)


def _decoders(registry: Registry, **free: int):
    return [add(registry, name, chunk_tokens=16, free=slots) for name, slots in free.items()]


def test_prefix_wins_when_load_is_balanced():
    registry, router = Registry(10), Router(Policy.PREFIX)
    decisions = []
    router.on_prefix_decision.append(lambda role, decision: decisions.append((role, decision)))
    a, b = _decoders(registry, a=100, b=100)
    router.remember(b, router.prompt_prefix(PROMPT[:80]))  # b holds 5 of the prompt's 7 chunks
    registry.lease(b, tokens=500)  # more in-flight tokens on b, one request: still balanced
    prefix = router.prompt_prefix(PROMPT)
    assert router.decoder_with_room([a, b], COST, prefix=prefix) is b
    assert router.matched_tokens(b, prefix) == 80 and router.matched_tokens(a, prefix) == 0
    assert decisions == [(Role.RECEIVER, PrefixDecision.MATCH)]
    assert router.decoder_with_room([a, b], COST, prefix=None) is a  # no ids: least loaded
    assert decisions[-1] == (Role.RECEIVER, PrefixDecision.NO_PREFIX)


def test_load_wins_when_imbalanced():
    registry, router = Registry(10), Router(Policy.PREFIX, PrefixSettings(balance_abs_requests=2, balance_rel=1.5))
    a, b = _decoders(registry, a=100, b=100)
    router.remember(b, router.prompt_prefix(PROMPT))
    prefix = router.prompt_prefix(PROMPT)
    for _ in range(2):
        registry.lease(b, tokens=10)
    assert router.decoder_with_room([a, b], COST, prefix=prefix) is b  # 2 - 0 is not > 2: balanced
    registry.lease(b, tokens=10)
    assert router.decoder_with_room([a, b], COST, prefix=prefix) is a  # 3 - 0 > 2 and 3 > 1.5 * 0


def test_a_short_match_does_not_win():
    registry, router = Registry(10), Router(Policy.PREFIX, PrefixSettings(cache_threshold=0.5))
    a, b = _decoders(registry, a=100, b=100)
    router.remember(b, router.prompt_prefix(PROMPT[:48]))  # 48 of 100 tokens: under the threshold
    registry.lease(b, tokens=10)
    assert router.decoder_with_room([a, b], COST, prefix=router.prompt_prefix(PROMPT)) is a


def test_the_longest_match_wins_and_ties_go_to_the_least_loaded():
    registry, router = Registry(10), Router(Policy.PREFIX)
    a, b, c = _decoders(registry, a=100, b=100, c=100)
    for inst in (a, b):
        router.remember(inst, router.prompt_prefix(PROMPT[:64]))
    router.remember(c, router.prompt_prefix(PROMPT[:96]))
    prefix = router.prompt_prefix(PROMPT)
    assert router.decoder_with_room([a, b, c], COST, prefix=prefix) is c
    router.forget(c)
    registry.lease(a, tokens=50)
    assert router.decoder_with_room([a, b, c], COST, prefix=prefix) is b


def test_prefix_respects_buffer_credit():
    """The decoder holding the prefix has no credit for the request's KV: another one with room is chosen,
    and with no room anywhere none is (admission waits)."""
    registry, router = Registry(10), Router(Policy.PREFIX)
    a, b = _decoders(registry, a=100, b=3)  # the prompt needs 7 chunks of 16
    router.remember(b, router.prompt_prefix(PROMPT))
    prefix = router.prompt_prefix(PROMPT)
    assert router.decoder_with_room([a, b], COST, prefix=prefix) is a
    assert router.decoder_with_room([b], COST, prefix=prefix) is None


def _prefiller(registry: Registry, name: str):
    """A prefiller as senders announce: no chunk_tokens of its own, the chunk size in its fingerprint."""
    inst = registry.announce(Announce(version=PROTOCOL_VERSION, instance_id=name, role="sender",
                                      http_url=f"http://{name}:1", tp_rank=0, tp_size=1,
                                      fingerprint=fingerprint(chunk_tokens=16)))
    registry.mark_up(inst)
    return inst


def test_prefillers_use_the_fingerprint_chunk_size_and_prefix():
    registry, router = Registry(10), Router(Policy.PREFIX)
    p0, p1 = _prefiller(registry, "p0"), _prefiller(registry, "p1")
    router.remember(p1, router.prompt_prefix(PROMPT))
    assert router.index.chunks_held("p1") == 7  # 100 tokens in chunks of 16
    registry.lease(p1, tokens=10)
    assert router.pick_prefiller([p0, p1], prefix=router.prompt_prefix(PROMPT)) is p1
    assert router.pick_prefiller([p0, p1], prefix=router.prompt_prefix([7] + PROMPT)) is p0  # no match: least loaded


def test_other_policies_ignore_the_prefix():
    registry, router = Registry(10), Router(Policy.LEAST_LOADED)
    a, b = _decoders(registry, a=100, b=100)
    router.remember(b, router.prompt_prefix(PROMPT))  # not recorded: the index is for --policy prefix
    registry.lease(b, tokens=10)
    assert router.index.chunks_held("b") == 0
    assert router.decoder_with_room([a, b], COST, prefix=router.prompt_prefix(PROMPT)) is a


# ---- through the proxy ---------------------------------------------------------------------------


def _completion(prompt: list[int], max_tokens: int = 8) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}


def _served(cluster) -> list[int]:
    """Decode calls each decoder got so far."""
    return [len(node.vllm.calls("/v1/completions")) for node in cluster.decoders]


@pytest.mark.anyio
async def test_a_follow_up_turn_goes_where_its_prefix_is_unless_load_is_imbalanced():
    async with make_cluster(1, 2, policy="prefix") as cluster:
        history = list(range(3, 103))  # 100 prompt tokens, 6 full chunks of 16
        resp = await cluster.post("/v1/completions", _completion(history))
        assert resp.status_code == 200, resp.text
        first = _served(cluster)
        holder = first.index(1)
        other = 1 - holder
        history += resp.json()["choices"][0]["token_ids"] + list(range(200, 240))

        # balanced (both idle): turn 2 goes to the decoder holding turn 1's prompt and output
        resp = await cluster.post("/v1/completions", _completion(history))
        assert resp.status_code == 200, resp.text
        assert _served(cluster)[holder] == 2 and _served(cluster)[other] == 0
        history += resp.json()["choices"][0]["token_ids"] + list(range(300, 340))

        # a few more requests in flight on the holder (3, within --prefix-balance-abs 8): the prefix still wins;
        # 9 in flight there, none on the other: imbalanced, the idle one wins
        registry = cluster.proxy.registry
        holder_id = cluster.decoders[holder].agent.instance_id
        holder_inst = next(i for i in registry.instances() if i.instance_id == holder_id)
        for busy, served in ((3, [3, 0]), (9, [3, 1])):
            leases = [registry.lease(holder_inst, tokens=10) for _ in range(busy)]
            try:
                resp = await cluster.post("/v1/completions", _completion(history))
            finally:
                for lease in leases:
                    lease.release()
            assert resp.status_code == 200, resp.text
            assert [_served(cluster)[holder], _served(cluster)[other]] == served
            history += resp.json()["choices"][0]["token_ids"] + list(range(400, 440))
        assert cluster.metric("lmcache_p2p_proxy_prefix_routed_total", role="receiver", decision="match") >= 1
        assert cluster.metric("lmcache_p2p_proxy_prefix_routed_total", role="receiver", decision="imbalanced") == 1


@pytest.mark.anyio
async def test_the_index_holds_what_each_instance_computed_and_forgets_a_decoder_that_leaves():
    async with make_cluster(1, 1, policy="prefix") as cluster:
        resp = await cluster.post("/v1/completions", _completion(list(range(3, 103))))
        assert resp.status_code == 200, resp.text
        router = cluster.proxy.orchestrator.router
        decoder_id = cluster.decoders[0].agent.instance_id
        prefiller_id = cluster.prefillers[0].agent.instance_id
        # the decoder holds prompt + output (its prefix cache), the prefiller the prompt: 7 chunks of 16 vs 6 + 1
        conversation = router.prompt_prefix(list(range(3, 103)) + resp.json()["choices"][0]["token_ids"])
        assert len(conversation.hashes(16)) == 7
        assert router.index.matched_chunks(decoder_id, conversation.hashes(16)) == 7
        assert router.index.matched_chunks(prefiller_id, conversation.hashes(16)) == 6
        await cluster.decoders[0].agent.goodbye()  # nothing in flight: forgotten at once
        await eventually(lambda: router.index.chunks_held(decoder_id) == 0)


@pytest.mark.anyio
async def test_stats_show_the_prompt_tokens_whose_kv_the_decoder_got():
    """A user reads /stats per request: the tokens moved from the prefiller and those ready on the
    decoder (moved + held), not only the decoder's cache hits, which are 0 for a first request."""
    async with make_cluster(1, 1, policy="prefix") as cluster:
        prompt = list(range(3, 103))  # 100 tokens; the fake decoder moves 3 chunks of 16 tokens
        for held in (0, 2):
            cluster.decoders[0].agent.kv_chunks_held = held
            resp = await cluster.post("/v1/completions", _completion(prompt))
            assert resp.status_code == 200, resp.text
        stats = (await cluster.client.get("/stats")).json()
        first, second = stats["requests"][-2:]
        assert (first["decoder_hit_tokens"], first["kv_moved_tokens"], first["decoder_kv_tokens"]) == (0, 48, 48)
        assert (second["decoder_hit_tokens"], second["kv_moved_tokens"], second["decoder_kv_tokens"]) == (32, 48, 80)


@pytest.mark.anyio
async def test_stats_report_reuse_per_request():
    """Cached tokens from the prefiller's usage, KV bytes and held chunks from KvReady; an old decoder's
    KvReady (no new fields) counts its whole KV as moved and its reuse as unknown."""
    async with make_cluster(1, 1, policy="prefix") as cluster:
        prompt = list(range(3, 103))
        cluster.prefillers[0].vllm.cached_tokens = 64
        cluster.decoders[0].agent.kv_chunks_held = 2
        resp = await cluster.post("/v1/completions", _completion(prompt))
        assert resp.status_code == 200, resp.text
        cluster.prefillers[0].vllm.cached_tokens = None
        cluster.decoders[0].agent.kv_chunks_held = None
        resp2 = await cluster.post("/v1/completions", _completion(prompt))
        assert resp2.status_code == 200, resp2.text
        stats = (await cluster.client.get("/stats")).json()
        records = {r["response_id"]: r for r in stats["requests"]}
        new = records[resp.json()["id"].removeprefix("cmpl-")]
        old = records[resp2.json()["id"].removeprefix("cmpl-")]
        assert (new["prompt_tokens"], new["cached_tokens"], new["prefill_tokens_computed"]) == (100, 64, 36)
        assert (new["kv_bytes"], new["chunks_held"], new["decoder_hit_tokens"]) == (1 << 20, 2, 32)
        assert (old["cached_tokens"], old["prefill_tokens_computed"]) == (None, None)
        assert (old["kv_bytes"], old["chunks_held"], old["decoder_hit_tokens"]) == (3 << 20, None, None)
        assert stats["reuse"]["kv_bytes_per_request"] == {"count": 2, "sum": 4 << 20, "mean": float(2 << 20)}
        prefiller_id = cluster.prefillers[0].agent.instance_id
        assert cluster.metric("lmcache_p2p_proxy_prefix_hit_tokens_total", instance=prefiller_id,
                              role="sender") == 64
        assert stats["reuse"]["prefix_hit_tokens"][prefiller_id] == 64
