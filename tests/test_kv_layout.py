"""The TP layout arithmetic: head ranges, which sender rank feeds which decoder rank, which pieces."""

from __future__ import annotations

import pytest

from lmcache_p2p.kv_layout import (KvLayout, Piece, irreconcilable, kv_mismatch, parse_sub_request, pieces_for,
                                   routes_of, sub_request_id)
from lmcache_p2p.protocol import Fingerprint


def test_head_ranges_split_contiguously_and_replicate_when_ranks_outnumber_heads():
    assert [(KvLayout(8, 4, r).head_start, KvLayout(8, 4, r).head_end) for r in range(4)] == [(0, 2), (2, 4), (4, 6),
                                                                                              (6, 8)]
    assert [KvLayout(2, 4, r).head_start for r in range(4)] == [0, 0, 1, 1]  # vLLM: head r // (tp // heads)
    assert all(KvLayout(1, 4, r, mla=True).head_start == 0 for r in range(4))


@pytest.mark.parametrize("p_tp, d_tp", [(1, 1), (2, 2), (4, 4)])
def test_equal_tp_is_rank_r_to_rank_r_whole(p_tp, d_tp):
    for r in range(d_tp):
        piece, = pieces_for(KvLayout(4, d_tp, r), KvLayout(4, p_tp))
        assert (piece.src_rank, piece.dst_rank, piece.count) == (r, r, 1)
        assert (piece.head_lo, piece.head_hi) == (KvLayout(4, p_tp, r).head_start, KvLayout(4, p_tp, r).head_end)


def test_larger_prefiller_tp_merges_pieces_on_the_decoder():
    assert pieces_for(KvLayout(4, 1, 0), KvLayout(4, 2)) == (Piece(0, 0, 0, 2, 0, 2), Piece(1, 0, 2, 4, 1, 2))
    assert pieces_for(KvLayout(8, 2, 1), KvLayout(8, 4)) == (Piece(2, 1, 4, 6, 0, 2), Piece(3, 1, 6, 8, 1, 2))
    assert routes_of(KvLayout(4, 2, 1), 1) == (Piece(1, 0, 2, 4, 1, 2),)


def test_larger_decoder_tp_splits_on_the_sender():
    assert routes_of(KvLayout(4, 1, 0), 2) == (Piece(0, 0, 0, 2), Piece(0, 1, 2, 4))
    assert routes_of(KvLayout(8, 2, 1), 4) == (Piece(1, 2, 4, 6), Piece(1, 3, 6, 8))


def test_a_replicated_head_or_an_mla_latent_is_sent_once_per_decoder_rank():
    # MLA, P TP2 -> D TP1: rank 0 sends, rank 1 sends nothing.
    assert routes_of(KvLayout(1, 2, 0, mla=True), 1) == (Piece(0, 0, 0, 1),)
    assert routes_of(KvLayout(1, 2, 1, mla=True), 1) == ()
    # MLA, P TP1 -> D TP2: the one sender rank sends the latent to each decoder rank.
    assert routes_of(KvLayout(1, 1, 0, mla=True), 2) == (Piece(0, 0, 0, 1), Piece(0, 1, 0, 1))
    # 2 heads on TP4 (replicated) -> TP1: one holder of each head sends it.
    assert pieces_for(KvLayout(2, 1, 0), KvLayout(2, 4)) == (Piece(0, 0, 0, 1, 0, 2), Piece(2, 0, 1, 2, 1, 2))
    assert routes_of(KvLayout(2, 4, 1), 1) == () and routes_of(KvLayout(2, 4, 3), 1) == ()
    # Equal TP with replicated heads: still rank r -> rank r.
    assert [pieces_for(KvLayout(2, 4, r), KvLayout(2, 4))[0].src_rank for r in range(4)] == [0, 1, 2, 3]
    # Every decoder rank gets every head it holds exactly once, whatever the split.
    for p_tp, d_tp, heads in [(1, 4, 2), (4, 1, 2), (2, 8, 4), (8, 2, 4), (4, 2, 1)]:
        for r in range(d_tp):
            got = [h for p in pieces_for(KvLayout(heads, d_tp, r), KvLayout(heads, p_tp))
                   for h in range(p.head_lo, p.head_hi)]
            assert got == list(range(KvLayout(heads, d_tp, r).head_start, KvLayout(heads, d_tp, r).head_end))


def test_irreconcilable_layouts_are_named_both():
    assert irreconcilable(KvLayout(6, 2), KvLayout(6, 3)).endswith(
        "(prefiller KV heads [0, 3) of 6 on TP 2 (rank 0), decoder KV heads [0, 2) of 6 on TP 3 (rank 0))")
    assert "4 KV heads vs 8" in irreconcilable(KvLayout(4, 2), KvLayout(8, 2))
    assert "MLA on one side only" in irreconcilable(KvLayout(1, 1, mla=True), KvLayout(1, 1))
    assert "do not split evenly" in irreconcilable(KvLayout(6, 4), KvLayout(6, 2))
    assert irreconcilable(KvLayout(4, 1), KvLayout(4, 4)) == ""


def _fp(**changes) -> Fingerprint:
    fields = dict(model="m", num_layers=2, kv_heads=2, head_size=32, dtype="bfloat16", chunk_tokens=256, tp_size=1,
                  tp_rank=0, kv_format="KV_2LTD", kv_heads_total=2)
    return Fingerprint(**{**fields, **changes})


def test_fingerprints_compare_every_field_but_the_split():
    assert kv_mismatch(_fp(tp_size=2, kv_heads=1), _fp()) == ""
    assert kv_mismatch(_fp(kv_heads_total=0), _fp()) == ""  # an older peer: heads x TP size
    assert "dtype: decoder 'bfloat16', prefiller 'float16'" in kv_mismatch(_fp(dtype="float16"), _fp())
    assert "should hold 1 heads" in kv_mismatch(_fp(tp_size=2, kv_heads=2), _fp())


def test_sub_request_ids_round_trip_and_bad_ones_are_refused():
    piece = Piece(1, 0, 2, 4, 1, 2)
    assert sub_request_id("abc", piece) == "abc~1/2" and parse_sub_request("abc~1/2") == ("abc", 1, 2)
    assert sub_request_id("abc", Piece(0, 0, 0, 2)) == "abc" and parse_sub_request("abc") == ("abc", 0, 1)
    for bad in ("abc~2/2", "abc~x/2", "~0/2", "abc~0/1", "abc~0"):
        with pytest.raises(ValueError, match="malformed sub-request id"):
            parse_sub_request(bad)
