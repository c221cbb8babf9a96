"""Engine level, different TP splits: real LMCache engines as the TP ranks of a prefiller and a decoder.

Every prefiller rank stores the same prompt (its own heads' slice of the model's KV, as vLLM's
rank would) for one request addressed to every decoder rank. Assertions, per decoder rank: the
whole prompt is a hit, and the bytes it loads equal its own heads' slice of the model's KV for
every chunk; the bytes moved are the decoder's KV once (a replicated head or an MLA latent
once per decoder rank, and a sender rank that feeds no decoder rank sends nothing); afterwards
every receive slot is free and nothing is pending. An irreconcilable pair is refused at Hello
with an error naming both layouts, and nothing is reserved or leaked.

The default run covers P TP2 -> D TP2, P TP2 -> D TP1 and P TP1 -> D TP2 over NIXL with one
set of engines (7 processes, started once); the same over Gloo (``p2p.transport: nccl`` on
CPU), a replicated-heads case and MLA cases are ``long``.
"""

from __future__ import annotations

import itertools

import pytest
from tp_engines import load_everywhere, start_instances, store, wait_settled

LAYERS, HEAD_SIZE, BYTES = 2, 32, 2  # engine_proc's tiny shape, bf16
MLA_WIDTH = 96

_ids = itertools.count()


def kv_bytes(tokens: int, heads: int, mla: bool = False) -> int:
    return (1 if mla else 2) * LAYERS * tokens * (MLA_WIDTH if mla else heads * HEAD_SIZE) * BYTES


def check_moved(engines, p: str, d: str, n: int, *, heads_per_decoder_rank: int, mla: bool = False,
                idle_ranks=()) -> None:
    prefiller, decoder = engines[p], engines[d]
    seed = 100 + next(_ids)  # a fresh prompt: no chunk of it is in the decoder's buffer cache
    req_id = f"tp-{seed}"
    before = [e.call(op="slots")["bytes_sent"] for e in prefiller.ranks]
    store(prefiller, decoder, seed=seed, n=n, req_id=req_id)
    loads = load_everywhere(decoder, seed=seed, n=n, req_id=req_id)
    assert loads == [{"hit_tokens": n, "retrieved": n, "equal": True}] * decoder.tp
    sent, slots = wait_settled(prefiller, decoder)
    assert all(s["failed"] == 0 and s["pending"] == 0 for s in sent)
    assert all(s["free"] == s["capacity"] for s in slots)
    moved = [s["bytes_sent"] - b for s, b in zip(sent, before)]
    assert sum(moved) == decoder.tp * kv_bytes(n, heads_per_decoder_rank, mla)  # each decoder rank's KV, once
    assert [moved[r] for r in idle_ranks] == [0] * len(idle_ranks)


@pytest.fixture(scope="module")
def nixl(tmp_path_factory):
    specs = [dict(name="p2", role="sender", tp=2), dict(name="p1", role="sender", tp=1),
             dict(name="d2", role="receiver", tp=2), dict(name="d1", role="receiver", tp=1),
             dict(name="p1h4", role="sender", tp=1, heads=4)]
    engines = start_instances(tmp_path_factory.mktemp("tp-nixl"), specs)
    yield engines
    for inst in engines.values():
        inst.close()


@pytest.mark.parametrize("p, d, n", [("p2", "d2", 650), ("p2", "d1", 650), ("p1", "d2", 1024), ("p1", "d1", 300)])
def test_each_decoder_rank_loads_exactly_its_heads_over_nixl(nixl, p, d, n):
    check_moved(nixl, p, d, n, heads_per_decoder_rank=2 // nixl[d].tp)


def test_an_irreconcilable_prefiller_is_refused_naming_both_layouts_and_nothing_leaks(nixl):
    prefiller, decoder = nixl["p1h4"], nixl["d1"]
    store(prefiller, decoder, seed=7, n=300, req_id="tp-refused")
    sent, slots = wait_settled(prefiller, decoder)
    assert sent[0]["failed"] == 1 and sent[0]["bytes_sent"] == 0 and sent[0]["pending"] == 0
    assert slots[0]["free"] == slots[0]["capacity"]
    assert decoder.ranks[0].call(op="lookup", seed=7, num_tokens=300) == {"hit_tokens": 0}
    log = prefiller.ranks[0].log_path.read_text()
    assert ("KV layouts cannot be reconciled: 4 KV heads vs 2 (prefiller KV heads [0, 4) of 4 on TP 1 (rank 0), "
            "decoder KV heads [0, 2) of 2 on TP 1 (rank 0))") in log
    check_moved(nixl, "p1", "d1", 300, heads_per_decoder_rank=2)  # the decoder serves others as before


@pytest.fixture(scope="module")
def gloo(tmp_path_factory):
    specs = [dict(name="p2", role="sender", tp=2), dict(name="p1", role="sender", tp=1),
             dict(name="d2", role="receiver", tp=2), dict(name="d1", role="receiver", tp=1)]
    engines = start_instances(tmp_path_factory.mktemp("tp-gloo"), specs, transport="nccl")
    yield engines
    for inst in engines.values():
        inst.close()


@pytest.mark.long
@pytest.mark.parametrize("p, d, n", [("p2", "d2", 650), ("p2", "d1", 650), ("p1", "d2", 1024)])
def test_each_decoder_rank_loads_exactly_its_heads_over_gloo(gloo, p, d, n):
    check_moved(gloo, p, d, n, heads_per_decoder_rank=2 // gloo[d].tp)


@pytest.mark.long
@pytest.mark.parametrize("transport", ["nixl", "nccl"])
def test_replicated_heads_and_mla_are_sent_once_per_decoder_rank(tmp_path, transport):
    specs = [dict(name="rep-p2", role="sender", tp=2, heads=1), dict(name="rep-d1", role="receiver", tp=1, heads=1),
             dict(name="rep-d2", role="receiver", tp=2, heads=1), dict(name="rep-p1", role="sender", tp=1, heads=1),
             dict(name="mla-p2", role="sender", tp=2, mla=True), dict(name="mla-d1", role="receiver", tp=1, mla=True),
             dict(name="mla-p1", role="sender", tp=1, mla=True), dict(name="mla-d2", role="receiver", tp=2, mla=True)]
    engines = start_instances(tmp_path, specs, transport=transport)
    try:
        # One KV head replicated on both prefiller ranks: rank 0 sends it, rank 1 sends nothing.
        check_moved(engines, "rep-p2", "rep-d1", 650, heads_per_decoder_rank=1, idle_ranks=(1,))
        check_moved(engines, "rep-p2", "rep-d2", 650, heads_per_decoder_rank=1)  # rank r -> rank r
        check_moved(engines, "rep-p1", "rep-d2", 650, heads_per_decoder_rank=1)  # once to each decoder rank
        check_moved(engines, "mla-p2", "mla-d1", 650, heads_per_decoder_rank=1, mla=True, idle_ranks=(1,))
        check_moved(engines, "mla-p1", "mla-d2", 650, heads_per_decoder_rank=1, mla=True)
        check_moved(engines, "mla-p2", "mla-d2", 650, heads_per_decoder_rank=1, mla=True)
    finally:
        for inst in engines.values():
            inst.close()

