"""bench/meta.py's metadata block and bench/report.py's tables, marked-block updates and plots; the
results-file conventions of bench/transfer.py and bench/e2e.py (own file for --paths, equality count)."""

from __future__ import annotations

import json

import pytest


def small_anchor_result() -> dict:
    """A minimal anchor_cpu.json: two systems, c1 and one rate, samples and a timeline."""
    rows = []
    for system, ttft, tput in (("single", 20.0, 300.0), ("lmcache_p2p", 40.0, 200.0), ("lmcache-pd", 60.0, 150.0)):
        for load, k in (("c1", 1.0), ("rate=2", 1.5), ("rate=8", 3.0)):
            rows.append({"system": system, "load": load, "requests": 4, "ttft_ms_p50": ttft * k,
                         "ttft_ms_p99": ttft * k * 2, "handover_ms_p50": None if system == "single" else 10.0,
                         "handover_ms_p99": None if system == "single" else 20.0,
                         "output_tokens_per_s": tput * k, "failed": 0,
                         "outputs_equal_single": None if system == "single" else True,
                         "kv_hit_ratio": None if system == "single" else 1.0})
    samples = {s: {"c1": {"ttft_ms": [10.0, 20.0, 30.0, 80.0], "handover_ms": [] if s == "single" else [5.0, 9.0]}}
               for s in ("single", "lmcache_p2p", "lmcache-pd")}
    phase = {"count": 4, "mean": 3.0, "p50": 3.0, "p99": 5.0}
    timeline = {"lmcache_p2p": {"c1": {"queue": phase, "prefill": phase, "kv_wait": phase, "recent": []}},
                "lmcache-pd": {"c1": {"tokenize": phase, "prefill": phase, "recent": []}}}
    return {"meta": {"commit": "abc", "dirty": False}, "rows": rows, "samples": samples, "timeline": timeline}


def test_meta_fields(meta):
    block = meta.collect(["bench/x.py", "--flag", "a b"])
    assert set(block) == {"commit", "dirty", "date", "machine", "packages", "command", "load_1m_before"}
    assert len(block["commit"]) == 40 and isinstance(block["dirty"], bool)
    assert block["command"].endswith("bench/x.py --flag 'a b'")
    assert block["machine"]["cores"] >= 1 and isinstance(block["machine"]["gpus"], list)
    assert set(block["packages"]) == {"torch", "vllm", "lmcache", "nixl", "lmcache_p2p"}
    assert block["packages"]["lmcache"] == "0.5.6"
    json.dumps(block)  # it goes into a results file as it is


def test_report_reads_rows_old_and_new(report):
    assert report.rows_of([{"a": 1}]) == [{"a": 1}]
    assert report.rows_of({"meta": {}, "rows": [{"a": 2}]}) == [{"a": 2}]
    assert report.rows_of({"meta": {}}) == []
    assert report.meta_line([]) == "no metadata (written before bench/meta.py)"


def test_report_tables_and_marked_blocks(report, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "anchor_cpu.json").write_text(json.dumps(small_anchor_result()))
    (results / "transfer_cpu.json").write_text(json.dumps([{"path": "nixl-sm host->host", "chunk_bytes": 2 << 20,
                                                            "gbps": 11.9, "ceiling_gbps": 20.2, "ratio": 0.59}]))
    md = tmp_path / "B.md"
    md.write_text("intro\n<!-- table:anchor_cpu -->\nold table\n<!-- /table:anchor_cpu -->\n"
                  "<!-- table:unknown -->\nkept\n<!-- /table:unknown -->\nend\n")
    assert report.main(["--results", str(results), "--docs", str(tmp_path / "docs"), "--markdown", str(md),
                        "--no-plots"]) == 0
    text = md.read_text()
    assert "old table" not in text
    assert "| lmcache_p2p | c1 | 40.0 / 80.0 | - | - | 10.0 / 20.0 | 200 | 0/4 | yes | 1.000 | - |" in text
    assert "kept" in text and text.startswith("intro\n") and text.endswith("end\n")
    # rows ordered by load, then single, lmcache_p2p, lmcache-pd
    body = text.split("<!-- table:anchor_cpu -->\n")[1]
    assert body.index("| single | c1 |") < body.index("| lmcache-pd | c1 |") < body.index("| single | rate=2 |")
    assert "not checked (older bench)" in report.table_for("transfer_cpu", json.loads(
        (results / "transfer_cpu.json").read_text()))


def test_report_writes_pngs(report, tmp_path):
    pytest.importorskip("matplotlib")
    results = tmp_path / "results"
    results.mkdir()
    (results / "anchor_cpu.json").write_text(json.dumps(small_anchor_result()))
    docs = tmp_path / "docs"
    assert report.main(["--results", str(results), "--docs", str(docs), "--markdown", ""]) == 0
    names = sorted(p.name for p in docs.glob("*.png"))
    assert names == ["anchor_handover_cdf.png", "anchor_rate.png", "anchor_timeline.png", "anchor_ttft_cdf.png"]
    for png in docs.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_transfer_partial_runs_get_their_own_file(transfer):
    defaults = [n for n, s in transfer.PATHS["cuda"].items() if s.default]
    others = [n for n, s in transfer.PATHS["cuda"].items() if not s.default]
    assert transfer.default_out("cuda", defaults).name == "transfer_gpu.json"
    assert transfer.default_out("cuda", defaults[:1]).name == "transfer_gpu_subset.json"
    assert transfer.default_out("cuda", others[:1]).name == "transfer_gpu_alternatives.json"


def test_e2e_equality_count_leaves_out_the_reference(e2e):
    def row(path, concurrency, mismatched, equal=True):
        fields = {f: None for f in e2e.Row.__dataclass_fields__}
        fields.update(path=path, concurrency=concurrency, requests=64, failed=0, outputs_mismatched=mismatched,
                      outputs_equal_single=equal)
        return e2e.Row(**fields)

    rows = [row("direct", 1, 0), row("direct", 4, 0), row("proxy-1p1d", 1, 0), row("proxy-1p1d", 4, 2, False)]
    assert e2e.equality_summary(rows) == {"requests_compared_with_direct": 128, "requests_differing": 2,
                                          "requests_failed": 0}


def test_multiturn_table_and_plot(report, tmp_path):
    rows = [{"system": s, "policy": p, "turn": t, "requests": 4, "failed": 0, "ttft_ms_p50": 20.0 * t,
             "ttft_ms_p99": 40.0 * t, "kv_bytes_per_request": None if s == "single" else 1000.0 * t,
             "prefill_tokens_per_request": 100.0, "prompt_tokens_per_request": 300.0 * t,
             "decoder_reused_tokens_per_request": None, "same_decoder_as_previous_turn": None,
             "outputs_equal_single": None if s == "single" else True}
            for s, p in (("single", "none"), ("1p2d", "prefix")) for t in (1, 2)]
    table = report.table_for("multiturn_cpu", {"meta": {}, "rows": rows})
    assert "| 1p2d | prefix | 2 | 40.0 / 80.0 | 2000 | 100 | - | - | yes | 0 |" in table
    assert "| single | none | 1 | 20.0 / 40.0 | - | 100 | - | - | ref | 0 |" in table
    pytest.importorskip("matplotlib")
    path = report.plot_multiturn({"meta": {}, "rows": rows}, tmp_path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_fills_readmes_test_suite_sentence_from_its_file(report, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    slowest = [{"test": f"tests/e2e/test_x.py::test_{i}", "seconds": 100.0 - i} for i in range(10)]
    (results / "test_suite.json").write_text(json.dumps({"commit": "0123456789abcdef", "wall_s": 1135.4, "passed": 1012,
                                                         "skipped": 31, "failed": 0, "slowest": slowest}))
    readme = tmp_path / "README.md"
    readme.write_text("a\n<!-- table:test_suite -->\nplaceholder\n<!-- /table:test_suite -->\nb\n")
    bench = tmp_path / "B.md"
    bench.write_text("<!-- table:test_suite_slowest -->\n<!-- /table:test_suite_slowest -->\n")
    assert report.main(["--results", str(results), "--docs", str(tmp_path), "--markdown", str(readme), str(bench),
                        "--no-plots"]) == 0
    assert readme.read_text() == ("a\n<!-- table:test_suite -->\n`make test` took 19 minutes of wall time (1012 passed, "
                                  "31 skipped, 0 failed) at commit 0123456789 (`bench/results/test_suite.json`).\n"
                                  "<!-- /table:test_suite -->\nb\n")
    table = bench.read_text()
    assert "| `tests/e2e/test_x.py::test_0` | 100.0 |" in table and table.count("| `tests/e2e") == 10


def test_report_tables_of_the_long_prompts_tp_engine_and_multihost_files(report):
    long = report.table_for("e2e_gpu_long", {"rows": [
        {"system": "single", "label": "single", "run": 13, "prompt_tokens": 16000, "ttft_ms_p50": 473.0,
         "ttft_ms_p99": 906.8, "prefill_side_overhead_vs_single_p50": None, "engine_ms_p50": 452.0,
         "lmcache_store_ms_per_request": 0.0, "failed": 0},
        {"system": "lmcache_p2p-nixl 1P1D", "label": "1P1D", "run": 13, "prompt_tokens": 16000, "ttft_ms_p50": 476.9,
         "ttft_ms_p99": 990.5, "prefill_side_overhead_vs_single_p50": 0.0081, "engine_ms_p50": 447.6,
         "lmcache_store_ms_per_request": 8.3, "proxy_queue_ms_p50": 5.4, "proxy_first_byte_ms_p50": 2.5,
         "handover_ms_p50": 32.6, "handover_ms_p99": 606.7, "kv_bytes_per_request": 2097283072, "kv_hit_ratio": 1.0,
         "failed": 0},
        {"system": "lmcache_p2p-nixl 1P1D, decoder busy", "label": "busy", "run": 6, "prompt_tokens": 16000,
         "ttft_ms_p50": 922.7, "ttft_ms_p99": 1474.7, "prefill_side_overhead_vs_single_p50": 0.9132, "failed": 0}]})
    assert "| **run 13** single | 16k | 473.0 / 906.8 | ref | 452.0 | - | - | - | - | - | 0 |" in long
    assert ("| **run 13** 1P1D | 16k | 476.9 / 990.5 | +0.8 % | 447.6 | 8.3 | 5.4 + 2.5 | 32.6 / 606.7 | 2.10 GB | "
            "1.00 | 0 |") in long
    assert "| **run 6** busy | 16k | 922.7 / 1474.7 | 1.91x |" in long
    engine = report.table_for("tp_engine", {"rows": [
        {"transport": "nccl", "p_tp": 1, "d_tp": 2, "ready_ms_p50": 53.3, "ready_ms_p99": 75.7,
         "ready_per_chunk_ms_p50": 6.7, "retrieve_ms_p50": 4.5, "bytes_moved": 64 << 20, "model_kv_bytes": 64 << 20,
         "vs_equal": 0.65, "vs_same_prefiller": 1.554, "equal": True, "failed": 0}]})
    assert "| nccl | 1 -> 2 | 53.3 / 75.7 | 6.7 | 4.5 | 64 / 64 MiB | 0.65 | 1.55 | yes | 0 |" in engine
    rtt = report.blocks_for("multihost_cpu", {"rtt_rows": [
        {"added_rtt_ms": 5.0, "ttft_ms_p50_pd": 74.0, "ttft_ms_p99_pd": 133.2, "ttft_ms_p50_single": 53.9,
         "ttft_ms_p99_single": 67.6, "handover_ms_p50": 42.5, "handover_ms_p99": 57.7, "kv_wait_ms_p50": 7.216,
         "ttft_target_ms": 101.2, "meets_target": True, "pd_failed": 0, "single_failed": 0}]})
    assert "| 5 | 74.0 / 133.2 | 53.9 / 67.6 | 42.5 / 57.7 | 7.22 | 101.2 | yes | 0 / 0 |" in rtt["multihost_cpu_rtt"]


def test_report_tables_of_the_one_gpu_files_and_the_gpu_equality(report):
    arena = report.table_for("e2e_gpu_one_gpu", {"rows": [
        {"system": "lmcache_p2p-nixl", "rate": 8.0, "kv_transfer_ms_p50": 2.304, "kv_transfer_ms_p99": 28.869,
         "failed": 0, "kv_hit_ratio": 1.0, "kv_full_hits": 64, "kv_lookups": 64}]})
    assert "| lmcache_p2p-nixl | 8 | 2.30 / 28.87 | 0 | 1.00 | 64/64 |" in arena
    row = {"system": "lmcache-pd", "rate": 16.0, "ttft_ms_p50": 250.61, "ttft_ms_p99": 456.81, "tpot_ms_p50": 7.51,
           "tpot_ms_p99": 7.88, "handover_ms_p50": 45.605, "handover_ms_p99": 61.774, "kv_hit_ratio": 1.0, "failed": 0}
    split = report.handover_split_table({"rows": [row, {**row, "system": "lmcache_p2p-nixl", "rate": 8.0}],
                                         "handover_split": [{"system": "lmcache-pd", "rate": 16.0,
                                                             "decoder_ttft_ms_p50": 25.6,
                                                             "outside_decoder_ms_mean": 17.027}]})
    assert "| lmcache-pd | 16 | 250.6 / 456.8 | 7.51 / 7.88 | 45.6 / 61.8 | 25.6 | 17.0 | 1.00 | 0 |" in split
    assert split.index("| lmcache_p2p-nixl | 8 |") < split.index("| lmcache-pd | 16 |")  # by rate
    nixl = {"cases": 16, "token_ids_compared": 16, "token_ids_equal": 15, "texts_equal": 16, "decoder_lookups": 16,
            "decoder_full_prompt_hits": 16, "failed": 0}
    equality = report.blocks_for("e2e_gpu", {"rows": [], "equality": {"128k": {
        "model": "/m", "tokenizer": False, "cases": [{}] * 16, "systems": {"lmcache_p2p-nixl": nixl}}}})
    assert list(equality) == ["e2e_gpu_equality"]
    assert "| `128k` (/m) | none | 16 | 15/16 (texts 16/16) | 16/16 | 0 | - | - | - |" in equality["e2e_gpu_equality"]
    trips = report.blocks_for("multihost_cpu", {"round_trips": [
        {"step": "prefill request", "between": "proxy -> prefiller", "in_ttft": True},
        {"step": "KvReady", "between": "decoder -> proxy", "in_ttft": False}]})["multihost_cpu_round_trips"]
    assert "| prefill request | proxy -> prefiller | yes |" in trips and "| KvReady | decoder -> proxy | no |" in trips


def test_report_fills_a_block_from_a_study_archive(report, tmp_path):
    import io
    import tarfile

    results = tmp_path / "results"
    results.mkdir()
    rows = [{"concurrency": 1, "requests": 24, "failed": 0, "ttft_ms_p50": 53.88, "ttft_ms_p99": 119.27,
             "handover_ms_p50": 12.612, "handover_ms_p99": 16.447, "output_tokens_per_s": 194.6, "kv_full_hits": 24,
             "kv_lookups": 24}]
    with tarfile.open(results / "tp1_ab.tar.xz", "w:xz") as tar:
        for name, commit, date in (("pre-0", "95f515b5", "07:01"), ("main-0", "8058bf1a", "07:02"),
                                   ("pre-1", "95f515b5", "07:04"), ("main-1", "8058bf1a", "07:06")):
            body = json.dumps({"meta": {"commit": commit, "date": date}, "rows": rows}).encode()
            info = tarfile.TarInfo(f"tp1_ab/{name}.json")
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    md = tmp_path / "B.md"
    md.write_text("<!-- table:tp1_ab -->\nold\n<!-- /table:tp1_ab -->\n")
    assert report.main(["--results", str(results), "--markdown", str(md), "--no-plots"]) == 0
    text = md.read_text()
    assert "| pre (95f515b) | 0 | 1 | 53.9 / 119.3 | 12.6 / 16.4 | 194.6 | 0/24 | 24/24 |" in text
    # by repetition, then in the order the runs went
    order = [text.index(f"| {tree} | {rep} |") for tree, rep in (("pre (95f515b)", 0), ("main (8058bf1)", 0),
                                                                   ("pre (95f515b)", 1))]
    assert order == sorted(order)
