"""bench/tp_cpu.py's bookkeeping (rows, the equal-TP comparison, the model's KV), with no server."""

from __future__ import annotations

import json

import pytest



def result(tp_cpu, index: int, ids: tuple[int, ...], ttft_s: float = 0.05, error: str | None = None):
    return tp_cpu.e2e.RequestResult(index, error, ttft_s, 0.2, ids, (ttft_s,))


def pair_run(tp_cpu, system: str, handover_ms: float, *, ids=((1, 2), (3, 4)), kv_bytes=2 * 150 * 512.0,
             loads=((150, 150), (150, 150)), hits=(150, 150), dtype="bfloat16"):
    stats = {"handover_ms": {"p50": handover_ms, "p99": handover_ms + 5}, "kv_wait_ms": {"p50": 1.0, "p99": 2.0},
             "timeline_ms": {"transfer": {"p50": 3.0, "p99": 4.0}}}
    lookups = tuple(tp_cpu.e2e.Lookup(h + 1, h) for h in hits)
    return tp_cpu.Measured(system, 1, tuple(result(tp_cpu, i, x) for i, x in enumerate(ids)), 1.0, stats, kv_bytes,
                           lookups, loads, hits, dtype)


def test_a_pair_row_checks_outputs_bytes_and_every_rank(tp_cpu) -> None:
    plain = {("bfloat16", 2, 1): tp_cpu.Measured("plain-tp2", 1, (result(tp_cpu, 0, (1, 2)), result(tp_cpu, 1, (3, 4))),
                                                 1.0),
             ("bfloat16", 1, 1): tp_cpu.Measured("plain-tp1", 1, (result(tp_cpu, 0, (1, 2)), result(tp_cpu, 1, (3, 9))),
                                                 1.0)}
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
    assert summary["different_tp_handover_vs_equal_tp"]["p1-d2-nixl-bfloat16-c1"]["ratio"] == 1.05
    assert summary["different_tp_handover_vs_equal_tp"]["p2-d1-nixl-bfloat16-c1"]["vs"] == "p1-d1-nixl"
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
    assert mixed == {"rule": tp_cpu.RULE_BF16, "references_agree": 1, "equal_where_references_agree": 1,
                     "output_rule_violations": 1}
    # equal TP: the whole output must be the decoder's size's
    same = tp_cpu.output_rules(run((1, 2), (3, 4), (5, 0)), tp1, tp2, equal_tp=True)
    assert same["output_rule_violations"] == 1
    broken = tp_cpu.output_rules(run((1, 0), (3, 4), (5, 6)), tp1, tp2, equal_tp=True)
    assert broken == {"rule": tp_cpu.RULE_BF16, "references_agree": 1, "equal_where_references_agree": 0,
                      "output_rule_violations": 1}


def test_bf16_different_tp_compares_the_first_token_and_reports_the_rest(tp_cpu) -> None:
    def run(*ids):
        return tp_cpu.Measured("x", 1, tuple(result(tp_cpu, i, x) for i, x in enumerate(ids)), 1.0)

    tp1 = tp2 = run((1, 2, 3), (4, 5, 6))  # the references agree on both requests
    # the decoder's size over the other size's KV flips a near-tied step after the first token
    mixed = tp_cpu.output_rules(run((1, 2, 7), (4, 5, 6)), tp1, tp2, equal_tp=False)
    assert mixed == {"rule": tp_cpu.RULE_BF16, "references_agree": 2, "equal_where_references_agree": 1,
                     "output_rule_violations": 0}
    assert tp_cpu.output_rules(run((9, 2, 3), (4, 5, 6)), tp1, tp2, equal_tp=False)["output_rule_violations"] == 1
    assert tp_cpu.output_rules(run((1, 2, 7), (4, 5, 6)), tp1, tp2, equal_tp=True)["output_rule_violations"] == 1


def test_rescore_applies_the_rules_to_the_stored_ids(tp_cpu, tmp_path) -> None:
    rows = [{"system": "p2-d1-nixl", "dtype": "bfloat16", "p_tp": 2, "d_tp": 1, "transport": "nixl", "concurrency": 1,
             "requests": 2, "failed": 0, "outputs_equal": False, "handover_ms_p50": 1.0, "kv_bytes_equal_model_kv": True,
             "ranks_loaded_whole": 2, "kv_lookups": 2, "kv_hit_ratio": 1.0, "rule": "old", "output_rule_violations": 1},
            {"system": "p2-d1-nixl", "dtype": "float32", "p_tp": 2, "d_tp": 1, "transport": "nixl", "concurrency": 1,
             "requests": 2, "failed": 0, "outputs_equal": False, "handover_ms_p50": 1.0, "kv_bytes_equal_model_kv": True,
             "ranks_loaded_whole": 2, "kv_lookups": 2, "kv_hit_ratio": 1.0, "rule": "old", "output_rule_violations": 0}]
    ids = {"plain-tp1-bfloat16-c1": [[1, 2], [3, 4]], "plain-tp2-bfloat16-c1": [[1, 2], [3, 4]],
           "p2-d1-nixl-bfloat16-c1": [[1, 9], [3, 4]],
           "plain-tp1-float32-c1": [[1, 2], [3, 4]], "plain-tp2-float32-c1": [[1, 2], [3, 4]],
           "p2-d1-nixl-float32-c1": [[1, 9], []]}  # one answer wrong after its first token, one request failed
    path = tmp_path / "tp_cpu.json"
    path.write_text(json.dumps({"meta": {}, "summary": {}, "rows": rows, "output_ids": ids}))
    assert tp_cpu.rescore(path) == 1
    data = json.loads(path.read_text())
    bf16, f32 = data["rows"]
    assert (bf16["rule"], bf16["output_rule_violations"], bf16["equal_where_references_agree"]) == (
        tp_cpu.RULE_BF16, 0, 1)
    assert (f32["rule"], f32["output_rule_violations"]) == (tp_cpu.RULE_EXACT, 2)
    assert data["summary"]["output_rule_violations"] == 2 and "rescored" in data["meta"]


def test_float32_pairs_must_equal_the_plain_instance_at_the_decoders_size_on_every_request(tp_cpu) -> None:
    def run(*ids, dtype="float32"):
        return tp_cpu.Measured("x", 1, tuple(result(tp_cpu, i, x) for i, x in enumerate(ids)), 1.0, dtype=dtype)

    tp1, tp2 = run((1, 2), (3, 4)), run((1, 2), (3, 9))  # the references disagree on request 1
    # P TP2 -> D TP1 whose request 1 has the prefiller's first token but not D's output: bf16's rule holds,
    # float32's does not
    out = run((1, 2), (3, 9))
    assert tp_cpu.output_rules(out, tp1, tp2, equal_tp=False)["output_rule_violations"] == 0
    exact = tp_cpu.output_rules(out, tp1, tp2, equal_tp=False, exact=True)
    assert exact["rule"] == tp_cpu.RULE_EXACT and exact["output_rule_violations"] == 1
    assert tp_cpu.output_rules(run((1, 2), (3, 4)), tp1, tp2, equal_tp=False, exact=True)["output_rule_violations"] == 0


def test_a_request_the_rule_cannot_check_breaks_it(tp_cpu) -> None:
    ref = tp_cpu.Measured("plain", 1, (result(tp_cpu, 0, (1, 2)), result(tp_cpu, 1, (3, 4))), 1.0)
    failed = tp_cpu.Measured("x", 1, (result(tp_cpu, 0, (1, 2)), result(tp_cpu, 1, (), error="boom")), 1.0)
    assert tp_cpu.output_rules(failed, ref, ref, equal_tp=True)["output_rule_violations"] == 1
    assert tp_cpu.output_rules(failed, None, ref, equal_tp=True)["output_rule_violations"] is None


def test_float32_rows_are_their_own_checked_against_float32_references(tp_cpu) -> None:
    plain = {(dtype, tp, 1): tp_cpu.Measured(f"plain-tp{tp}", 1, (result(tp_cpu, 0, (1, 2)), result(tp_cpu, 1, ids)), 1.0,
                                             dtype=dtype)
             for dtype, tp, ids in (("bfloat16", 1, (3, 9)), ("bfloat16", 2, (3, 4)), ("float32", 1, (3, 4)),
                                    ("float32", 2, (3, 4)))}
    f32 = tp_cpu.row_of(pair_run(tp_cpu, "p2-d1-nixl", 20.0, ids=((1, 2), (3, 4)), loads=((150,), (150,)),
                                 kv_bytes=2 * 150 * 1024.0, dtype="float32"), plain, [150, 150], 1024, 1, 2, "nixl")
    assert (f32["dtype"], f32["rule"], f32["output_rule_violations"]) == ("float32", tp_cpu.RULE_EXACT, 0)
    assert f32["outputs_equal"] and f32["kv_bytes_equal_model_kv"]
    bf16 = tp_cpu.row_of(pair_run(tp_cpu, "p2-d1-nixl", 20.0, ids=((1, 2), (3, 4)), loads=((150,), (150,))),
                         plain, [150, 150], 512, 1, 2, "nixl")
    assert (bf16["dtype"], bf16["rule"], bf16["outputs_equal"]) == ("bfloat16", tp_cpu.RULE_BF16, False)
    assert bf16["output_rule_violations"] == 0  # first token the prefiller's size's: bf16's rule holds
    summary = tp_cpu.summary_of([f32, bf16])
    assert tp_cpu.broken_rules(summary, [f32, bf16]) == []


def test_the_exit_status_is_0_only_when_every_rule_held(tp_cpu) -> None:
    good = tp_cpu.row_of(pair_run(tp_cpu, "p1-d1-nixl", 10.0, loads=((150,), (150,))),
                         {("bfloat16", 1, 1): tp_cpu.Measured("plain-tp1", 1, (result(tp_cpu, 0, (1, 2)),
                                                                               result(tp_cpu, 1, (3, 4))), 1.0)},
                         [150, 150], 512, 1, 1, "nixl")
    assert tp_cpu.broken_rules(tp_cpu.summary_of([good]), [good]) == []
    for change, words in (({"failed": 1}, "1 requests failed"),
                          ({"output_rule_violations": 2}, "2 outputs broke their dtype's rule"),
                          ({"output_rule_violations": None}, "1 pair rows without a reference"),
                          ({"kv_bytes_equal_model_kv": False}, "1 pair rows that moved other than the model's KV"),
                          ({"ranks_loaded_whole": 1}, "1 pair rows where a decoder rank did not load")):
        bad = {**good, **change}
        broken = tp_cpu.broken_rules(tp_cpu.summary_of([bad]), [bad])
        assert len(broken) == 1 and broken[0].startswith(words), (change, broken)
    assert tp_cpu.broken_rules(tp_cpu.summary_of([]), []) == ["no pair was measured"]


def test_model_kv_per_token_follows_the_dtype(tp_cpu, tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 128, "num_attention_heads": 4,
                                                      "num_key_value_heads": 2, "num_hidden_layers": 2}))
    assert tp_cpu.kv_bytes_per_token(tmp_path, "float32") == 2 * tp_cpu.kv_bytes_per_token(tmp_path, "bfloat16")


def test_dtype_flag_is_checked_and_passed_to_every_instance(tp_cpu, tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    settings = tp_cpu.parse_args(["--dtype", "float32", "--model", str(tmp_path)])
    assert settings.dtypes == ("float32",) and tp_cpu.dtype_args("float32") == ("--dtype=float32",)
    assert tp_cpu.parse_args(["--model", str(tmp_path)]).dtypes == ("bfloat16", "float32")
    with pytest.raises(SystemExit):
        tp_cpu.parse_args(["--dtype", "fp8", "--model", str(tmp_path)])
