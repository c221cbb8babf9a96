"""``lmcache-p2p launch`` with a TP size per role: the plan (ports per rank, vLLM flags, cores or GPUs
per rank) and the refusals that name the flag, checked without vLLM."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml

from lmcache_p2p.cli import launch
from lmcache_p2p.cli.gpu import GpuPlanError, GpuSlot
from lmcache_p2p.cli.main import build_parser, split_passthrough
from lmcache_p2p.cli.processes import startup_waves
from lmcache_p2p.cli.tensor_parallel import ModelHeads, TpSizes, check_tp_fits_model, model_heads, tp_sizes
from lmcache_p2p.config import P2PConfig
from lmcache_p2p.errors import ConfigError

H200 = 143771 * 2**20


def parse(*argv: str):
    own, passthrough = split_passthrough(["launch", *argv])
    args = build_parser().parse_args(own)
    args.vllm_arg = [*args.vllm_arg, *passthrough]
    return args


def flag(argv, name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def cpu_children(tmp_path: Path, *argv: str, cores: int = 2, monkeypatch=None) -> dict:
    args = parse(*argv)
    monkeypatch.setattr(launch.os, "cpu_count", lambda: cores)
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: set(range(cores)))
    return {i.name: launch.vllm_child(i, tmp_path / "model", args, tmp_path) for i in launch.plan(args)}


@pytest.mark.parametrize(("argv", "want"), [
    ([], TpSizes(1, 1)),
    (["--tp", "2"], TpSizes(2, 2)),
    (["--prefill-tp", "2", "--decode-tp", "1"], TpSizes(2, 1)),
    (["--tp", "2", "--decode-tp", "4"], TpSizes(2, 4)),  # a role's own flag wins over --tp
    (["--", "--tensor-parallel-size", "2"], TpSizes(2, 2)),  # vLLM's own flag reads as --tp
    (["--vllm-arg=-tp=4", "--prefill-tp", "2"], TpSizes(2, 4)),
])
def test_tp_size_per_role(argv: list[str], want: TpSizes) -> None:
    assert tp_sizes(parse(*argv)) == want
    assert {i.name: i.tp_size for i in launch.plan(parse(*argv))} == {"prefiller-0": want.prefill,
                                                                     "decoder-0": want.decode}


def test_each_instance_gets_its_roles_tp_size_and_the_vllm_args_none_of_their_own(tmp_path: Path, monkeypatch) -> None:
    made = cpu_children(tmp_path, "--prefill-tp", "2", "--decode-tp", "1", "--", "--tensor-parallel-size", "2",
                        "--enforce-eager", monkeypatch=monkeypatch)
    pre, dec = made["prefiller-0"].argv, made["decoder-0"].argv
    assert flag(pre, "--tensor-parallel-size") == "2" and pre.count("--tensor-parallel-size") == 1
    assert "--tensor-parallel-size" not in dec  # TP 1 is vLLM's default: a TP1 instance's argv is as before
    assert "--enforce-eager" in pre and "--enforce-eager" in dec
    one = cpu_children(tmp_path, monkeypatch=monkeypatch)
    assert all("--tensor-parallel-size" not in c.argv for c in one.values())


def test_bad_tp_sizes_are_refused_naming_the_flag(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["launch", "--decode-tp", "0"])
    assert "--decode-tp: expects an integer >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"--tp 2 and --tensor-parallel-size 4 among the vLLM args disagree"):
        tp_sizes(parse("--tp", "2", "--", "--tensor-parallel-size", "4"))
    with pytest.raises(ConfigError, match=r"--prefill-tp 2 and --decode-tp 3: neither divides the other"):
        launch.plan(parse("--prefill-tp", "2", "--decode-tp", "3"))
    assert tp_sizes(parse("--prefill", "0", "--prefill-tp", "2", "--decode-tp", "3")) == TpSizes(2, 3)  # no pair


def test_every_decoder_rank_has_its_own_kv_ports() -> None:
    args = parse("--prefill", "1", "--decode", "2", "--prefill-tp", "1", "--decode-tp", "2", "--transport", "nccl")
    uses = {u.port: u.purpose for u in launch.planned_ports(args)}
    assert sorted(p for p, what in uses.items() if "KV control" in what) == [7300, 7301, 7310, 7311]
    assert sorted(p for p, what in uses.items() if "NCCL store" in what) == [7400, 7401, 7410, 7411]
    assert "decoder-1 rank 1's KV control port" in uses[7311]
    decoders = [i for i in launch.plan(args) if i.role == "decoder"]
    assert [d.control_ports for d in decoders] == [(7300, 7301), (7310, 7311)]
    prefiller = launch.plan(args)[0]
    assert prefiller.control_ports == () and prefiller.tp_size == 1  # a prefiller listens on no KV port
    wide = parse("--decode", "2", "--decode-tp", "16", "--prefill-tp", "16")
    assert [d.control_port for d in launch.plan(wide) if d.role == "decoder"] == [7300, 7316]  # ranks never overlap
    seen = [u.port for u in launch.planned_ports(wide)]
    assert len(seen) == len(set(seen))


def test_each_decoder_rank_reads_its_own_ports_from_the_instance_yaml(tmp_path: Path) -> None:
    args = parse("--decode", "2", "--tp", "2", "--transport", "nccl")
    decoder_1 = next(i for i in launch.plan(args) if i.name == "decoder-1")
    raw = yaml.safe_load(launch.write_lmcache_config(decoder_1, args, tmp_path).read_text())["extra_config"]["p2p"]
    cfg = P2PConfig.from_mapping(raw)
    assert [cfg.control_port(r) for r in range(2)] == list(decoder_1.control_ports) == [7310, 7311]
    assert [cfg.transport_port(r) for r in range(2)] == list(decoder_1.transport_ports) == [7410, 7411]


def test_every_rank_of_a_tp_instance_stores_and_loads_its_own_kv(tmp_path: Path) -> None:
    """LMCache keeps an MLA model's latent on rank 0 only unless told otherwise; every rank must load it."""
    args = parse("--prefill-tp", "2", "--decode-tp", "1")
    extra = {i.name: yaml.safe_load(launch.write_lmcache_config(i, args, tmp_path).read_text())["extra_config"]
             for i in launch.plan(args)}
    assert extra["prefiller-0"]["save_only_first_rank"] is False
    assert "save_only_first_rank" not in extra["decoder-0"]  # TP 1: LMCache's own default, as before


@pytest.mark.parametrize(("argv", "cores", "want"), [
    # 2 cores: the ranks of a TP2 instance on both; instances share them, decoder ranks counted from the last core
    (["--tp", "2"], 2, {"prefiller-0": "0|1", "decoder-0": "1|0"}),
    (["--prefill-tp", "2", "--decode-tp", "1"], 2, {"prefiller-0": "0|1", "decoder-0": "1"}),
    (["--prefill-tp", "1", "--decode-tp", "2"], 2, {"prefiller-0": "0", "decoder-0": "1|0"}),
    # a core per rank
    (["--tp", "2"], 4, {"prefiller-0": "0|1", "decoder-0": "2|3"}),
    (["--prefill-tp", "1", "--decode-tp", "2"], 3, {"prefiller-0": "0", "decoder-0": "1|2"}),
    # fewer cores than ranks but room for each role's TP size: the roles stay apart
    (["--decode", "2", "--prefill-tp", "1", "--decode-tp", "2"], 3,
     {"prefiller-0": "0", "decoder-0": "1|2", "decoder-1": "1|2"}),
])
def test_vllm_cpu_binds_a_core_per_rank(tmp_path: Path, monkeypatch, argv: list[str], cores: int,
                                       want: dict[str, str]) -> None:
    made = cpu_children(tmp_path, *argv, cores=cores, monkeypatch=monkeypatch)
    assert {n: c.env["VLLM_CPU_OMP_THREADS_BIND"] for n, c in made.items()} == want


def test_cpu_placement_with_tp_keeps_decoders_off_the_prefillers_cores_only_when_they_do_not_share() -> None:
    apart = parse("--tp", "2")
    assert launch.cpu_sets(apart, 4, usable=set(range(4))) == {"decoder-0": frozenset({2, 3})}
    shared = parse("--tp", "2")
    assert launch.cpu_sets(shared, 2, usable={0, 1}) == {}  # both instances use both cores


def gpu_children(tmp_path: Path, args, count: int):
    instances = launch.plan(args)
    plan = launch.plan_gpus(instances, args, available=[GpuSlot(i, H200) for i in range(count)])
    return {i.name: launch.vllm_child(i, tmp_path / "model", args, tmp_path, plan[i.name]) for i in instances}, plan


@pytest.fixture(autouse=True)
def no_caller_env(monkeypatch) -> None:
    for key in ("UCX_TLS", "UCX_NET_DEVICES", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(key, raising=False)


@pytest.mark.parametrize(("argv", "gpus", "want"), [
    (["--prefill-tp", "1", "--decode-tp", "2"], 3, {"prefiller-0": "0", "decoder-0": "1,2"}),
    (["--tp", "2"], 4, {"prefiller-0": "0,1", "decoder-0": "2,3"}),
    (["--tp", "2", "--gpus", "3,2,1,0"], 4, {"prefiller-0": "3,2", "decoder-0": "1,0"}),
    (["--prefill", "2", "--prefill-tp", "1", "--decode-tp", "2"], 4,
     {"prefiller-0": "0", "prefiller-1": "1", "decoder-0": "2,3"}),
])
def test_gpus_one_per_rank_in_launch_order(tmp_path: Path, argv: list[str], gpus: int, want: dict[str, str]) -> None:
    args = parse("--device", "cuda", *argv)
    children, plan = gpu_children(tmp_path, args, gpus)
    assert {n: c.env["CUDA_VISIBLE_DEVICES"] for n, c in children.items()} == want
    assert all("VLLM_CPU_OMP_THREADS_BIND" not in c.env for c in children.values())
    decoder = children["decoder-0"]
    assert flag(decoder.argv, "--tensor-parallel-size") == "2"
    # each rank's receive buffer is on its own GPU: the share taken off is the TP1 decoder's
    assert plan["decoder-0"].memory_utilization == pytest.approx(0.84)
    assert plan["decoder-0"].indices == tuple(int(g) for g in want["decoder-0"].split(","))


def test_too_few_gpus_for_the_tp_sizes_names_the_flags(tmp_path: Path) -> None:
    with pytest.raises(GpuPlanError, match=r"1 prefiller at TP 2 and 1 decoder at TP 2 need 4 GPUs \(one per TP "
                                           r"rank\) but this host has 3: lower --prefill/--decode or "
                                           r"--prefill-tp/--decode-tp"):
        gpu_children(tmp_path, parse("--device", "cuda", "--tp", "2"), 3)
    with pytest.raises(GpuPlanError, match=r"need 3 GPUs \(one per TP rank\) but --gpus lists 2"):
        gpu_children(tmp_path, parse("--device", "cuda", "--decode-tp", "2", "--gpus", "0,1"), 4)
    with pytest.raises(GpuPlanError, match=r"two TP ranks of decoder-0 on one GPU"):
        gpu_children(tmp_path, parse("--device", "cuda", "--decode-tp", "2", "--gpus", "0,1,1", "--share-gpus"), 2)


def test_instances_on_overlapping_gpus_start_one_after_another(tmp_path: Path) -> None:
    args = parse("--device", "cuda", "--prefill-tp", "2", "--decode-tp", "2", "--gpus", "0,1,1,2", "--share-gpus")
    children, plan = gpu_children(tmp_path, args, 3)
    assert plan["decoder-0"].indices == (1, 2) and plan["prefiller-0"].indices == (0, 1)
    waves = startup_waves([children["prefiller-0"], children["decoder-0"]])
    assert [[c.name for c in wave] for wave in waves] == [["prefiller-0"], ["decoder-0"]]
    # GPU 1 holds a rank of each: both get half of 0.85 on every GPU of theirs (less the decoder's buffer)
    assert flag(children["prefiller-0"].argv, "--gpu-memory-utilization") == "0.40"


def tiny_config(tmp_path: Path, **fields) -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2, **fields}))
    return model


def test_tp_sizes_the_model_cannot_take_are_refused_naming_the_flag(tmp_path: Path) -> None:
    heads = model_heads(tiny_config(tmp_path))
    assert heads == ModelHeads(4, 2)
    check_tp_fits_model(TpSizes(2, 1), heads)
    check_tp_fits_model(TpSizes(1, 4), heads)  # 4 ranks: each KV head on 2 of them (replicated)
    with pytest.raises(ConfigError, match=r"--decode-tp 8 does not divide the model's 4 attention heads"):
        check_tp_fits_model(TpSizes(1, 8), heads)
    with pytest.raises(ConfigError, match=r"--prefill-tp 3 and the model's 2 KV heads .* one to divide the other"):
        check_tp_fits_model(TpSizes(3, 3), ModelHeads(6, 2))
    assert model_heads(tiny_config(tmp_path, kv_lora_rank=512)) == ModelHeads(4, None)  # MLA: one latent
    assert model_heads(tmp_path / "nowhere") == ModelHeads(None, None)  # unknown: vLLM decides


def test_launch_refuses_a_tp_size_the_model_cannot_take_before_starting_anything(fake_launch, caplog) -> None:
    build, pid_dir = fake_launch
    args = build("--decode-tp", "3", "--prefill-tp", "3")
    (Path(args.model) / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2}))
    caplog.set_level(logging.ERROR)
    assert launch.run(args) == 2
    assert list(pid_dir.iterdir()) == []
    assert "--prefill-tp 3 does not divide the model's 4 attention heads" in caplog.text


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(("script", "env", "want"), [
    ("disagg_example_1p1d.sh", {"PREFILL_TP": "2", "DECODE_TP": "1"}, TpSizes(2, 1)),
    ("disagg_example_1p1d.sh", {"TP": "2"}, TpSizes(2, 2)),
    ("disagg_example_1p1d.sh", {}, TpSizes(1, 1)),
    ("disagg_example_xpyd.sh", {"TP": "2", "DECODE_TP": "4"}, TpSizes(2, 4)),
])
def test_example_launchers_pass_the_tp_sizes_on(tmp_path: Path, script: str, env: dict[str, str],
                                                want: TpSizes) -> None:
    import os
    import subprocess

    echo = tmp_path / "python"
    echo.write_text("#!/bin/sh\nshift 2\nprintf '%s\\n' \"$@\"\n")  # drops "-m lmcache_p2p.cli.main"
    echo.chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if k not in ("TP", "PREFILL_TP", "DECODE_TP")}
    out = subprocess.run(["bash", str(EXAMPLES / script)], env={**clean, **env, "PYTHON": str(echo)},
                         capture_output=True, text=True, check=True, timeout=30).stdout.splitlines()
    assert out[0] == "launch"
    assert tp_sizes(parse(*out[1:])) == want
