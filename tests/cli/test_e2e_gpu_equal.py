"""bench/e2e_gpu_equal.py's bookkeeping (comparison, decoder hits, the kill trigger), on CPU with no server."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def equal():
    sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location("e2e_gpu_equal", REPO / "bench" / "e2e_gpu_equal.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["e2e_gpu_equal"] = module
    spec.loader.exec_module(module)
    return module


def _cases(equal, n):
    return [equal.Case(f"c{i}", "completions", bool(i % 2), i + 1, [1, 2, 3]) for i in range(n)]


def test_outputs_equal_only_when_every_case_has_the_single_instance_s_token_ids(equal) -> None:
    cases = _cases(equal, 3)
    ref = [equal.Output([5, 6], "ab"), equal.Output([7], "c"), equal.Output([8, 9], "de")]
    same = equal.compare(cases, ref, [equal.Output([5, 6], "ab"), equal.Output([7], "c"), equal.Output([8, 9], "de")])
    assert same["outputs_equal"] and same["token_ids_equal"] == 3 and same["mismatches"] == []
    got = [equal.Output([5, 6], "ab"), equal.Output([7, 1], "c"), equal.Output(None, "", "HTTP 500: boom")]
    diff = equal.compare(cases, ref, got)
    assert not diff["outputs_equal"]
    assert (diff["token_ids_equal"], diff["texts_equal"]) == (1, 2)  # the failed case counts as neither
    assert [m["case"] for m in diff["mismatches"]] == ["c1", "c2"]
    assert diff["mismatches"][1]["error"] == "HTTP 500: boom"
    no_ids = equal.compare(cases[:1], [equal.Output(None, "ab")], [equal.Output(None, "ab")])
    assert not no_ids["outputs_equal"]  # equal texts alone do not make token ids equal


def test_decoder_hits_count_whole_prompt_loads_from_the_decoder_log(equal, tmp_path) -> None:
    log = tmp_path / "decoder-0.log"
    line = ("LMCache INFO: Reqid: r{i}, Total tokens {t}, Inference Engine computed tokens: 0, "
            "LMCache hit tokens: {h}, need to load: {h}\n")
    log.write_text(line.format(i=0, t=100, h=99) + line.format(i=1, t=300, h=99) + line.format(i=2, t=61, h=60))

    class Dep:
        decoder_log = log

    hits = equal.decoder_hits(Dep(), seen=1)  # the first lookup belongs to an earlier system
    assert (hits["decoder_lookups"], hits["decoder_full_prompt_hits"]) == (2, 1)
    assert hits["decoder_lookups_detail"] == [[300, 99], [61, 60]]


def test_the_kill_waits_for_a_store_logged_after_it_started_watching(equal, tmp_path) -> None:
    log = tmp_path / "prefiller-0.log"
    log.write_text("[req_id=old] Stored 1024 out of total 1024 tokens\n")  # before: must not trigger
    assert not equal.wait_for_new_line(log, equal.STORE_MARKER, 0.2)

    def append_later() -> None:
        time.sleep(0.2)
        with log.open("a") as f:
            f.write("[req_id=new] Stored 2013 out of total 2013 tokens\n")

    writer = threading.Thread(target=append_later)
    writer.start()
    start = time.monotonic()
    assert equal.wait_for_new_line(log, equal.STORE_MARKER, 5.0)
    assert time.monotonic() - start < 4.0
    writer.join()


def test_prompts_span_one_to_eight_chunks_and_never_end_on_a_boundary(equal) -> None:
    lengths = [equal.target_tokens(c) for c in equal.CHUNK_COUNTS]
    assert [(n - 1) // equal.CHUNK_TOKENS + 1 for n in lengths] == list(equal.CHUNK_COUNTS)
    assert all(n % equal.CHUNK_TOKENS for n in lengths)
    cases = equal.make_cases(equal.Model("ids", Path("."), tokenizer=False), vocab_size=128256)
    assert [len(c.prompt) for c in cases if not c.stream] == lengths
    assert {c.endpoint for c in cases} == {"completions"}  # no chat without a tokenizer


def test_rank_retrieves_count_requests_every_decoder_rank_loaded_whole(equal, tmp_path) -> None:
    log = tmp_path / "decoder-0.log"
    lookup = ("(EngineCore pid=10) INFO [vllm_v1_adapter.py:1476] Reqid: {r}, Total tokens {t}, Inference Engine "
              "computed tokens: 0, LMCache hit tokens: {h}, need to load: {h}\n")
    retrieved = ("[2026-12-02 07:49:33,750] LMCache INFO: [req_id={r}] Retrieved {n} out of {n} required tokens (from {t} "
                 "total tokens). size: 0.0001 gb, cost 1.0 ms, throughput: 0.1 GB/s; (cache_engine.py:985)\n")
    log.write_text(lookup.format(r="a", t=301, h=300) + retrieved.format(rank=0, pid=21, r="a", n=300, t=301)
                   + retrieved.format(rank=1, pid=22, r="a", n=300, t=301)
                   + lookup.format(r="b", t=101, h=100) + retrieved.format(rank=0, pid=21, r="b", n=100, t=101))

    class Dep:
        decoder_log = log

    got = equal.rank_retrieves(Dep(), decode_tp=2)
    # request b was retrieved by one rank only: not loaded on every rank
    assert got == {"decoder_tp": 2, "decoder_requests_loaded_on_every_rank": 1, "decoder_requests_retrieved": 2}
