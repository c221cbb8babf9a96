"""bench/tp_cpu.py's bookkeeping (rows, the equal-TP comparison, the model's KV), with no server."""

from __future__ import annotations

import json



def result(tp_cpu, index: int, ids: tuple[int, ...], ttft_s: float = 0.05, error: str | None = None):
    return tp_cpu.e2e.RequestResult(index, error, ttft_s, 0.2, ids, (ttft_s,))


def pair_run(tp_cpu, system: str, handover_ms: float, *, ids=((1, 2), (3, 4)), kv_bytes=2 * 150 * 512.0,
             loads=((150, 150), (150, 150)), hits=(150, 150)):
    stats = {"handover_ms": {"p50": handover_ms, "p99": handover_ms + 5}, "kv_wait_ms": {"p50": 1.0, "p99": 2.0},
             "timeline_ms": {"transfer": {"p50": 3.0, "p99": 4.0}}}
    lookups = tuple(tp_cpu.e2e.Lookup(h + 1, h) for h in hits)
    return tp_cpu.Measured(system, 1, tuple(result(tp_cpu, i, x) for i, x in enumerate(ids)), 1.0, stats, kv_bytes,
                           lookups, loads, hits)


def test_a_pair_row_checks_outputs_bytes_and_every_rank(tp_cpu) -> None:
    plain = {(2, 1): tp_cpu.Measured("plain-tp2", 1, (result(tp_cpu, 0, (1, 2)), result(tp_cpu, 1, (3, 4))), 1.0),
             (1, 1): tp_cpu.Measured("plain-tp1", 1, (result(tp_cpu, 0, (1, 2)), result(tp_cpu, 1, (3, 9))), 1.0)}
    row = tp_cpu.row_of(pair_run(tp_cpu, "p1-d2-nixl", 20.0), plain, [150, 150], 512, 2, 1, "nixl")
    assert (row["outputs_equal"], row["outputs_equal_other_tp"]) == (True, False)
    assert row["kv_bytes_per_request"] == row["model_kv_bytes_per_request"] == 150 * 512
    assert row["kv_bytes_equal_model_kv"] and row["kv_hit_ratio"] == 1.0 and row["ranks_loaded_whole"] == 2
    assert (row["handover_ms_p50"], row["kv_transfer_ms_p99"]) == (20.0, 4.0)
    short = tp_cpu.row_of(pair_run(tp_cpu, "p1-d2-nixl", 20.0, loads=((150, 150), (150,)), kv_bytes=2 * 160 * 512.0),
                          plain, [150, 150], 512, 2, 1, "nixl")
    assert short["ranks_loaded_whole"] == 1 and not short["kv_bytes_equal_model_kv"]  # one rank missed; bytes extra


def test_summary_compares_different_tp_with_equal_tp_at_the_decoders_size(tp_cpu) -> None:
    rows = [tp_cpu.row_of(pair_run(tp_cpu, name, ms, loads=((150,) * d, (150,) * d)), {}, [150, 150], 512, d, p, "nixl")
            for name, ms, p, d in (("p2-d2-nixl", 20.0, 2, 2), ("p1-d2-nixl", 21.0, 1, 2), ("p1-d1-nixl", 10.0, 1, 1),
                                   ("p2-d1-nixl", 12.0, 2, 1))]
    summary = tp_cpu.summary_of(rows)
    assert summary["different_tp_handover_vs_equal_tp"]["p1-d2-nixl-c1"]["ratio"] == 1.05
    assert summary["different_tp_handover_vs_equal_tp"]["p2-d1-nixl-c1"]["vs"] == "p1-d1-nixl"
    assert summary["failed"] == 0 and summary["rows_rank_missed_kv"] == 0


def test_model_kv_per_token(tp_cpu, tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 128, "num_attention_heads": 4,
                                                      "num_key_value_heads": 2, "num_hidden_layers": 2}))
    assert tp_cpu.kv_bytes_per_token(tmp_path) == 2 * 2 * 2 * 32 * 2


def test_output_rules_where_the_references_disagree(tp_cpu) -> None:
    def run(*ids):
        return tp_cpu.Measured("x", 1, tuple(result(tp_cpu, i, x) for i, x in enumerate(ids)), 1.0)

    tp1, tp2 = run((1, 2), (3, 4), (5, 6)), run((1, 2), (3, 9), (7, 6))  # request 0 agrees, 1 and 2 do not
    # P TP2 -> D TP1: request 1's first token is the TP2 prefill's (3), request 2's is not (5 != 7)
    mixed = tp_cpu.output_rules(run((1, 2), (3, 0), (5, 6)), tp1, tp2, equal_tp=False)
    assert mixed == {"references_agree": 1, "equal_where_references_agree": 1, "output_rule_violations": 1}
    # equal TP: the whole output must be the decoder's size's
    same = tp_cpu.output_rules(run((1, 2), (3, 4), (5, 0)), tp1, tp2, equal_tp=True)
    assert same["output_rule_violations"] == 1
    broken = tp_cpu.output_rules(run((1, 0), (3, 4), (5, 6)), tp1, tp2, equal_tp=True)
    assert broken == {"references_agree": 1, "equal_where_references_agree": 0, "output_rule_violations": 1}
