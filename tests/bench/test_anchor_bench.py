"""bench/anchor.py's summary math and bookkeeping, with no server: percentiles, failures, output
equality, LMCache hit ratio from real decoder log lines, handovers, rows and the assembled result."""

from __future__ import annotations

import pytest

# Real log lines (LMCache 0.5.6's vLLM adapter, colours included), from a bench/anchor.py --quick run:
# lmcache_p2p's decoder-0.log, LMCache PD's pd_dec.log (with its "Retrieved" line, not a lookup), and
# a prefiller's lookup that hit nothing (an earlier run's log).
DECODER_LOGS = (
    "\x1b[32;20m[2026-11-30 18:39:33,678] LMCache INFO:\x1b[0m Reqid: cmpl-9d30975c3f8165d5-0-a7fc9ef2, Total tokens "
    "236, Inference Engine computed tokens: 0, LMCache hit tokens: 235, need to load: 235 \x1b[3m(vllm_v1_adapter.py:"
    "1476:lmcache.integration.vllm.vllm_v1_adapter)\x1b[0m\n"
    "\x1b[32;20m[2026-11-30 18:43:03,201] LMCache INFO:\x1b[0m Reqid: cmpl-86b25d3518ccd5be-0-94820aba, Total tokens "
    "897, Inference Engine computed tokens: 0, LMCache hit tokens: 896, need to load: 896 \x1b[3m(vllm_v1_adapter.py:"
    "1476:lmcache.integration.vllm.vllm_v1_adapter)\x1b[0m\n"
    "\x1b[32;20m[2026-11-30 18:43:03,223] LMCache INFO:\x1b[0m [req_id=cmpl-86b25d3518ccd5be-0-94820aba] Retrieved 896 "
    "out of 896 required tokens (from 896 total tokens). size: 0.0004 gb, cost 16.2191 ms\n"
    "\x1b[32;20m[2026-11-30 17:38:51,876] LMCache INFO:\x1b[0m Reqid: cmpl-a6abb945de85f761-0-a80ec44b, Total tokens "
    "740, Inference Engine computed tokens: 0, LMCache hit tokens: 0, need to load: 0 \x1b[3m(vllm_v1_adapter.py:"
    "1476:lmcache.integration.vllm.vllm_v1_adapter)\x1b[0m\n"
)


def rec(i, ttft_s=0.05, e2e_s=0.2, ids=None, ok=True, t_send=100.0):
    return {"i": i, "ok": ok, "t_send": t_send, "t_first": t_send + ttft_s if ok else None,
            "t_done_client": t_send + e2e_s, "token_ids": list(range(32)) if ids is None else ids}


def test_percentile_is_nearest_rank(anchor):
    values = [float(v) for v in range(1, 101)]
    assert anchor.percentile(values, 50) == 50.0
    assert anchor.percentile(values, 99) == 99.0
    assert anchor.percentile([7.0], 99) == 7.0
    assert anchor.percentile([], 50) is None


def test_failed_counts_errors_and_short_outputs(anchor):
    records = [rec(0), rec(1, ok=False), rec(2, ids=list(range(31)))]
    assert anchor.failed(records) == 2


def test_ttft_and_throughput_use_successful_requests_only(anchor):
    records = [rec(0, ttft_s=0.010), rec(1, ttft_s=0.030), rec(2, ok=False)]
    assert anchor.ttfts_s(records) == pytest.approx([0.010, 0.030])
    assert anchor.output_tokens_per_s(records, wall_s=2.0) == 32.0


def test_compare_outputs_per_prompt(anchor):
    ref = [rec(0, ids=[1, 2]), rec(1, ids=[3, 4]), rec(2, ids=[5, 6])]
    assert anchor.compare_outputs([rec(0, ids=[1, 2]), rec(1, ids=[3, 4])], ref) == (True, 0)
    assert anchor.compare_outputs([rec(0, ids=[1, 2]), rec(1, ids=[3, 5])], ref) == (False, 1)
    # a failed request is not compared; a prompt the reference lacks neither
    assert anchor.compare_outputs([rec(0, ids=[9], ok=False), rec(7, ids=[1])], ref) == (None, None)
    assert anchor.compare_outputs([rec(0)], None) == (None, None)


def test_pd_stream_first_id_from_the_nonstream_pass(anchor):
    full = list(range(100, 132))
    streamed = [rec(0, ids=full[1:]), rec(1, ids=[7] * 31), rec(2, ids=full), rec(3, ids=full[1:], ok=False)]
    nonstream = [rec(0, ids=full), rec(1, ids=full), rec(2, ids=full), rec(3, ids=full)]
    records, completed = anchor.complete_pd_stream_ids(streamed, nonstream)
    assert completed == 1 and records[0]["token_ids"] == full
    assert records[1]["token_ids"] == [7] * 31  # the tail differs: left as it is, counts as failed
    assert anchor.failed(records) == 2  # request 1 (31 ids) and request 3 (not ok)


def test_compare_texts(anchor):
    ref = [{**rec(0), "text": "ab"}, {**rec(1), "text": "c"}]
    assert anchor.compare_texts([{**rec(0), "text": "ab"}], ref) is True
    assert anchor.compare_texts([{**rec(1), "text": "x"}], ref) is False
    assert anchor.compare_texts([{**rec(5), "text": "x"}], ref) is None


def test_lookups_from_real_log_lines(anchor):
    lookups = anchor.parse_lookups(DECODER_LOGS)
    assert lookups == [anchor.Lookup(236, 235), anchor.Lookup(897, 896), anchor.Lookup(740, 0)]
    # hit / (total - 1): the last token is always computed (skip_last_n_tokens=1)
    assert anchor.kv_hit_ratio(lookups[:2]) == 1.0
    assert anchor.kv_hit_ratio(lookups) == round((235 + 896) / (235 + 896 + 739), 4)
    assert anchor.kv_hit_ratio([]) is None


def test_pd_handover_and_timeline(anchor):
    timings = [{"t_arrive": 0.0, "t_tokenized": 0.002, "t_prefill_done": 0.020, "t_kv_ready": 0.025,
                "t_decode_first_byte": 0.070},
               {"t_arrive": 1.0, "t_tokenized": 1.001, "t_prefill_done": 1.010, "t_kv_ready": 1.010,
                "t_decode_first_byte": 1.040}]
    assert [round(x, 6) for x in anchor.pd_handovers_s(timings)] == [0.050, 0.030]
    timeline = anchor.pd_timeline(timings)
    assert timeline["kv_wait"]["count"] == 2 and timeline["kv_wait"]["p99"] == pytest.approx(5.0)
    assert timeline["recent"][0]["decode_first"] == pytest.approx(45.0)


def test_p2p_handover_from_the_stats_timeline(anchor):
    stats = {"handover_ms": {"p50": 1.0}, "timeline_ms": {"kv_wait": {"count": 2, "mean": 1.0, "p50": 1.0, "p99": 1.0}},
             "recent": [{"req_id": "a", "queue": 0.5, "kv_wait": 1.0, "decode_start": 2.0, "decode_first": 10.0},
                        {"req_id": "b", "handover": 7.5},
                        {"req_id": "c", "kv_wait": 1.0, "decode_start": None, "decode_first": None}]}  # no decode
    timeline = anchor.p2p_timeline(stats)
    assert timeline["kv_wait"]["count"] == 2 and len(timeline["recent"]) == 3
    assert anchor.p2p_handovers_ms(timeline) == [13.0, 7.5]
    # a proxy without the timeline
    assert anchor.p2p_timeline({"handover_ms": {"p50": 1.0}}) is None
    assert anchor.p2p_handovers_ms(None) == []


def test_rows_and_result(anchor):
    single = anchor.LoadRun("single", "c1", [rec(0, ids=[1] * 32), rec(1, ids=[2] * 32)], 1.0, [])
    p2p = anchor.LoadRun("lmcache_p2p", "c1", [rec(0, ids=[1] * 32), rec(1, ids=[3] * 32)], 2.0,
                         [anchor.Lookup(101, 100)],
                         stats={"handover_ms": {"count": 2, "mean": 5.0, "p50": 4.0, "p99": 6.0},
                                "timeline_ms": {"prefill": {"count": 2, "mean": 3.0, "p50": 3.0, "p99": 3.0}},
                                "recent": [{"req_id": "x", "kv_wait": 0.0, "decode_start": 1.0, "decode_first": 2.0}]})
    pd = anchor.LoadRun("lmcache-pd", "c1", [rec(0, ids=[1] * 32), rec(1, ids=[2] * 32, ok=False)], 2.0, [],
                        pd_timings=[{"t_prefill_done": 0.0, "t_decode_first_byte": 0.040, "t_kv_ready": 0.0}])
    result = anchor.assemble([single, p2p, pd], {"commit": "x"})
    rows = {r["system"]: r for r in result["rows"]}
    assert rows["single"]["outputs_equal_single"] is None and rows["single"]["kv_hit_ratio"] is None
    assert rows["lmcache_p2p"]["outputs_equal_single"] is False and rows["lmcache_p2p"]["outputs_differing"] == 1
    assert rows["lmcache_p2p"]["handover_ms_p50"] == 4.0 and rows["lmcache_p2p"]["kv_hit_ratio"] == 1.0
    assert rows["lmcache-pd"]["outputs_equal_single"] is True and rows["lmcache-pd"]["failed"] == 1
    assert rows["lmcache-pd"]["handover_ms_p50"] == pytest.approx(40.0)
    assert rows["single"]["ttft_ms_p50"] == pytest.approx(50.0) and rows["single"]["output_tokens_per_s"] == 64.0
    assert result["samples"]["single"]["c1"]["ttft_ms"] == [50.0, 50.0]
    assert set(result["timeline"]) == {"lmcache_p2p", "lmcache-pd"}
    assert result["timeline"]["lmcache_p2p"]["c1"]["recent"][0]["req_id"] == "x"
    assert result["samples"]["lmcache_p2p"]["c1"]["handover_ms"] == [3.0]
    assert "| lmcache-pd | c1 |" in anchor.anchor_table(result["rows"])


def test_a_load_that_stopped_short_counts_its_missing_requests_as_failed(anchor):
    cut = anchor.LoadRun("lmcache-pd", "c4", [rec(0)], 1.0, [], expected=48, error="RuntimeError: start_pd.sh exited 1")
    row = anchor.make_row(cut, None)
    assert row["failed"] == 47 and row["requests"] == 48 and row["error"].startswith("RuntimeError")
    assert anchor.make_row(anchor.LoadRun("single", "c1", [], 0.0, [], expected=8), None)["failed"] == 8


def test_loads_and_rescaled_workload(anchor):
    assert anchor.parse_load("c8") == ("closed", 8)
    assert anchor.parse_load("rate=4") == ("open", 4.0)
    for bad in ("c0", "rate=0", "open", "8"):
        with pytest.raises(ValueError, match="expected cN"):
            anchor.parse_load(bad)
    work = [{"i": 0, "arrival_s": 0.0}, {"i": 1, "arrival_s": 1.0}]
    assert [w["arrival_s"] for w in anchor.rescale_workload(work, 8.0)] == [0.0, 0.25]


def test_quick_and_full_settings(anchor, tmp_path):
    quick = anchor.parse_args(["--quick", "--log-dir", str(tmp_path)])
    assert quick.loads == ("c1",) and quick.n == 8 and quick.out == tmp_path / "anchor_cpu_quick.json"
    full = anchor.parse_args(["--systems", "lmcache-pd,single", "--log-dir", str(tmp_path)])
    assert full.systems == ("single", "lmcache-pd")  # the reference first
    assert full.loads == ("c1", "c4", "c8", "rate=2", "rate=4", "rate=8", "rate=16")
    assert full.out.name == "anchor_cpu.json" and full.out.parent.name == "results"


def test_anchor_env_keeps_the_two_plugins_apart(anchor, tmp_path):
    cfg = anchor.parse_args(["--log-dir", str(tmp_path)])
    env = anchor.anchor_env(cfg)
    assert env["VLLM_PLUGINS"] == "lmc_cpu_shim"
    assert env["ANCHOR_EAGER_FLAG"] == "" and env["ANCHOR_MAX_MODEL_LEN"] == "2048"
    assert env["ANCHOR_PREFILL_CORES"] == "0" and env["ANCHOR_DECODE_CORES"] == "1"
    assert "--max-num-batched-tokens 16384" in env["ANCHOR_PREFILL_ARGS"]


def test_setup_names_a_missing_harness(anchor, tmp_path):
    cfg = anchor.parse_args(["--anchor", str(tmp_path / "nowhere"), "--work", str(tmp_path / "w"),
                             "--log-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="no anchor harness at .*nowhere .*missing bench.py.*--anchor DIR"):
        anchor.setup_anchor(cfg)


def test_descendants_and_their_cpu_time(anchor, e2e):
    import os
    import subprocess

    child = subprocess.Popen(["sleep", "30"])
    try:
        assert {os.getpid(), child.pid} <= anchor.descendants(os.getpid())
        assert child.pid not in anchor.descendants(child.pid + 10**7)  # an unknown pid has no tree
    finally:
        child.kill()
        child.wait()
    assert e2e._jiffies([child.pid]) == 0  # gone: contributes nothing
    assert e2e._jiffies([os.getpid()]) >= 0


def test_launch_args_reach_lmcache_p2p_launch_and_default_to_none(anchor, tmp_path):
    plain = anchor.P2PSystem(anchor.parse_args(["--log-dir", str(tmp_path)]))
    assert not any(a.startswith("--cpu-placement") for a in plain.argv())
    ab = anchor.P2PSystem(anchor.parse_args(["--log-dir", str(tmp_path), "--launch-arg=--cpu-placement=workers"]))
    assert ab.argv()[-1] == "--cpu-placement=workers" and ab.argv()[:-1] == plain.argv()


def test_the_early_decode_system_launches_the_proxy_with_it_and_logs_apart(anchor, tmp_path):
    cfg = anchor.parse_args(["--log-dir", str(tmp_path), "--systems", "lmcache_p2p,lmcache_p2p-early"])
    plain, early = (anchor.make_system(cfg, name) for name in cfg.systems)
    assert "--proxy-arg=--early-decode" in early.argv() and "--proxy-arg=--early-decode" not in plain.argv()
    assert early.log_dir != plain.log_dir and early.name == "lmcache_p2p-early"


def test_an_early_decodes_handover_does_not_add_the_kv_wait_that_ran_beside_it(anchor):
    stats = {"timeline_ms": {"kv_wait": {"count": 2}},
             "recent": [{"req_id": "a", "kv_wait": 4.0, "decode_start": 0.5, "kv_after_decode": 3.5,
                         "decode_first": 9.0},
                        {"req_id": "b", "kv_wait": 1.0, "decode_start": 2.0, "kv_after_decode": None,
                         "decode_first": 10.0}]}
    assert anchor.p2p_handovers_ms(anchor.p2p_timeline(stats)) == [9.5, 13.0]


def test_a_p2p_decoder_counts_each_requests_last_lookup(anchor, tmp_path):
    system = anchor.make_system(anchor.parse_args(["--log-dir", str(tmp_path)]), "lmcache_p2p-early")
    system.log_dir.mkdir(parents=True)
    line = "Reqid: {req}, Total tokens {total}, Inference Engine computed tokens: 0, LMCache hit tokens: {hit}\n"
    system.decoder_log().write_text(line.format(req="r1", total=300, hit=0) + line.format(req="r1", total=300, hit=256)
                                    + line.format(req="r2", total=100, hit=99) + line.format(req="r1", total=300,
                                                                                             hit=299))
    assert system.lookups() == [anchor.Lookup(300, 299), anchor.Lookup(100, 99)]
