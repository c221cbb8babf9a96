"""The per-request timeline: phase arithmetic, matching prefiller reports, /stats and Prometheus."""

from __future__ import annotations

import pytest

from lmcache_p2p.protocol import KvSent
from lmcache_p2p.proxy.observe.metrics import RECENT_TIMELINES, ProxyMetrics
from lmcache_p2p.proxy.observe.timeline import Phase, Timeline, prefiller_phases

from ..conftest import eventually, make_cluster
from ..fakes import MODEL, PROMPT

PHASES = {p.value for p in Phase}
EARLY_ONLY = {Phase.KV_AFTER_DECODE.value}  # a decode sent before its KV was ready (--early-decode)


def full_timeline(**changes: float) -> Timeline:
    stamps = dict(received_s=10.0, prefill_sent_s=10.004, prefill_answered_s=10.054, first_byte_s=10.055,
                  kv_ready_s=10.060, decode_sent_s=10.061, decode_accepted_s=10.065, first_decoded_s=10.081)
    return Timeline(req_id="r1", backend="lmcache_p2p", **{**stamps, **changes})


def test_phases_are_the_differences_of_the_stamps():
    phases = full_timeline().phases()
    expected = {Phase.QUEUE: 4, Phase.PREFILL: 50, Phase.FIRST_BYTE: 1, Phase.KV_WAIT: 6, Phase.DECODE_START: 1,
                Phase.DECODE_FIRST: 20, Phase.DECODE_ACCEPT: 4}
    assert set(phases) == set(expected)
    for phase, ms in expected.items():
        assert phases[phase] == pytest.approx(ms / 1e3), phase


def test_kv_ready_before_the_prefill_answer_waits_zero_and_decode_starts_from_the_answer():
    phases = full_timeline(kv_ready_s=10.030).phases()
    assert phases[Phase.KV_WAIT] == 0.0
    assert phases[Phase.DECODE_START] == pytest.approx(0.007)  # 10.054 -> 10.061


def test_an_early_decode_starts_from_the_answer_and_shows_how_long_its_kv_came_after_it():
    """--early-decode: the decode went at 10.055, a millisecond after the prefill answered; the KV was ready at
    10.060. kv_wait stays answer -> KV ready; decode_start is answer -> decode sent; kv_after_decode the rest."""
    phases = full_timeline(early_decode=True, decode_sent_s=10.055).phases()
    assert phases[Phase.KV_WAIT] == pytest.approx(0.006)
    assert phases[Phase.DECODE_START] == pytest.approx(0.001)
    assert phases[Phase.KV_AFTER_DECODE] == pytest.approx(0.005)
    assert phases[Phase.DECODE_FIRST] == pytest.approx(0.026)
    assert Phase.KV_AFTER_DECODE not in full_timeline().phases()  # a decode sent after its KV has none
    no_kv = full_timeline(early_decode=True, kv_ready_s=None).phases()  # its output came first, the KV never
    assert Phase.DECODE_START in no_kv and Phase.KV_WAIT not in no_kv and Phase.KV_AFTER_DECODE not in no_kv


def test_moments_that_did_not_happen_leave_their_phases_out():
    no_decode = Timeline(received_s=1.0, prefill_sent_s=1.5, prefill_answered_s=2.0).phases()
    assert set(no_decode) == {Phase.QUEUE, Phase.PREFILL}
    no_kv = full_timeline(kv_ready_s=None).phases()
    assert Phase.KV_WAIT not in no_kv and Phase.DECODE_START not in no_kv and Phase.DECODE_FIRST in no_kv
    no_output = full_timeline(first_decoded_s=None).phases()  # headers but no first output: not a handover
    assert Phase.DECODE_FIRST not in no_output and Phase.DECODE_ACCEPT not in no_output


def test_prefiller_phases_are_the_slowest_ranks():
    reports = [KvSent("r", "p", 0, store_s=0.003, submit_s=0.001, transfer_s=0.010, pickup_s=0.001, grant_s=0.002,
                      write_s=0.005),
               KvSent("r", "p", 1, store_s=0.002, submit_s=0.004, transfer_s=0.008, grant_s=0.003, write_s=0.004)]
    assert prefiller_phases(reports) == {Phase.STORE: 0.003, Phase.SUBMIT: 0.004, Phase.TRANSFER: 0.010,
                                         Phase.PICKUP: 0.001, Phase.GRANT: 0.003, Phase.WRITE: 0.005}


def test_stats_has_every_phase_in_the_stats_schema_even_before_any_request():
    stats = ProxyMetrics(list).stats()
    assert set(stats["timeline_ms"]) == PHASES
    for summary in stats["timeline_ms"].values():
        assert summary == {"count": 0, "mean": None, "p50": None, "p99": None}
    assert stats["recent"] == []


@pytest.mark.parametrize("report_first", [False, True])
def test_a_prefiller_report_joins_its_timeline_whichever_comes_first(report_first):
    m = ProxyMetrics(list)
    report = KvSent("r1", "p", 0, store_s=0.002, submit_s=0.001, transfer_s=0.005)
    if report_first:
        m.report_prefiller(report)
    m.record_timeline(full_timeline())
    if not report_first:
        m.report_prefiller(report)
    m.report_prefiller(report)  # a duplicate is counted once
    stats = m.stats()
    counts = {phase: s["count"] for phase, s in stats["timeline_ms"].items()}
    assert counts == {**dict.fromkeys(PHASES - EARLY_ONLY, 1), **dict.fromkeys(EARLY_ONLY, 0)}
    assert stats["timeline_ms"]["transfer"]["p50"] == 5.0
    assert stats["timeline_ms"]["prefill"]["mean"] == pytest.approx(50.0)
    recent, = stats["recent"]
    assert set(recent) == PHASES | {"req_id", "backend"} and recent["req_id"] == "r1"
    assert recent["backend"] == "lmcache_p2p"
    assert recent["submit"] == 1.0 and recent["queue"] == pytest.approx(4.0)
    for phase in PHASES - EARLY_ONLY:
        assert m.registry.get_sample_value("lmcache_p2p_proxy_phase_seconds_count",
                                           {"phase": phase, "backend": "lmcache_p2p"}) == 1, phase


def test_prefiller_phases_wait_for_every_tp_rank():
    m = ProxyMetrics(list)
    m.record_timeline(Timeline(received_s=0.0, req_id="r1", tp_size=2, prefill_sent_s=0.1, prefill_answered_s=0.2))
    m.report_prefiller(KvSent("r1", "p", 0, store_s=0.001, submit_s=0.001, transfer_s=0.001))
    assert m.stats()["timeline_ms"]["transfer"]["count"] == 0
    m.report_prefiller(KvSent("r1", "p", 1, store_s=0.001, submit_s=0.001, transfer_s=0.003))
    assert m.stats()["timeline_ms"]["transfer"] == {"count": 1, "mean": 3.0, "p50": 3.0, "p99": 3.0}


def test_recent_keeps_the_last_timelines_and_reset_empties_it():
    m = ProxyMetrics(list)
    for i in range(RECENT_TIMELINES + 3):
        m.record_timeline(full_timeline(received_s=10.0 - i / 1e3))
    stats = m.stats()
    assert len(stats["recent"]) == RECENT_TIMELINES and stats["timeline_ms"]["queue"]["count"] == RECENT_TIMELINES + 3
    assert stats["recent"][-1]["queue"] == pytest.approx(4.0 + (RECENT_TIMELINES + 2))
    ended = m.reset_stats()
    assert ended["timeline_ms"]["queue"]["count"] == RECENT_TIMELINES + 3
    after = m.stats()
    assert after["recent"] == [] and after["timeline_ms"]["queue"]["count"] == 0
    # Prometheus counts since start, like every other histogram
    assert m.registry.get_sample_value("lmcache_p2p_proxy_phase_seconds_count",
                                       {"phase": "queue", "backend": "lmcache_p2p"}) == \
        RECENT_TIMELINES + 3


@pytest.mark.anyio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("early_decode", [False, True])
async def test_a_streamed_disaggregated_request_fills_every_phase(early_decode):
    async with make_cluster(early_decode=early_decode) as c:
        await c.stream("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True})
        req_id = c.network.specs[-1]["req_id"]
        await c.prefillers[0].agent.send(KvSent(req_id, c.prefillers[0].agent.instance_id, 0, store_s=0.002,
                                                submit_s=0.001, transfer_s=0.004, chunks=3, nbytes=3 << 20))
        await eventually(lambda: c.proxy.metrics.stats()["timeline_ms"]["transfer"]["count"] == 1)
        stats = (await c.client.get("/stats")).json()
        recent, = stats["recent"]
        assert recent["req_id"] == req_id and recent["backend"] == "lmcache_p2p"
        for phase in PHASES - (set() if early_decode else EARLY_ONLY):
            assert stats["timeline_ms"][phase]["count"] == 1, phase
            assert recent[phase] is not None and recent[phase] >= 0, phase
        ttft = stats["ttft_ms"]["p50"]
        assert recent["queue"] + recent["prefill"] <= ttft + 1e-3  # the TTFT ends at the prefill answer
        assert recent["decode_accept"] <= recent["decode_first"]  # the headers come before the first output
        assert c.metric("lmcache_p2p_proxy_phase_seconds_count", phase="decode_first", backend="lmcache_p2p") == 1
        assert c.metric("lmcache_p2p_proxy_backend_requests_total", backend="lmcache_p2p") == 1
        assert c.metric("lmcache_p2p_proxy_control_messages_total", type="KvSent") == 1


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_colocated_request_records_no_timeline():
    async with make_cluster(n_decode=0) as c:
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        assert resp.status_code == 200
        assert (await c.client.get("/stats")).json()["recent"] == []
