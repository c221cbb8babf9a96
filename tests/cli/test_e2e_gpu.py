"""bench/e2e_gpu.py's bookkeeping (rows, goodput, resuming), on CPU with no server."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from lmcache_p2p.cli.cluster import Lookup

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def e2e_gpu():
    spec = importlib.util.spec_from_file_location("e2e_gpu", REPO / "bench" / "e2e_gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["e2e_gpu"] = module
    spec.loader.exec_module(module)
    return module


OUTPUT_LEN = 11


def bench_result(texts, errors=None, output_lens=None):
    """``vllm bench serve --save-detailed``'s fields: request i has TTFT (i+1)*10 ms, then 10 tokens 20 ms apart."""
    n = len(texts)
    return {"duration": 2.0, "completed": n, "ttfts": [(i + 1) * 0.01 for i in range(n)],
            "itls": [[0.02] * 10 for _ in range(n)],
            "output_lens": output_lens or [OUTPUT_LEN] * n, "generated_texts": texts,
            "errors": errors or [""] * n}


def test_row_per_gpu_hit_ratio_and_proxy_stats(e2e_gpu) -> None:
    stats = {"handover_ms": {"p50": 3.0, "p99": 9.0}, "kv_wait_ms": {"p50": 1.0, "p99": 2.0}}
    # prompt 1024 + first token: 1025 tokens, the last one skipped: 1024 looked up, all hit; one miss
    row = e2e_gpu.make_row("lmcache_p2p-nixl", 2.0, bench_result(["a", "b", "c"]), stats,
                           [Lookup(1025, 1024), Lookup(1025, 1024), Lookup(1025, 0)], OUTPUT_LEN)
    assert row["gpus"] == 2 and row["output_tok_s_per_gpu"] == 3 * OUTPUT_LEN / 2.0 / 2
    assert row["handover_ms_p50"] == 3.0 and row["handover_ms_p99"] == 9.0
    assert row["kv_hit_ratio"] == pytest.approx(2 / 3, abs=1e-4) and row["kv_full_hits"] == 2
    assert (row["ttft_ms_p50"], row["ttft_ms_p99"]) == (20.0, 29.8)
    assert row["tpot_ms_p50"] == row["tpot_ms_p99"] == 20.0 and row["itl_ms_p99"] == 20.0
    assert row["failed"] == 0 and row["bench_output_lens_off"] == 0


def test_tokens_are_counted_from_output_len_not_the_bench_s_retokenized_text(e2e_gpu) -> None:
    """LMCache's PD proxy sends no usage: the bench re-tokenizes the text and miscounts (seen: 83..1125 for 64)."""
    result = bench_result(["a", "b", "c"], errors=["", "boom", ""], output_lens=[83, 0, 1125])
    row = e2e_gpu.make_row("lmcache-pd", 2.0, result, None, [], OUTPUT_LEN)
    assert row["completed"] == 2 and row["failed"] == 1 and row["first_error"] == "boom"
    assert row["output_tok_s_per_gpu"] == 2 * OUTPUT_LEN / 2.0 / 2 and row["bench_output_lens_off"] == 2


def test_goodput_is_the_highest_rate_within_the_slo_per_gpu(e2e_gpu) -> None:
    rows = [{"rate": 1, "gpus": 2, "failed": 0, "ttft_ms_p99": 200, "tpot_ms_p99": 20},
            {"rate": 4, "gpus": 2, "failed": 0, "ttft_ms_p99": 900, "tpot_ms_p99": 24},
            {"rate": 8, "gpus": 2, "failed": 0, "ttft_ms_p99": 1500, "tpot_ms_p99": 24},
            {"rate": 16, "gpus": 2, "failed": 3, "ttft_ms_p99": 100, "tpot_ms_p99": 10}]
    assert e2e_gpu.goodput(rows, 1000, 25) == 2.0
    assert e2e_gpu.goodput(rows[2:], 1000, 25) is None


def test_cached_rates_are_skipped_and_outputs_compared_with_single(e2e_gpu, tmp_path, monkeypatch) -> None:
    cfg, _ = e2e_gpu.parse_args(["--model", str(tmp_path), "--systems", "single,lmcache_p2p-nixl", "--rates", "1,2",
                                 "--results-dir", str(tmp_path / "parts"), "--out", str(tmp_path / "out.json"),
                                 "--log-dir", str(tmp_path / "logs"), "--", "--enforce-eager"])
    assert cfg.vllm_args == ("--enforce-eager",)
    cfg.results_dir.mkdir()
    single_rows = {f"{r:g}": e2e_gpu.make_row("single", r, bench_result(["x", "y"]), None, [], OUTPUT_LEN) for r in (1.0, 2.0)}
    e2e_gpu.save_cached(cfg, "single", single_rows)  # a partial pass left single complete
    started, rated = [], []

    class Dep:
        system = "lmcache_p2p-nixl"

        def stop(self) -> None:
            started.append("stopped")

    monkeypatch.setattr(e2e_gpu, "start", lambda system, _cfg: started.append(system) or Dep())
    monkeypatch.setattr(e2e_gpu, "run_rate", lambda _cfg, dep, rate: rated.append(rate) or e2e_gpu.make_row(
        dep.system, rate, bench_result(["x", "z" if rate == 2 else "y"]), None, [], OUTPUT_LEN))

    assert e2e_gpu.run_system(cfg, "single") is None
    assert started == []  # nothing to do: single was cached
    assert e2e_gpu.run_system(cfg, "lmcache_p2p-nixl") is None
    assert started == ["lmcache_p2p-nixl", "stopped"] and rated == [1.0, 2.0]
    assert e2e_gpu.run_system(cfg, "lmcache_p2p-nixl") is None and rated == [1.0, 2.0]  # resumed: nothing redone

    result = e2e_gpu.assemble(cfg, [])
    equal = {(r["system"], r["rate"]): r["outputs_equal_single"] for r in result["rows"]}
    assert equal[("lmcache_p2p-nixl", 1.0)] is True and equal[("lmcache_p2p-nixl", 2.0)] is False
    json.dumps(result)  # serialisable as written


def test_rows_of_another_workload_are_not_reused(e2e_gpu, tmp_path) -> None:
    base = ["--model", str(tmp_path), "--rates", "2", "--results-dir", str(tmp_path / "parts"),
            "--log-dir", str(tmp_path / "logs")]
    cfg, _ = e2e_gpu.parse_args([*base, "--output-len", "64"])
    cfg.results_dir.mkdir()
    e2e_gpu.save_cached(cfg, "single", {"2": e2e_gpu.make_row("single", 2.0, bench_result(["x"]), None, [], 64)})
    assert set(e2e_gpu.load_cached(cfg, "single")) == {"2"}
    other, _ = e2e_gpu.parse_args([*base, "--output-len", "1024"])
    assert e2e_gpu.load_cached(other, "single") == {}


def test_budget_stops_before_a_step_that_would_not_fit(e2e_gpu, tmp_path) -> None:
    cfg, _ = e2e_gpu.parse_args(["--model", str(tmp_path), "--results-dir", str(tmp_path / "parts"),
                                 "--log-dir", str(tmp_path / "logs"), "--budget-s", "60"])
    cfg.results_dir.mkdir()
    note = e2e_gpu.run_system(cfg, "single")
    assert note is not None and "not started" in note and "rerun to resume" in note


METRICS_BEFORE = """# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.01",model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.02",model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 1.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 1.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.005
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""
METRICS_AFTER = METRICS_BEFORE.replace('le="0.02",model_name="m"} 1.0', 'le="0.02",model_name="m"} 3.0').replace(
    'le="0.04",model_name="m"} 1.0', 'le="0.04",model_name="m"} 5.0').replace(
    'le="+Inf",model_name="m"} 1.0', 'le="+Inf",model_name="m"} 5.0').replace(
    "_count{engine=\"0\",model_name=\"m\"} 1.0", "_count{engine=\"0\",model_name=\"m\"} 5.0").replace(
    "_sum{engine=\"0\",model_name=\"m\"} 0.005", "_sum{engine=\"0\",model_name=\"m\"} 0.105")


def test_vllm_histograms_give_the_rate_s_own_requests_only(e2e_gpu) -> None:
    """Deltas between two /metrics scrapes: the 4 requests of this rate, not the one before it."""
    names = ("vllm:time_to_first_token_seconds",)
    before = e2e_gpu.parse_histograms(METRICS_BEFORE, names)
    after = e2e_gpu.parse_histograms(METRICS_AFTER, names)
    got = e2e_gpu.histogram_deltas(before, after)["time_to_first_token_seconds"]
    assert got["count"] == 4 and got["mean_ms"] == 25.0  # (0.105 - 0.005) / 4
    assert got["p50_ms"] == 20.0  # 2 of 4 in (10, 20] ms: the 2nd observation ends that bucket
    assert got["p99_ms"] == 39.6  # rank 3.96 of 4: 2 before the (20, 40] ms bucket, 0.98 of its way
    assert e2e_gpu.histogram_deltas(after, after) == {}  # no request between the scrapes
