"""bench/e2e_gpu.py's ``vllm-nixl-lmcache-mp`` system (bench/e2e_gpu_lmcache_mp.py), with no vLLM: the launcher
command it runs is one the launcher accepts and plans as LMCache's MP recipe on the pass's GPUs, and the pass
selects, starts and keys its rows."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from lmcache_p2p.cli import connectors, launch
from lmcache_p2p.cli.main import build_parser, split_passthrough

SYSTEM = "vllm-nixl-lmcache-mp"


def cfg_of(tmp_path: Path, **over):
    base = dict(model=tmp_path, device="cuda", max_model_len=4096, gpu_memory_utilization=0.85, lmcache_l1_size="1GB",
                proxy_workers=None, one_gpu=True, vllm_args=("--load-format", "dummy"), log_dir=tmp_path)
    return SimpleNamespace(**{**base, **over})


@pytest.mark.parametrize("one_gpu", [True, False])
def test_the_system_is_the_launchers_mp_recipe_with_the_pass_flags(tmp_path, mp_gpu, one_gpu):
    argv = mp_gpu.launch_argv(cfg_of(tmp_path, one_gpu=one_gpu), tmp_path / "logs", 9100, 600)
    assert argv[1:4] == ["-m", "lmcache_p2p.cli.main", "launch"]
    own, vllm_args = split_passthrough(argv[3:])  # as the launcher's main reads it
    args = build_parser().parse_args(own)
    args.vllm_arg = [*args.vllm_arg, *vllm_args]
    assert connectors.connector_of(args) is connectors.Connector.NIXL_LMCACHE_MP
    connectors.check_flags(args)  # nothing of our plugin's: refused with a vLLM connector
    assert (args.device, args.prefill, args.decode, args.lmcache_l1_size) == ("cuda", 1, 1, "1GB")
    assert (args.proxy_port, args.proxy_control_port, args.on_exit) == (9100, 9101, "stop")
    assert args.prefix_caching is False
    assert args.vllm_arg == ["--no-enable-prefix-caching", "--load-format", "dummy"]
    assert (args.gpus, args.share_gpus) == (("0,0", True) if one_gpu else (None, False))
    prefiller, decoder = launch.plan(args)
    assert (prefiller.http_port, decoder.http_port) == (7100, 7200)  # the pass's P2P_PREFILL_PORT / P2P_DECODE_PORT
    server = launch.lmcache_servers.child(decoder, args, tmp_path)
    assert server.argv[server.argv.index("--l1-size-gb") + 1] == "1"
    child = launch.vllm_child(decoder, tmp_path, args, tmp_path, launch.GpuAssignment((0,), 0.42))
    kv = json.loads(child.argv[child.argv.index("--kv-transfer-config") + 1])
    assert [c["kv_connector"] for c in kv["kv_connector_extra_config"]["connectors"]] == ["NixlConnector",
                                                                                       "LMCacheMPConnector"]


def test_the_pass_selects_starts_and_keys_the_system(tmp_path, e2e_gpu, mp_gpu, monkeypatch):
    cfg, _ = e2e_gpu.parse_args(["--model", str(tmp_path), "--systems", f"single,{SYSTEM}", "--one-gpu",
                                 "--lmcache-l1-size", "512MB", "--results-dir", str(tmp_path), "--", "--enforce-eager"])
    assert cfg.systems == ("single", SYSTEM) and cfg.lmcache_l1_size == "512MB"
    assert e2e_gpu.GPUS[SYSTEM] == 2 and SYSTEM in e2e_gpu.SYSTEMS
    assert e2e_gpu.workload(cfg, SYSTEM)["lmcache_l1_size"] == "512MB"
    assert "lmcache_l1_size" not in e2e_gpu.workload(cfg, "single")  # the reference rows stay reusable
    seen = {}

    def fake_start(cfg_, startup_timeout_s, stop_grace_s, proxy_port, instances, make_deployment, wait_registered):
        seen.update(proxy_port=proxy_port, instances=instances, wait=wait_registered)
        return make_deployment(SYSTEM, f"http://127.0.0.1:{proxy_port}", lambda: None, None, True, instances)

    monkeypatch.setattr(mp_gpu, "start", fake_start)
    dep = e2e_gpu.start(SYSTEM, cfg)
    assert (dep.system, dep.url, dep.has_stats, dep.decoder_log) == (SYSTEM, "http://127.0.0.1:9100", True, None)
    assert seen["instances"] == (("prefiller", 7100), ("decoder", 7200)) and seen["wait"] is e2e_gpu.wait_registered
    result = {"duration": 2.0, "ttfts": [0.05], "itls": [[0.01, 0.01]], "errors": [""], "generated_texts": ["ab"]}
    row = e2e_gpu.make_row(SYSTEM, 4.0, result, {"handover_ms": {"p50": 3.0, "p99": 4.0}}, [], 3, 1)
    assert (row["gpus"], row["handover_ms_p50"], row["kv_hit_ratio"], row["completed"]) == (1, 3.0, None, 1)
