"""bench/anchor_nixl.py, bench/http_tap.py and the client's TPOT/ITL, with no vLLM: the decoder's KV
use from Prometheus text, the handover paired on the wire, the relay's bytes and stamps, and the
peer placed with exactly the cores and settings our launcher gives ours."""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _bench_module(name: str):
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return importlib.import_module(f"bench.{name}")

METRICS_BEFORE = """# HELP vllm:external_prefix_cache_hits_total External prefix cache hits
# TYPE vllm:external_prefix_cache_hits_total counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="tiny"} 100.0
vllm:external_prefix_cache_queries_total{engine="0",model_name="tiny"} 100.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 1.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 0.0
"""
# three more requests of 300, 500 and 200 prompt tokens, each loaded whole
METRICS_AFTER = """vllm:external_prefix_cache_hits_total{engine="0",model_name="tiny"} 1100.0
vllm:external_prefix_cache_queries_total{engine="0",model_name="tiny"} 1100.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 4.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 0.0
"""
# the same three, the last of which loaded nothing (computed its 200 tokens itself)
METRICS_PARTIAL = METRICS_AFTER.replace("hits_total{engine=\"0\",model_name=\"tiny\"} 1100.0",
                                        "hits_total{engine=\"0\",model_name=\"tiny\"} 900.0")


@pytest.fixture(scope="module")
def nixl():
    return _bench_module("anchor_nixl")


def test_kv_use_counts_the_load_only(nixl):
    use = nixl.kv_use(nixl.metric_sums(METRICS_BEFORE), nixl.metric_sums(METRICS_AFTER))
    assert (use.requests, use.loaded_tokens, use.queried_tokens) == (3, 1000, 1000)
    assert (use.hit_ratio, use.full_hits) == (1.0, 3)


def test_kv_use_with_a_partial_load_has_no_full_hit_count(nixl):
    use = nixl.kv_use(nixl.metric_sums(METRICS_BEFORE), nixl.metric_sums(METRICS_PARTIAL))
    assert (use.hit_ratio, use.full_hits) == (0.8, None)


def test_kv_use_of_nothing_has_no_ratio(nixl):
    same = nixl.metric_sums(METRICS_BEFORE)
    assert (nixl.kv_use(same, same).hit_ratio, nixl.kv_use(same, same).full_hits) == (None, None)


def test_metric_sums_adds_label_sets_and_keeps_buckets_apart(nixl):
    text = 'a_total{x="1"} 2\na_total{x="2"} 3\nh_bucket{le="1.0",x="1"} 4\nh_bucket{le="+Inf"} 5\n# c 9\n'
    assert nixl.metric_sums(text) == {"a_total": 5.0, "h_bucket{le=1}": 4.0, "h_bucket{le=inf}": 5.0}


def test_wire_handovers_pair_prompts_seen_once(nixl):
    gen = "/v1/completions"
    prefill = [{"key": "a", "path": "/tokenize", "t_done": 9.990, "status": 200},  # the router's own asks
               {"key": "a", "path": "/v1/completions/render", "t_done": 9.995, "status": 200},
               {"key": "a", "path": gen, "t_done": 10.000, "status": 200},
               {"key": "b", "path": gen, "t_done": 20.0, "status": 200},
               {"key": "c", "path": gen, "t_done": 30.0, "status": 200},
               {"key": "c", "path": gen, "t_done": 31.0, "status": 200},
               {"key": "d", "path": gen, "t_done": 40.0, "status": 500}]
    decode = [{"key": "a", "path": "/tokenize", "t_first_data": None, "status": 200},
              {"key": "a", "path": gen, "t_first_data": 10.025, "status": 200},
              {"key": "b", "path": gen, "t_first_data": None, "status": 200},
              {"key": "c", "path": gen, "t_first_data": 32.0, "status": 200},
              {"key": "d", "path": gen, "t_first_data": 41.0, "status": 200}]
    assert nixl.wire_handovers_ms(prefill, decode) == [pytest.approx(25.0)]


def test_tpot_and_itl_from_token_chunks(anchor):
    r = {"ok": True, "token_ids": [1, 2, 3, 4], "t_chunks": [1.000, 1.010, 1.030, 1.060]}
    failed = {"ok": False, "token_ids": [1, 2], "t_chunks": [1.0, 9.0]}
    assert anchor.tpots_ms([r, failed]) == [pytest.approx(20.0)]
    assert anchor.itls_ms([r, failed]) == pytest.approx([10.0, 20.0, 30.0])


def test_client_records_token_chunks_and_text_only_first_token(tmp_path):
    client = _bench_module("anchor_client")
    rec = {"token_ids": [], "text": "", "t_chunks": [], "chunk_tokens": []}
    client.feed_line(rec, 'data: {"choices": [{"text": "a"}]}', 1.0)  # LMCache PD's proxy: text, no ids
    client.feed_line(rec, 'data: {"choices": [{"text": "b", "token_ids": [7], "prompt_token_ids": [1, 2]}]}', 2.0)
    client.feed_line(rec, 'data: {"choices": [{"text": "", "finish_reason": "length"}]}', 3.0)
    client.feed_line(rec, "data: [DONE]", 4.0)
    assert rec == {"token_ids": [7], "text": "ab", "t_chunks": [1.0, 2.0], "chunk_tokens": [0, 1],
                   "prompt_tokens": 2, "t_first": 1.0}


def test_user_variant_sets_only_the_core_and_the_recipe(nixl, tmp_path):
    launch = nixl.instance_launch(nixl.Variant.USER, "decoder", tmp_path, ["--dtype", "bfloat16"], 2048, tmp_path,
                                  base={"PATH": "/bin"})
    assert launch.cpus is None
    assert launch.env == {"PATH": "/bin", "VLLM_CPU_OMP_THREADS_BIND": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                          "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "UCX_TLS": "tcp,self",
                          "VLLM_NIXL_SIDE_CHANNEL_PORT": "5601", "VLLM_PLUGINS": ""}
    kv = json.loads(launch.argv[launch.argv.index("--kv-transfer-config") + 1])
    assert kv == {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}


@pytest.mark.parametrize("role", ["prefiller", "decoder"])
def test_placed_variant_gets_our_launchers_cores_and_environment(nixl, tmp_path, role):
    """The peer placed like ours: the CPUs and every environment setting ``lmcache-p2p launch`` gives our
    instance of that role, but the LMCache ones and the spin cap (our plugin, not loaded by the peer)."""
    from lmcache_p2p.cli import launch
    from lmcache_p2p.cli.main import build_parser

    model = tmp_path / "m"
    args = build_parser().parse_args(["launch", "--prefill", "1", "--decode", "1", "--model", str(model),
                                      "--log-dir", str(tmp_path)])
    inst = next(i for i in launch.plan(args) if i.role == role)
    ours = launch.vllm_child(inst, model, args, tmp_path)
    peer = nixl.instance_launch(nixl.Variant.PLACED, role, model, [], 2048, tmp_path)
    assert peer.cpus == ours.cpus
    ours_env = {k: v for k, v in ours.env.items() if not k.startswith(("LMCACHE_", "VLLM_LOGGING"))}
    assert {k: peer.env.get(k) for k in ours_env} == {**ours_env, "UCX_TLS": "tcp,self"}
    assert "LMCACHE_P2P_VLLM_SPIN_S" in ours.env and "LMCACHE_P2P_VLLM_SPIN_S" not in peer.env
    spin = nixl.instance_launch(nixl.Variant.SPIN, role, model, [], 2048, tmp_path)
    assert (spin.env["VLLM_PLUGINS"], spin.env["LMCACHE_P2P_VLLM_SPIN_S"]) == ("lmcache_p2p",
                                                                              ours.env["LMCACHE_P2P_VLLM_SPIN_S"])
    push = nixl.instance_launch(nixl.Variant.PUSH, role, model, [], 2048, tmp_path)
    at = push.argv.index("--kv-transfer-config") + 1
    assert json.loads(push.argv[at]) == {"kv_connector": "NixlPushConnector", "kv_role": "kv_both",
                                         "kv_buffer_device": "cpu"}
    assert (push.env, push.cpus, push.argv[:at]) == (spin.env, spin.cpus, spin.argv[:at])


def test_tap_relays_bytes_and_stamps_prompts(tmp_path):
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    tap = _bench_module("http_tap")

    async def upstream(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"id": "x", "echo": body["prompt"]})
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b": keep-alive\n\n")
        await asyncio.sleep(0.05)
        await resp.write(b'data: {"n": 1}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def main() -> tuple[list, str, dict]:
        up_app = web.Application()
        up_app.router.add_post("/v1/completions", upstream)
        async with TestServer(up_app) as up:
            async with TestClient(TestServer(tap.make_app(str(up.make_url("")).rstrip("/")))) as c:
                streamed = await (await c.post("/v1/completions", json={"prompt": "p1", "stream": True})).text()
                plain = await (await c.post("/v1/completions", json={"prompt": [1, 2]})).json()
                records = await (await c.get("/_tap/records")).json()
                await c.post("/_tap/reset")
                assert await (await c.get("/_tap/records")).json() == []
                return records, streamed, plain

    records, streamed, plain = asyncio.run(main())
    assert streamed == ': keep-alive\n\ndata: {"n": 1}\n\ndata: [DONE]\n\n'
    assert plain == {"id": "x", "echo": [1, 2]}
    first, second = records
    assert first["key"] == tap.prompt_key(b'{"prompt": "p1"}') and second["key"] == tap.prompt_key(b'{"prompt": [1, 2]}')
    assert first["t_first_data"] - first["t_request"] >= 0.05  # the keep-alive comment is not a token
    assert second["t_first_data"] is None and second["t_done"] >= second["t_request"]


def test_tap_key_ignores_bodies_without_prompt():
    tap = _bench_module("http_tap")
    assert tap.prompt_key(b"not json") is None and tap.prompt_key(b'{"messages": []}') is None
    assert tap.prompt_key(b'{"prompt": "a", "max_tokens": 1}') == tap.prompt_key(b'{"max_tokens": 9, "prompt": "a"}')


def test_anchor_knows_every_variant(anchor):
    assert {"vllm-nixl", "vllm-nixl-placed", "vllm-nixl-spin", "vllm-nixl-push"} <= set(anchor.SYSTEMS)
    cfg = anchor.parse_args(["--quick", "--systems", "vllm-nixl,single", "--work", str(Path("/tmp/x"))])
    assert cfg.systems == ("single", "vllm-nixl")


def test_fault_rows_split_served_from_wrong_and_cite_ours(tmp_path):
    peers = _bench_module("faults_peers")
    from fault_scenarios import Row

    row = Row("decoder_killed_mid_stream", requests=8, succeeded=5, clean_errors=1, unclean_errors=1, hung=1,
              wrong_outputs=2, recovered=True)
    got = peers.peer_row(row)
    assert (got["requests"], got["served"], got["wrong"], got["clean_errors"], got["hung"], got["unclean_errors"]) == \
        (8, 3, 2, 1, 1, 1)
    ours = tmp_path / "faults.json"
    ours.write_text(json.dumps({"date": "2026-12-02 00:15 UTC", "rows": [
        {"scenario": "one_request_buffer_20_concurrent_long_chunked", "status": "run", "requests": 40, "succeeded": 40,
         "clean_errors": 0, "unclean_errors": 0, "hung": 0, "wrong_outputs": 0, "recovered": True, "seconds": 5.7,
         "notes": ""},
        {"scenario": "different_models", "status": "run"}, {"scenario": "decoder_killed_mid_stream",
                                                            "status": "not yet run"}]}))
    (cited,) = peers.our_rows(ours)
    assert (cited["scenario"], cited["system"], cited["served"], cited["wrong"]) == \
        ("decoder_over_capacity", "lmcache_p2p", 40, 0)
    assert "one_request_buffer_20_concurrent_long_chunked" in cited["source"]


def test_faults_peers_table_puts_ours_first_per_scenario():
    report = _bench_module("report")
    rows = [{"scenario": "b", "system": "vllm-nixl", "requests": 4, "served": 0, "clean_errors": 0, "hung": 4,
             "wrong": 0, "unclean_errors": 0},
            {"scenario": "a", "system": "vllm-nixl", "requests": 8, "served": 2, "clean_errors": 1, "hung": 0,
             "wrong": 0, "unclean_errors": 5},
            {"scenario": "a", "system": "lmcache_p2p", "requests": 8, "served": 8, "clean_errors": 0, "hung": 0,
             "wrong": 0, "unclean_errors": 0}]
    lines = report.TABLES["faults_peers"](rows).splitlines()
    assert lines[2:] == ["| a | lmcache_p2p | 8 | 8 | 0 | 0 | 0 | 0 |", "| a | vllm-nixl | 8 | 2 | 1 | 0 | 0 | 5 |",
                         "| b | vllm-nixl | 4 | 0 | 0 | 4 | 0 | 0 |"]


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_gpu_nixl_instances_are_the_recipe_on_their_device(tmp_path, device):
    gpu_nixl = _bench_module("e2e_gpu_nixl")
    from types import SimpleNamespace

    cfg = SimpleNamespace(model=tmp_path, max_model_len=4096, device=device, vllm_args=("--load-format", "dummy"))
    child = gpu_nixl.instance_child(cfg, "decoder", 1, 0.4, tmp_path, tmp_path / "logging.json")
    kv = json.loads(child.argv[child.argv.index("--kv-transfer-config") + 1])
    assert kv == ({"kv_connector": "NixlConnector", "kv_role": "kv_both"} if device == "cuda"
                  else {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"})
    assert child.argv[-2:] == ["--load-format", "dummy"] and "--no-enable-prefix-caching" in child.argv
    assert (child.env["VLLM_NIXL_SIDE_CHANNEL_PORT"], child.env["VLLM_PLUGINS"]) == ("5601", "")
    assert "LMCACHE_P2P_VLLM_SPIN_S" not in child.env
    if device == "cuda":
        assert child.env["CUDA_VISIBLE_DEVICES"] == "1" and "cuda_ipc" in child.env["UCX_TLS"] and child.gpus == (1,)
    else:
        assert child.env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and child.env["UCX_TLS"] == "tcp,self"


def test_gpu_nixl_push_system_differs_only_in_its_connector(tmp_path):
    gpu_nixl = _bench_module("e2e_gpu_nixl")
    from types import SimpleNamespace

    cfg = SimpleNamespace(model=tmp_path, max_model_len=4096, device="cuda", vllm_args=())
    pull, push = (gpu_nixl.instance_child(cfg, "prefiller", 0, 0.4, tmp_path, tmp_path / "logging.json", system)
                  for system in ("vllm-nixl", "vllm-nixl-push"))
    at = pull.argv.index("--kv-transfer-config") + 1
    assert json.loads(push.argv[at]) == {"kv_connector": "NixlPushConnector", "kv_role": "kv_both"}
    assert push.argv[:at] + push.argv[at + 1:] == pull.argv[:at] + pull.argv[at + 1:] and push.env == pull.env


def test_gpu_nixl_refuses_to_start_without_the_router(tmp_path, monkeypatch):
    gpu_nixl = _bench_module("e2e_gpu_nixl")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "orjson" else real(name, *a))
    from lmcache_p2p.cli.processes import StartupError

    with pytest.raises(StartupError, match="orjson.*build/gpu-kit/wheels"):
        gpu_nixl.start(object(), 1.0, 1.0, lambda *a, **k: None)
