"""What ``lmcache-p2p launch --device cuda`` gives each vLLM instance, checked on CPU (no GPU needed)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml

from lmcache_p2p.cli import launch
from lmcache_p2p.cli.gpu import GpuPlanError, GpuSlot, utilization_with_buffer, parse_nvidia_smi, split_utilization_arg
from lmcache_p2p.cli.main import build_parser, split_passthrough
from lmcache_p2p.cli.processes import startup_waves
from lmcache_p2p.cli.vllm_env import vllm_env, write_logging_config

H200 = 143771 * 2**20  # memory.total nvidia-smi reports for an H200, in bytes
TWO_H200 = [GpuSlot(0, H200), GpuSlot(1, H200)]


def parse(*argv: str):
    own, passthrough = split_passthrough(["launch", *argv])
    args = build_parser().parse_args(own)
    args.vllm_arg = [*args.vllm_arg, *passthrough]
    return args


@pytest.fixture(autouse=True)
def no_caller_env(monkeypatch) -> None:
    for key in ("UCX_TLS", "UCX_NET_DEVICES", "CUDA_VISIBLE_DEVICES", "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        monkeypatch.delenv(key, raising=False)


def children_for(args, tmp_path: Path, gpus=TWO_H200):
    instances = launch.plan(args)
    plan = launch.plan_gpus(instances, args, available=gpus)
    model = tmp_path / "model"
    return {i.name: launch.vllm_child(i, model, args, tmp_path, plan[i.name]) for i in instances}, plan


def flag(argv, name: str) -> str:
    return argv[argv.index(name) + 1]


def test_one_gpu_per_instance_with_cuda_ucx_and_nccl_settings(tmp_path: Path) -> None:
    args = parse("--device", "cuda", "--prefill", "1", "--decode", "1", "--transport", "nixl")
    children, _ = children_for(args, tmp_path)
    pre, dec = children["prefiller-0"], children["decoder-0"]
    assert (pre.env["CUDA_VISIBLE_DEVICES"], dec.env["CUDA_VISIBLE_DEVICES"]) == ("0", "1")
    for child in (pre, dec):
        tls = set(child.env["UCX_TLS"].split(","))
        assert {"cuda_ipc", "cuda_copy", "tcp"} <= tls
        assert child.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
        assert child.env["TORCH_NCCL_ENABLE_MONITORING"] == "0"
        assert "VLLM_CPU_OMP_THREADS_BIND" not in child.env
    cfg = yaml.safe_load(Path(dec.env["LMCACHE_CONFIG_FILE"]).read_text())
    assert cfg["extra_config"]["p2p"]["buffer_device"] == "cuda"


def test_cpu_instances_keep_loopback_tcp() -> None:
    env = vllm_env(cpu_core=1)
    assert env["UCX_TLS"] == "tcp,self" and "CUDA_VISIBLE_DEVICES" not in env


def test_xpyd_layout_and_gpus_flag(tmp_path: Path) -> None:
    gpus = [GpuSlot(i, H200) for i in range(4)]
    args = parse("--device", "cuda", "--prefill", "2", "--decode", "2", "--gpus", "3,2,1,0")
    children, _ = children_for(args, tmp_path, gpus)
    assert {n: c.env["CUDA_VISIBLE_DEVICES"] for n, c in children.items()} == {
        "prefiller-0": "3", "prefiller-1": "2", "decoder-0": "1", "decoder-1": "0"}
    assert [flag(c.argv, "--port") for c in children.values()] == ["7100", "7101", "7200", "7201"]
    decoder_1 = yaml.safe_load(Path(children["decoder-1"].env["LMCACHE_CONFIG_FILE"]).read_text())
    assert decoder_1["extra_config"]["p2p"]["control_ports"] == 7310


def test_decoder_utilization_leaves_room_for_its_vram_buffer(tmp_path: Path) -> None:
    args = parse("--device", "cuda", "--buffer-size", "8GB", "--send-buffer-size", "0", "--gpu-memory-utilization", "0.9")
    children, plan = children_for(args, tmp_path)
    assert flag(children["prefiller-0"].argv, "--gpu-memory-utilization") == "0.90"
    # 8 GiB of 140.4 GiB = 0.057 -> 0.06 off the decoder's share
    assert flag(children["decoder-0"].argv, "--gpu-memory-utilization") == "0.84"
    assert plan["decoder-0"].memory_utilization == pytest.approx(0.84)


def test_prefiller_stores_chunks_in_a_vram_arena_accounted_beside_vllm(tmp_path: Path) -> None:
    args = parse("--device", "cuda", "--send-buffer-size", "4GB", "--gpu-memory-utilization", "0.9")
    children, _ = children_for(args, tmp_path)
    # 4 GiB of 140.4 GiB = 0.028 -> 0.03 off the prefiller's share
    assert flag(children["prefiller-0"].argv, "--gpu-memory-utilization") == "0.87"
    p2p = yaml.safe_load(Path(children["prefiller-0"].env["LMCACHE_CONFIG_FILE"]).read_text())["extra_config"]["p2p"]
    assert (p2p["role"], p2p["buffer_device"], p2p["buffer_size"]) == ("sender", "cuda", "4GB")
    host = parse("--device", "cuda", "--send-buffer-size", "0")
    children, _ = children_for(host, tmp_path)
    p2p = yaml.safe_load(Path(children["prefiller-0"].env["LMCACHE_CONFIG_FILE"]).read_text())["extra_config"]["p2p"]
    assert "buffer_device" not in p2p and flag(children["prefiller-0"].argv, "--gpu-memory-utilization") == "0.85"
    cpu = parse("--device", "cpu")
    path = launch.write_lmcache_config(launch.plan(cpu)[0], cpu, tmp_path)
    assert "buffer_device" not in yaml.safe_load(path.read_text())["extra_config"]["p2p"]
    with pytest.raises(GpuPlanError, match=r"prefiller's send arena .*lower --send-buffer-size"):
        children_for(parse("--device", "cuda", "--send-buffer-size", "130GB"), tmp_path)


def test_utilization_among_the_vllm_args_is_the_base_and_not_passed_twice(tmp_path: Path) -> None:
    args = parse("--device", "cuda", "--buffer-size", "1GB", "--", "--gpu-memory-utilization", "0.5",
                 "--load-format", "dummy", "--enforce-eager")
    children, _ = children_for(args, tmp_path)
    dec = children["decoder-0"].argv
    assert dec.count("--gpu-memory-utilization") == 1 and flag(dec, "--gpu-memory-utilization") == "0.49"
    assert flag(dec, "--load-format") == "dummy" and "--enforce-eager" in dec


def test_a_buffer_that_leaves_vllm_no_room_is_refused() -> None:
    with pytest.raises(GpuPlanError, match=r"lower --buffer-size or raise --gpu-memory-utilization"):
        utilization_with_buffer(0.85, 120 * 2**30, H200)


def test_too_few_gpus_and_bad_gpus_flag_are_refused(tmp_path: Path) -> None:
    with pytest.raises(GpuPlanError, match=r"3 instances need 3 GPUs .* this host has 2"):
        children_for(parse("--device", "cuda", "--prefill", "1", "--decode", "2"), tmp_path)
    with pytest.raises(GpuPlanError, match=r"--gpus names GPU\(s\) \[5\]"):
        children_for(parse("--device", "cuda", "--gpus", "0,5"), tmp_path)
    with pytest.raises(GpuPlanError, match=r"repeats GPU\(s\) \[1\].*--share-gpus"):
        children_for(parse("--device", "cuda", "--gpus", "1,1"), tmp_path)


def test_share_gpus_splits_one_gpu_between_1p1d_over_nixl_only(tmp_path: Path) -> None:
    args = parse("--device", "cuda", "--gpus", "0,0", "--share-gpus", "--buffer-size", "4GB",
                 "--send-buffer-size", "2GB", "--gpu-memory-utilization", "0.9")
    children, plan = children_for(args, tmp_path, [GpuSlot(0, H200)])
    assert {n: c.env["CUDA_VISIBLE_DEVICES"] for n, c in children.items()} == {"prefiller-0": "0", "decoder-0": "0"}
    # each gets half of 0.90 less its own buffer: 2 GiB -> 0.02, 4 GiB -> 0.03
    assert flag(children["prefiller-0"].argv, "--gpu-memory-utilization") == "0.43"
    assert flag(children["decoder-0"].argv, "--gpu-memory-utilization") == "0.42"
    with pytest.raises(GpuPlanError, match=r"prefiller-0 and decoder-0 on GPU 0.*NCCL cannot"):
        children_for(parse("--device", "cuda", "--gpus", "0,0", "--share-gpus", "--transport", "nccl"), tmp_path,
                     [GpuSlot(0, H200)])


def test_instances_sharing_a_gpu_start_one_after_another(tmp_path: Path) -> None:
    """vLLM's memory profiling would count a neighbour starting at the same moment as its own use."""
    shared, _ = children_for(parse("--device", "cuda", "--gpus", "0,0", "--share-gpus"), tmp_path, [GpuSlot(0, H200)])
    proxy = launch.proxy_child(parse("--device", "cuda"), tmp_path)
    waves = startup_waves([proxy, shared["prefiller-0"], shared["decoder-0"]])
    assert [[c.name for c in wave] for wave in waves] == [["proxy", "prefiller-0"], ["decoder-0"]]
    apart, _ = children_for(parse("--device", "cuda", "--prefill", "1", "--decode", "1"), tmp_path)
    waves = startup_waves([proxy, apart["prefiller-0"], apart["decoder-0"]])
    assert [[c.name for c in wave] for wave in waves] == [["proxy", "prefiller-0", "decoder-0"]]


def test_ucx_without_cuda_in_the_callers_env_is_refused_for_nixl_only(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    with pytest.raises(GpuPlanError, match=r"UCX_TLS=tcp,self .* no CUDA memory support"):
        children_for(parse("--device", "cuda", "--transport", "nixl"), tmp_path)
    children_for(parse("--device", "cuda", "--transport", "nccl"), tmp_path)  # NCCL does not use UCX
    monkeypatch.setenv("UCX_TLS", "all")
    children, _ = children_for(parse("--device", "cuda", "--transport", "nixl"), tmp_path)
    assert children["decoder-0"].env["UCX_TLS"] == "all"  # the caller's choice wins


def test_passthrough_after_double_dash_and_vllm_arg() -> None:
    args = parse("--vllm-arg=--max-num-seqs=8", "--", "--skip-tokenizer-init", "--max-model-len", "4096")
    assert args.vllm_arg == ["--max-num-seqs=8", "--skip-tokenizer-init", "--max-model-len", "4096"]
    assert split_utilization_arg(["--gpu-memory-utilization=0.7", "--x"]) == (0.7, ["--x"])


def test_parse_nvidia_smi() -> None:
    assert parse_nvidia_smi("0, 143771\n1, 143771\n") == TWO_H200


def test_logging_config_formats_a_record_without_vllm_process_name(tmp_path: Path) -> None:
    """vLLM 0.24's records have no ``vllm_process_name``: the format must not need it."""
    formatter_mod = pytest.importorskip("vllm.logging_utils")
    config = json.loads(write_logging_config(tmp_path / "logging.json").read_text())
    spec = config["formatters"]["vllm"]
    assert spec["()"] == "vllm.logging_utils.NewLineFormatter"
    formatter = formatter_mod.NewLineFormatter(spec["fmt"], spec["datefmt"])
    record = logging.makeLogRecord({"name": "lmcache_p2p.backend", "levelno": logging.INFO, "levelname": "INFO",
                                    "msg": "hit %d", "args": (541,), "pathname": "/x/receiver.py", "lineno": 7})
    assert not hasattr(record, "vllm_process_name")
    line = formatter.format(record)
    assert line.endswith("hit 541") and "(MainProcess pid=" in line
