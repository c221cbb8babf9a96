"""bench/e2e_gpu.py's bookkeeping (rows, goodput, resuming), on CPU with no server."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from lmcache_p2p.cli.demo import Lookup

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


def test_lmcache_pd_handover_is_prefill_answer_to_first_decoded_byte(e2e_gpu) -> None:
    """LMCache PD's stamps (seconds) give its handover as the lmcache_p2p proxy defines its own."""
    timings = [{"t_tokenized": 0.0, "t_prefill_done": 1.0, "t_kv_ready": 1.0 + k / 1e3, "t_decode_first_byte": 1.0 + h / 1e3}
               for k, h in ((0, 20), (5, 30), (1, 40), (0, 10))]
    timings.append({"t_decode_first_byte": 9.0})  # a decode leg whose prefill stamps were not matched: left out
    got = e2e_gpu.pd_handover_fields(timings)
    assert got["pd_timing_ms"]["handover"]["count"] == 4
    assert got["handover_ms_p50"] == pytest.approx(20.0) and got["handover_ms_p99"] == pytest.approx(40.0)
    assert got["kv_wait_ms_p50"] == pytest.approx(0.0) and got["kv_wait_ms_p99"] == pytest.approx(5.0)
    assert e2e_gpu.pd_handover_fields([])["handover_ms_p50"] is None


def test_nearest_rank_matches_the_proxy_s_percentiles(e2e_gpu) -> None:
    from lmcache_p2p.proxy.observe.metrics import _percentile

    values = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    for pct in (1, 50, 90, 99, 100):
        assert e2e_gpu.nearest_rank(values, pct) == _percentile(sorted(values), pct)


def test_transfer_fields_and_ratio_to_the_ceiling(e2e_gpu) -> None:
    stats = {"handover_ms": {"count": 7}, "timeline_ms": {"transfer": {"count": 7, "mean": 2.5, "p50": 2.0, "p99": 4.0},
                                                          "store": {"count": 7, "mean": 3.0, "p50": 3.0, "p99": 5.0}}}
    row = e2e_gpu.transfer_fields(stats)
    assert (row["kv_transfer_ms_p50"], row["kv_transfer_ms_p99"], row["kv_transfer_samples"]) == (2.0, 4.0, 7)
    assert row["handover_samples"] == 7
    row["kv_bytes_per_request"] = 128 << 20
    ceilings = [{"nbytes": 64 << 20, "chunked_ms_p50": 0.2}, {"nbytes": 128 << 20, "chunked_ms_p50": 0.4,
                                                               "host_h2d_peer_ms_p50": 1.0},
                {"nbytes": 64 << 20, "chunked_ms_p50": 0.1}]
    got = e2e_gpu.transfer_vs_ceiling(row, ceilings)  # the last ceiling measured for the same bytes
    assert got == {"kv_transfer_ceiling_ms": 0.4, "kv_transfer_vs_ceiling_p50": 0.2, "kv_transfer_vs_ceiling_p99": 0.1,
                   "kv_transfer_vs_host_path_p50": 0.5}
    row["kv_write_ms_p50"] = 0.5
    assert e2e_gpu.transfer_vs_ceiling(row, ceilings)["kv_write_vs_ceiling_p50"] == 0.8
    assert e2e_gpu.transfer_vs_ceiling({"kv_transfer_ms_p50": None}, ceilings) == {}
    assert e2e_gpu.transfer_vs_ceiling(row, []) == {}


def test_kv_bytes_per_request_from_the_proxy_s_counters(e2e_gpu) -> None:
    text = """# TYPE lmcache_p2p_proxy_kv_bytes_total counter
lmcache_p2p_proxy_kv_bytes_total 4.0e+08
lmcache_p2p_proxy_kv_bytes_created 1.7e+09
lmcache_p2p_proxy_kv_outcomes_total{outcome="ready"} 3.0
lmcache_p2p_proxy_kv_outcomes_total{outcome="timeout"} 1.0
"""
    after = e2e_gpu.parse_counters(text, e2e_gpu.PROXY_COUNTERS)
    before = {"lmcache_p2p_proxy_kv_bytes_total": {"": 1.0e8}, "lmcache_p2p_proxy_kv_outcomes_total": {'outcome="ready"': 1.0}}
    assert e2e_gpu.kv_bytes_fields(before, after) == {"kv_bytes_per_request": 150_000_000}
    assert e2e_gpu.kv_bytes_fields(after, after) == {"kv_bytes_per_request": None}


def test_handover_split_is_the_decoder_s_part_and_the_rest(e2e_gpu) -> None:
    row = {"handover_ms_p50": 30.0, "proxy_stats": {"handover_ms": {"mean": 40.0}},
           "vllm_metrics": {"decoder": {"time_to_first_token_seconds": {"mean_ms": 17.0, "p50_ms": 15.0, "p99_ms": 30.0},
                                        "request_queue_time_seconds": {"mean_ms": 0.1},
                                        "request_prefill_time_seconds": {"mean_ms": 11.0}}}}
    got = e2e_gpu.handover_split(row)
    assert got["outside_decoder_ms_mean"] == 23.0 and got["decoder_prefill_ms_mean"] == 11.0
    pd_row = {"pd_timing_ms": {"handover": {"mean": 20.0}}, "vllm_metrics": row["vllm_metrics"]}
    assert e2e_gpu.handover_split(pd_row)["outside_decoder_ms_mean"] == 3.0
    assert e2e_gpu.handover_split({"vllm_metrics": {"single": {}}}) is None


def test_handover_split_names_the_proxy_phases_and_the_single_floor(e2e_gpu) -> None:
    timeline = {"kv_wait": {"mean": 2.0}, "decode_start": {"mean": 0.5}, "decode_accept": {"mean": 1.5},
                "decode_first": {"mean": 20.0}, "queue": {"mean": 9.0}}
    row = {"proxy_stats": {"handover_ms": {"mean": 22.5}, "timeline_ms": timeline},
           "vllm_metrics": {"decoder": {"time_to_first_token_seconds": {"mean_ms": 17.0}}}}
    got = e2e_gpu.handover_split(row)
    assert (got["kv_wait_ms_mean"], got["decode_start_ms_mean"], got["decode_accept_ms_mean"],
            got["decode_first_ms_mean"]) == (2.0, 0.5, 1.5, 20.0)
    assert "queue_ms_mean" not in got and got["outside_decoder_ms_mean"] == 5.5
    single = {"ttft_ms_mean": 52.0, "vllm_metrics": {"single": {"time_to_first_token_seconds": {"mean_ms": 48.5}}}}
    assert e2e_gpu.single_outside_engine(single) == 3.5
    assert e2e_gpu.single_outside_engine({"ttft_ms_mean": None, "vllm_metrics": single["vllm_metrics"]}) is None


def test_proxy_workers_default_and_fallback_without_the_flag(e2e_gpu) -> None:
    assert e2e_gpu.resolve_proxy_workers(None, "cuda", True, 32) == (8, None)
    assert e2e_gpu.resolve_proxy_workers(None, "cuda", True, 16) == (4, None)
    assert e2e_gpu.resolve_proxy_workers(None, "cpu", True, 32) == (1, None)
    workers, note = e2e_gpu.resolve_proxy_workers(None, "cuda", False, 32)
    assert workers == 1 and "--proxy-workers" in note
    assert e2e_gpu.resolve_proxy_workers(3, "cuda", True, 2) == (3, None)


def test_lmcache_p2p_rows_of_another_proxy_worker_count_are_not_reused(e2e_gpu, tmp_path) -> None:
    base = ["--model", str(tmp_path), "--rates", "2", "--results-dir", str(tmp_path / "parts"),
            "--log-dir", str(tmp_path / "logs")]
    one, _ = e2e_gpu.parse_args(base)
    one.results_dir.mkdir()
    row = e2e_gpu.make_row("lmcache_p2p-nixl", 2.0, bench_result(["x"]), None, [], OUTPUT_LEN)
    e2e_gpu.save_cached(one, "lmcache_p2p-nixl", {"2": row})
    eight, _ = e2e_gpu.parse_args([*base, "--proxy-workers", "8"])
    assert e2e_gpu.load_cached(eight, "lmcache_p2p-nixl") == {}
    assert set(e2e_gpu.load_cached(one, "lmcache_p2p-nixl")) == {"2"}
    e2e_gpu.save_cached(eight, "lmcache_p2p-nixl", {"2": row})  # the other count's rows are moved aside, not lost
    kept = [p for p in one.results_dir.iterdir() if p.name.startswith("lmcache_p2p-nixl.") and p.name != "lmcache_p2p-nixl.json"]
    assert len(kept) == 1 and json.loads(kept[0].read_text())["workload"] == e2e_gpu.workload(one, "lmcache_p2p-nixl")


def test_kv_bytes_per_token_of_the_8b_shape(e2e_gpu, tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 32, "num_key_value_heads": 8,
                                                      "hidden_size": 4096, "num_hidden_layers": 32}))
    assert e2e_gpu.kv_bytes_per_token(tmp_path) == 128 << 10  # 1024 tokens: 128 MiB


def test_run_rate_fills_the_new_fields_from_the_servers_answers(e2e_gpu, tmp_path, monkeypatch) -> None:
    """One rate against fake servers: proxy /stats + /metrics, LMCache PD's /pd_stats, vLLM /metrics."""
    cfg, _ = e2e_gpu.parse_args(["--model", str(tmp_path), "--rates", "2", "--output-len", str(OUTPUT_LEN),
                                 "--results-dir", str(tmp_path / "parts"), "--log-dir", str(tmp_path / "logs"),
                                 "--run-label", "test pass"])
    stats = {"handover_ms": {"count": 3, "mean": 30.0, "p50": 25.0, "p99": 40.0}, "kv_wait_ms": {"p50": 0.1, "p99": 1.0},
             "timeline_ms": {"transfer": {"count": 3, "mean": 1.0, "p50": 0.9, "p99": 2.0}}, "recent": []}
    counters = iter(['lmcache_p2p_proxy_kv_bytes_total 0\n', 'lmcache_p2p_proxy_kv_bytes_total 300\n'
                     'lmcache_p2p_proxy_kv_outcomes_total{outcome="ready"} 3\n'])
    pd = {"timings": [{"t_prefill_done": 1.0, "t_kv_ready": 1.0, "t_decode_first_byte": 1.05}]}

    class Answer:
        def __init__(self, body):
            self.body = body
            self.text = body if isinstance(body, str) else ""

        def json(self):
            return self.body

        def raise_for_status(self):
            return None

    def get(url, timeout):
        if url.endswith("/stats"):
            return Answer(stats)
        if url.endswith("/pd_stats"):
            return Answer(pd)
        if url.endswith(":9100/metrics"):
            return Answer(next(counters))
        scraped[url] = scraped.get(url, 0) + 1  # each vLLM server: before, then after the rate
        return Answer(METRICS_BEFORE if scraped[url] % 2 else METRICS_AFTER)

    scraped: dict[str, int] = {}

    def run(argv, **kwargs):
        name = argv[argv.index("--result-filename") + 1]
        result_dir = Path(argv[argv.index("--result-dir") + 1])
        (result_dir / name).write_text(json.dumps(bench_result(["a", "b", "c"])))
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(e2e_gpu.httpx, "get", get)
    monkeypatch.setattr(e2e_gpu.httpx, "post", lambda url, timeout: Answer({}))
    monkeypatch.setattr(e2e_gpu.subprocess, "run", run)
    (cfg.log_dir / "lmcache_p2p-nixl").mkdir(parents=True)
    dep = e2e_gpu.Deployment("lmcache_p2p-nixl", "http://127.0.0.1:9100", lambda: None, None, True,
                             (("prefiller", 7100), ("decoder", 7200)))
    row = e2e_gpu.run_rate(cfg, dep, 2.0)
    assert (row["handover_ms_p50"], row["kv_transfer_ms_p50"], row["kv_bytes_per_request"]) == (25.0, 0.9, 100)
    assert row["proxy_workers"] == 1 and row["measured"] == "test pass" and row["handover_source"].startswith("lmcache_p2p")
    split = row["handover_split"]  # the decoder's TTFT over the rate: 4 requests, mean 25 ms (METRICS_*)
    assert (split["handover_ms_mean"], split["decoder_ttft_ms_mean"], split["outside_decoder_ms_mean"]) == (30.0, 25.0, 5.0)
    (cfg.log_dir / "lmcache-pd").mkdir(parents=True)
    dep = e2e_gpu.Deployment("lmcache-pd", "http://127.0.0.1:9000", lambda: None, None, False,
                             (("prefiller", 8100), ("decoder", 8200)), pd_stats=True)
    row = e2e_gpu.run_rate(cfg, dep, 2.0)
    assert row["handover_ms_p50"] == pytest.approx(50.0) and row["proxy_workers"] == 1
    assert row["handover_source"].startswith("LMCache PD")
    assert row["handover_split"]["outside_decoder_ms_mean"] == pytest.approx(25.0)


def test_each_rate_has_its_own_prompts_and_lmcache_pd_s_buffer_holds_them_all(e2e_gpu, tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 32, "num_key_value_heads": 8,
                                                      "hidden_size": 4096, "num_hidden_layers": 32}))
    cfg, _ = e2e_gpu.parse_args(["--model", str(tmp_path), "--rates", "8,16,32,48", "--num-prompts", "128",
                                 "--log-dir", str(tmp_path / "logs")])
    seeds = {e2e_gpu.prompt_seed(r) for r in cfg.rates}
    assert len(seeds) == 4
    argv = e2e_gpu.bench_argv(cfg, "http://x", 16.0, tmp_path, "r.json")
    assert argv[argv.index("--seed") + 1] == str(e2e_gpu.prompt_seed(16.0))
    gpu = 141 << 30
    assert e2e_gpu.pd_receive_buffer_bytes(cfg, gpu) == 4 * 128 * (128 << 20) + (2 << 30)  # 66 GiB
    assert e2e_gpu.pd_receive_buffer_bytes(cfg, 100 << 30) == 50 << 30  # at most half the GPU
    fixed = dataclasses.replace(cfg, lmcache_pd_receive_buffer_size="8GB")
    assert e2e_gpu.pd_receive_buffer_bytes(fixed, gpu) == 8 << 30


def test_send_buffer_size_goes_to_lmcache_p2p_but_not_to_its_hostsend_variant(e2e_gpu, tmp_path, monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(e2e_gpu, "start_p2p", lambda cfg, transport, **kw: calls.append((transport, kw)))
    base = ["--model", str(tmp_path), "--log-dir", str(tmp_path / "logs")]
    small, _ = e2e_gpu.parse_args([*base, "--send-buffer-size", "64MB"])
    default, _ = e2e_gpu.parse_args(base)
    e2e_gpu.start("lmcache_p2p-nixl", small)
    e2e_gpu.start("lmcache_p2p-nixl-hostsend", small)
    e2e_gpu.start("lmcache_p2p-nccl", default)
    assert calls == [("nixl", {"send_buffer_size": "64MB"}), ("nixl", {"send_buffer_size": "0"}),
                     ("nccl", {"send_buffer_size": None})]


def test_the_early_decode_system_is_lmcache_p2p_nixl_with_the_proxy_flag_and_nothing_else(e2e_gpu, tmp_path,
                                                                                           monkeypatch) -> None:
    """lmcache_p2p-nixl-early (the A/B of --early-decode): the same launch as lmcache_p2p-nixl plus the proxy flag."""
    cfg, _ = e2e_gpu.parse_args(["--model", str(tmp_path), "--log-dir", str(tmp_path / "logs"), "--systems",
                                 "lmcache_p2p-nixl,lmcache_p2p-nixl-early", "--send-buffer-size", "64MB"])
    assert cfg.systems == ("lmcache_p2p-nixl", "lmcache_p2p-nixl-early") and e2e_gpu.GPUS["lmcache_p2p-nixl-early"] == 2
    plain = e2e_gpu.p2p_launch_argv(cfg, "nixl", "stop", "lmcache_p2p-nixl", "64MB")
    early = e2e_gpu.p2p_launch_argv(cfg, "nixl", "stop", "lmcache_p2p-nixl", "64MB", early_decode=True)
    at = early.index("--proxy-arg=--early-decode")
    assert early[:at] + early[at + 1:] == plain and at < early.index("--")  # a launch flag, not a vLLM one
    from lmcache_p2p.cli.main import build_parser

    launch_args = build_parser().parse_args(early[early.index("launch"):early.index("--")])
    assert launch_args.proxy_arg == ["--early-decode"] and launch_args.transport == "nixl"
    calls = []
    monkeypatch.setattr(e2e_gpu, "start_p2p", lambda cfg, transport, **kw: calls.append((transport, kw)))
    e2e_gpu.start("lmcache_p2p-nixl-early", cfg)
    assert calls == [("nixl", {"send_buffer_size": "64MB", "early_decode": True})]


def test_a_rows_lookups_are_each_requests_last_one(tmp_path) -> None:
    """A decode held for its KV is looked up on every scheduler step: the row counts the lookup it loaded."""
    from lmcache_p2p.cli.demo import final_lookups, request_lookups_in_log

    line = "LMCache INFO: Reqid: {}, Total tokens {}, Inference Engine computed tokens: 0, LMCache hit tokens: {}, ..."
    log = tmp_path / "decoder-0.log"
    log.write_text("\n".join([line.format("cmpl-a-0", 1025, 512), line.format("cmpl-b-0", 300, 299),
                              line.format("cmpl-a-0", 1025, 768), line.format("cmpl-a-0", 1025, 1024)]))
    assert final_lookups(request_lookups_in_log(log)) == [Lookup(1025, 1024), Lookup(300, 299)]
    assert final_lookups(request_lookups_in_log(log)[1:]) == [Lookup(300, 299), Lookup(1025, 1024)]


def test_long_points_are_rows_keyed_by_length_and_rate_in_that_order(e2e_gpu, tmp_path, monkeypatch) -> None:
    cfg, _ = e2e_gpu.parse_args(["--model", str(tmp_path), "--systems", "single", "--long", "16000:0.5:12,8000:seq:4",
                                 "--results-dir", str(tmp_path / "parts"), "--out", str(tmp_path / "out.json"),
                                 "--log-dir", str(tmp_path / "logs")])
    assert cfg.long_points == (e2e_gpu.Point(16000, 0.5, 12), e2e_gpu.Point(8000, 0.0, 4))
    ran = []

    class Dep:
        system = "single"

        def stop(self) -> None:
            pass

    def run_rate(pcfg, dep, rate, key):
        ran.append((key, pcfg.input_len, pcfg.num_prompts, rate))
        return e2e_gpu.make_row(dep.system, rate, bench_result(["x"]), None, [], OUTPUT_LEN)

    monkeypatch.setattr(e2e_gpu, "start", lambda system, _cfg: Dep())
    monkeypatch.setattr(e2e_gpu, "run_rate", run_rate)
    cfg.results_dir.mkdir()
    assert e2e_gpu.run_system(cfg, "single") is None
    assert ran == [("16000@0.5", 16000, 12, 0.5), ("8000@seq", 8000, 4, 0.0)]
    assert [r["rate"] for r in e2e_gpu.assemble(cfg, [])["rows"]] == [0.0, 0.5]  # 8000 first
    with pytest.raises(SystemExit):
        e2e_gpu.parse_args(["--model", str(tmp_path), "--long", "16000:0.5"])


def test_a_sequential_point_sends_one_request_at_a_time(e2e_gpu, tmp_path) -> None:
    cfg, _ = e2e_gpu.parse_args(["--model", str(tmp_path), "--long", "8000:seq:4"])
    argv = e2e_gpu.bench_argv(cfg, "http://x", 0.0, tmp_path, "n.json")
    assert argv[argv.index("--request-rate") + 1] == "inf" and argv[argv.index("--max-concurrency") + 1] == "1"
    assert "--max-concurrency" not in e2e_gpu.bench_argv(cfg, "http://x", 0.5, tmp_path, "n.json")


def test_request_timelines_attribute_each_step_s_stores_to_its_request(e2e_gpu) -> None:
    events = [
        {"ev": "exec", "t0": 10.0, "t1": 10.2, "reqs": {"a": 8192}},
        {"ev": "save", "t0": 10.15, "t1": 10.19}, {"ev": "store", "t0": 10.16, "t1": 10.19, "req": "a"},
        {"ev": "sync", "t0": 10.17, "t1": 10.185}, {"ev": "submit", "t0": 10.17, "t1": 10.19, "host_chunks": 2},
        {"ev": "gather", "t0": 10.165, "t1": 10.166, "gpu_ms": 14.0},
        {"ev": "gpu_step", "t0": 10.0, "gpu_ms": 190.0, "gap_ms": 50.0},
        {"ev": "exec", "t0": 10.21, "t1": 10.4, "reqs": {"a": 7808}},
        {"ev": "store", "t0": 10.41, "t1": 10.42, "req": "other"},  # another request's: not a's
        {"ev": "gpu_step", "t0": 10.21, "gpu_ms": 180.0, "gap_ms": 9.0},
        {"ev": "first", "t": 10.45, "reqs": ["a"]},
        {"ev": "exec", "t0": 20.0, "t1": 20.1, "reqs": {"late": 100}}, {"ev": "first", "t": 20.2, "reqs": ["late"]},
    ]
    (a,) = e2e_gpu.request_timelines(events, 9.0, 15.0, others=[(10.3, 10.5)])
    assert (a["req"], a["tokens"], a["steps"]) == ("a", 16000, 2)
    assert a["engine_ms"] == pytest.approx(450.0) and a["between_ms"] == pytest.approx(10.0)
    assert a["tail_ms"] == pytest.approx(50.0) and a["exec_ms"] == pytest.approx(390.0)
    assert (a["store_ms"], a["sync_ms"], a["gather_gpu_ms"], a["host_chunks"], a["stores"]) == (
        pytest.approx(30.0), pytest.approx(15.0), 14.0, 2, 1)
    assert a["gpu_step_ms"] == 370.0 and a["gpu_gap_ms"] == 9.0  # the gap before its first step is not its own
    assert a["other_engine_busy_ms"] == pytest.approx(150.0)  # 10.3 -> 10.45
    summary = e2e_gpu.summarise_timelines([a])
    assert summary["requests"] == 1 and summary["engine_ms_p50"] == pytest.approx(450.0)
    assert e2e_gpu.summarise_timelines([]) == {"requests": 0}


def test_read_traces_keys_each_engine_by_its_port_and_skips_cut_lines(e2e_gpu, tmp_path) -> None:
    (tmp_path / "trace-1.jsonl").write_text(json.dumps({"ev": "proc", "argv": ["serve", "m", "--port", "7100"]}) + "\n"
                                            + json.dumps({"ev": "exec", "t0": 1, "t1": 2, "reqs": {}}) + "\n{\"ev\": ")
    (tmp_path / "trace-2.jsonl").write_text(json.dumps({"ev": "proc", "argv": ["proxy"]}) + "\n")  # no steps
    traces = e2e_gpu.read_traces(tmp_path)
    assert list(traces) == [7100] and [e["ev"] for e in traces[7100]] == ["proc", "exec"]


def test_a_long_point_may_name_its_output_length_and_lmcache_pd_buffers_its_points(e2e_gpu, tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 32, "num_key_value_heads": 8,
                                                      "hidden_size": 4096, "num_hidden_layers": 32}))
    cfg, _ = e2e_gpu.parse_args(["--model", str(tmp_path), "--long", "16000:0.5:12:256,16000:seq:4",
                                 "--output-len", "2"])
    assert cfg.long_points == (e2e_gpu.Point(16000, 0.5, 12, 256), e2e_gpu.Point(16000, 0.0, 4))
    steps = e2e_gpu.steps_of(cfg)
    assert [(key, pcfg.output_len) for key, pcfg, _ in steps] == [("16000@0.5/256", 256), ("16000@seq", 2)]
    assert sorted(["16000@0.5/256", "16000@0.5", "16000@seq"], key=e2e_gpu.row_order) == [
        "16000@seq", "16000@0.5", "16000@0.5/256"]
    # LMCache PD's decoder keeps every prompt it received: the points' prompts (16 x 16000 tokens) + 2 GiB
    assert e2e_gpu.pd_receive_buffer_bytes(cfg, 1 << 40) == 131072 * 16000 * 16 + (2 << 30)
    with pytest.raises(SystemExit):
        e2e_gpu.parse_args(["--model", str(tmp_path), "--long", "16000:0.5:12:256:9"])


def test_single_neighbour_is_a_one_gpu_system_measured_like_single(e2e_gpu, tmp_path, monkeypatch) -> None:
    cfg, _ = e2e_gpu.parse_args(["--model", str(tmp_path), "--systems", "single-neighbour", "--one-gpu"])
    started = []
    monkeypatch.setattr(e2e_gpu, "start_single_neighbour", lambda c: started.append(c.systems) or "dep")
    assert e2e_gpu.start("single-neighbour", cfg) == "dep" and started == [("single-neighbour",)]
    row = e2e_gpu.make_row("single-neighbour", 0.5, bench_result(["x"]), None, [], OUTPUT_LEN)
    assert row["gpus"] == 1 and row["kv_lookups"] is None and row["kv_full_hits"] is None
