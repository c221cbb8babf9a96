"""bench/routers.py's pure parts, with no vLLM: the decoder's KV figures per backend (LMCache's lookup lines,
NixlConnector's counters), a row from a run's results, the rows' order, the NixlConnector pair started in our
instances' places with our flags, our proxy's NixlConnector flags, the report's table of such rows, and the
client's bound on a request that stalls."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from lmcache_p2p.cli import launch
from lmcache_p2p.cli.main import build_parser


def _lookup(req: str, total: int, hit: int) -> str:
    return (f"INFO lmcache: Reqid: {req}, Total tokens {total}, Inference Engine computed tokens: 0, "
            f"LMCache hit tokens: {hit}\n")


def test_lookup_figures_count_each_requests_last_lookup(routers):
    text = (_lookup("a1", 301, 300)  # behind our proxy: prompt + first token, the last never looked up
            + _lookup("cmpl-___prefill_addr_127.0.0.1:1___decode_addr_127.0.0.1:2_u1-0-x", 400, 256)  # waited ...
            + "unrelated line\n"
            + _lookup("cmpl-___prefill_addr_127.0.0.1:1___decode_addr_127.0.0.1:2_u1-0-x", 400, 400)  # ... then whole
            + _lookup("b2", 201, 100))  # half of its 200
    kv = routers.lookup_figures(text)
    assert (kv.full_hits, kv.lookups, kv.decoder_waits, kv.failed_transfers) == (2, 3, 1, None)
    assert kv.hit_ratio == round((300 + 400 + 100) / (300 + 400 + 200), 4)


def test_lookup_figures_of_no_lookup(routers):
    kv = routers.lookup_figures("nothing\n")
    assert (kv.hit_ratio, kv.full_hits, kv.lookups, kv.decoder_waits) == (None, 0, 0, 0)


BEFORE = """vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 50.0
vllm:external_prefix_cache_queries_total{engine="0",model_name="m"} 50.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 1.0
vllm:nixl_num_failed_transfers_total{engine="0",model_name="m"} 0.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 0.0
"""
# two requests of 300 and 200 prompt tokens; the second found 96 in the decoder's prefix cache, was asked to
# pull the other 104 and its pull failed
AFTER = """vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 454.0
vllm:external_prefix_cache_queries_total{engine="0",model_name="m"} 454.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 2.0
vllm:nixl_num_failed_transfers_total{engine="0",model_name="m"} 1.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 600.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 96.0
"""


def _sums(routers, text: str) -> dict[str, float]:
    return routers.nixl.metric_sums(text)


def test_nixl_figures_from_the_decoders_counters(routers):
    before, after = _sums(routers, BEFORE), _sums(routers, AFTER)
    kv = routers.nixl_figures(before, after)
    # a planned pull counts as a hit even when it fails: the failed count says so
    assert (kv.hit_ratio, kv.full_hits, kv.lookups, kv.decoder_waits, kv.failed_transfers) == (1.0, 1, 1, None, 1)
    assert routers.delta_ratio(before, after, routers.PREFIX_HITS, routers.PREFIX_QUERIES) == round(96 / 500, 4)


def test_nixl_figures_without_a_failure_counter_say_none(routers):
    strip = lambda t: "".join(x + "\n" for x in t.splitlines() if "failed" not in x)  # noqa: E731
    hits = 'hits_total{engine="0",model_name="m"}'
    partial = AFTER.replace(f"{hits} 454.0", f"{hits} 252.0")
    kv = routers.nixl_figures(_sums(routers, strip(BEFORE)), _sums(routers, strip(partial)))
    assert (kv.hit_ratio, kv.full_hits, kv.failed_transfers) == (0.5, None, None)


def test_delta_ratio_of_a_counter_that_did_not_grow(routers):
    same = {"a": 1.0, "b": 2.0}
    assert routers.delta_ratio(same, same, "a", "b") is None


def _result(routers, index, ttft_s, ids, error=None):
    return routers.RequestResult(index, error, ttft_s, 1.0, tuple(ids), ())


def test_build_row_from_results_reference_and_figures(routers):
    results = [_result(routers, 0, 0.020, [1, 2]), _result(routers, 1, 0.040, [3, 9]),
               _result(routers, 2, None, [], error="no complete answer within 60 s (the client's request timeout)")]
    kv = routers.KvFigures(hit_ratio=1.0, full_hits=None, lookups=2, failed_transfers=0)
    row = routers.build_row("vllm-router", "vllm-nixl", 4, results, [(1, 2), (3, 4), (5, 6)], 0.010, None, kv, 0.25)
    assert (row.requests, row.failed, row.outputs_mismatched, row.outputs_equal) == (3, 1, 1, False)
    assert (row.ttft_ms_p50, row.ttft_ms_p99, row.ttft_ms_mean) == (20.0, 40.0, 30.0)
    assert (row.prefill_ms_mean, row.handover_ms_mean, row.handover_ms_p50, row.handover_ms_p99) == (10.0, 20.0, None,
                                                                                                     None)
    assert (row.kv_full_hits, row.kv_lookups, row.decoder_waits, row.kv_failed_transfers) == (None, 2, None, 0)
    assert row.decoder_prefix_cache_hit_ratio == 0.25 and row.first_error.startswith("no complete answer")
    ours = routers.build_row("lmcache_p2p", "vllm-nixl", 1, results[:1], [(1, 2)], None,
                             {"handover_ms": {"p50": 5.0, "p99": 7.5}}, kv, None)
    assert (ours.outputs_equal, ours.handover_ms_mean, ours.handover_ms_p50, ours.handover_ms_p99) == (True, None, 5.0,
                                                                                                       7.5)


def test_rows_ordered_as_a_two_by_two_per_concurrency(routers):
    kv = routers.KvFigures(None, None, None)
    rows = [routers.build_row(r, b, c, [], [], None, None, kv, None)
            for c in (4, 1) for b in ("vllm-nixl", "lmcache_p2p") for r in ("vllm-router", "lmcache_p2p")]
    assert [(r.concurrency, r.backend, r.router) for r in sorted(rows, key=routers.row_order)][:4] == [
        (1, "lmcache_p2p", "lmcache_p2p"), (1, "lmcache_p2p", "vllm-router"), (1, "vllm-nixl", "lmcache_p2p"),
        (1, "vllm-nixl", "vllm-router")]


def _plan(tmp_path, *extra):
    model = tmp_path / "m"
    args = build_parser().parse_args(["launch", "--prefill", "1", "--decode", "1", "--model", str(model),
                                      "--log-dir", str(tmp_path), *extra])
    return model, args, launch.plan(args)


def _flag(argv, name):
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("caching", [(), ("--no-prefix-caching",)])
@pytest.mark.parametrize("role", ["prefiller", "decoder"])
def test_nixl_instance_takes_our_instances_place_flags_and_cores(routers, tmp_path, role, caching):
    model, args, instances = _plan(tmp_path, *caching)
    inst = next(i for i in instances if i.role == role)
    ours = launch.vllm_child(inst, model, args, tmp_path)
    peer = routers.nixl_instance(inst, model, args, tmp_path / "nixl")
    assert (peer.name, peer.health_url, peer.cpus) == (ours.name, ours.health_url, ours.cpus)
    assert _flag(peer.argv, "--served-model-name") == str(model)  # the name the bench's requests carry
    assert json.loads(_flag(peer.argv, "--kv-transfer-config"))["kv_connector"] == "NixlConnector"

    def flags(argv):  # every vLLM flag but the model's name and the connector's config
        rest = argv[argv.index("--model"):]
        drop = {"--kv-transfer-config", "--served-model-name"}
        return sorted(a for i, a in enumerate(rest) if a not in drop and rest[i - 1] not in drop)

    assert flags(peer.argv) == flags(ours.argv)
    assert ("--no-enable-prefix-caching" in peer.argv) == bool(caching)  # prefix caching as on ours
    assert peer.env["VLLM_CPU_OMP_THREADS_BIND"] == ours.env["VLLM_CPU_OMP_THREADS_BIND"]
    assert int(peer.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) not in (inst.http_port, 5600, 5601)


def test_nixl_proxy_is_the_launchers_with_the_pair_registered_by_url(routers, tmp_path):
    _, args, instances = _plan(tmp_path)
    ours = launch.proxy_child(args, tmp_path)
    proxy = routers.nixl_proxy_child(args, instances, tmp_path / "nixl")
    urls = {i.role: f"http://127.0.0.1:{i.http_port}" for i in instances}
    assert proxy.argv[-2:] == [f"--nixl-prefill={urls['prefiller']}", f"--nixl-decode={urls['decoder']}"]
    assert _flag(proxy.argv, "--policy") == _flag(ours.argv, "--policy")
    assert int(_flag(proxy.argv, "--port")) != args.proxy_port and proxy.port == int(_flag(proxy.argv, "--port"))
    router = routers.router_child(args, instances, tmp_path / "nixl")
    assert [router.argv[i + 1] for i, a in enumerate(router.argv) if a in ("--prefill", "--decode")] == [
        urls["prefiller"], urls["decoder"]]


def test_report_renders_a_backend_without_per_request_figures(report):
    row = {"router": "vllm-router", "backend": "vllm-nixl", "concurrency": 1, "requests": 8, "ttft_ms_p50": 30.0,
           "ttft_ms_p99": 50.0, "handover_ms_mean": 12.0, "handover_ms_p50": None, "handover_ms_p99": None,
           "failed": 1, "outputs_equal": False, "kv_hit_ratio": 1.0, "kv_full_hits": None, "kv_lookups": 7,
           "decoder_waits": None}
    ours = {**row, "router": "lmcache_p2p", "backend": "lmcache_p2p", "failed": 0, "outputs_equal": True,
            "kv_full_hits": 8, "kv_lookups": 8, "decoder_waits": 0, "handover_ms_p50": 5.0, "handover_ms_p99": 9.0}
    table = report.table_for("routers_cpu", {"meta": {}, "rows": [ours, row]})
    assert "| lmcache_p2p | lmcache_p2p | 1 | 8 | 30.0 / 50.0 | 12.0 | 5.0 / 9.0 | 0 | yes | 1.00 | 8/8 | 0 |" in table
    assert "| vllm-router | vllm-nixl | 1 | 8 | 30.0 / 50.0 | 12.0 | - | 1 | NO | 1.00 | -/7 | - |" in table


def test_a_stalled_stream_fails_at_the_clients_request_timeout(e2e):
    class Stall(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'data: {"choices": [{"token_ids": [1]}]}\n\n'
            await asyncio.sleep(30)  # a pull that never completes

    async def go():
        transport = httpx.MockTransport(lambda request: httpx.Response(200, stream=Stall()))
        async with httpx.AsyncClient(transport=transport, timeout=300) as client:
            return await e2e.bounded_request(client, "http://x", 3, {"max_tokens": 4}, 0.2)

    result = asyncio.run(asyncio.wait_for(go(), 10))
    assert (result.index, result.ok, result.output_ids) == (3, False, ())
    assert result.error == "no complete answer within 0.2 s (the client's request timeout)"
