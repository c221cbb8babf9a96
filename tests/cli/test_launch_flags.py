"""The vLLM flags ``lmcache-p2p launch`` gives every instance, and the reference instance's (no processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmcache_p2p.cli import launch
from cluster import plain_vllm_child
from lmcache_p2p.cli.main import build_parser
from lmcache_p2p.config import parse_size_bytes


def children(tmp_path: Path, *argv: str) -> dict:
    args = build_parser().parse_args(["launch", "--prefill", "1", "--decode", "1", *argv])
    return {i.name: launch.vllm_child(i, tmp_path / "model", args, tmp_path) for i in launch.plan(args)}


def cache_part(argv: list[str]) -> set[str]:
    return {a for a in argv if a in ("--enable-prompt-tokens-details", "--no-enable-prefix-caching")}


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_every_instance_and_the_reference_get_the_same_cache_flags(tmp_path: Path, prefix_caching: bool) -> None:
    made = children(tmp_path, *([] if prefix_caching else ["--no-prefix-caching"]))
    want = {"--enable-prompt-tokens-details"} | (set() if prefix_caching else {"--no-enable-prefix-caching"})
    assert {name: cache_part(c.argv) for name, c in made.items()} == {"prefiller-0": want, "decoder-0": want}
    reference = plain_vllm_child(tmp_path / "model", tmp_path, port=1, cpu_core=None, prefix_caching=prefix_caching)
    assert cache_part(reference.argv) == want


@pytest.mark.parametrize(("prefill", "decode", "cores", "want"), [
    (1, 1, 2, {"prefiller-0": 0, "decoder-0": 1}),
    (1, 2, 2, {"prefiller-0": 0, "decoder-0": 1, "decoder-1": 1}),  # the prefiller keeps its core
    (2, 2, 2, {"prefiller-0": 0, "prefiller-1": 0, "decoder-0": 1, "decoder-1": 1}),
    (1, 2, 4, {"prefiller-0": 0, "decoder-0": 1, "decoder-1": 2}),  # a core each
    (2, 4, 4, {"prefiller-0": 0, "prefiller-1": 0, "decoder-0": 1, "decoder-1": 2, "decoder-2": 3,
               "decoder-3": 1}),
    (1, 1, 1, {"prefiller-0": 0, "decoder-0": 0}),
])
def test_cpu_cores_keep_prefillers_and_decoders_apart(prefill: int, decode: int, cores: int,
                                                      want: dict[str, int]) -> None:
    args = build_parser().parse_args(["launch", "--prefill", str(prefill), "--decode", str(decode)])
    assert {i.name: launch.cpu_core_of(i, args, cores) for i in launch.plan(args)} == want


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_no_prefix_caching_also_turns_the_decoders_buffer_cache_off(tmp_path: Path, prefix_caching: bool) -> None:
    import yaml

    args = build_parser().parse_args(["launch", "--prefill", "1", "--decode", "1",
                                      *([] if prefix_caching else ["--no-prefix-caching"])])
    decoder = next(i for i in launch.plan(args) if i.role == "decoder")
    p2p = yaml.safe_load(launch.write_lmcache_config(decoder, args, tmp_path).read_text())["extra_config"]["p2p"]
    assert p2p.get("buffer_cache", True) is prefix_caching


def test_p2p_flag_sets_keys_on_every_instance_and_a_bad_one_is_refused_at_launch(tmp_path: Path) -> None:
    import yaml

    from lmcache_p2p.errors import ConfigError

    args = build_parser().parse_args(["launch", "--p2p", "alloc_timeout_s=20", "--p2p", "connect_timeout_s=2.5"])
    for inst in launch.plan(args):
        p2p = yaml.safe_load(launch.write_lmcache_config(inst, args, tmp_path).read_text())["extra_config"]["p2p"]
        assert (p2p["alloc_timeout_s"], p2p["connect_timeout_s"]) == (20, 2.5)
    bad = build_parser().parse_args(["launch", "--p2p", "alloc_timeout=20"])
    with pytest.raises(ConfigError, match=r"p2p\.alloc_timeout: unknown key"):
        launch.write_lmcache_config(launch.plan(bad)[0], bad, tmp_path)
    malformed = build_parser().parse_args(["launch", "--p2p", "alloc_timeout_s"])
    with pytest.raises(ConfigError, match=r"--p2p: expects KEY=VALUE"):
        launch.write_lmcache_config(launch.plan(malformed)[0], malformed, tmp_path)


def test_decoders_recompute_a_chunk_that_fails_to_load_instead_of_failing_the_request(tmp_path: Path) -> None:
    import json

    made = children(tmp_path)

    def transfer(name: str) -> dict:
        argv = made[name].argv
        return json.loads(argv[argv.index("--kv-transfer-config") + 1])

    assert transfer("decoder-0")["kv_load_failure_policy"] == "recompute"
    assert transfer("decoder-0")["kv_role"] == "kv_consumer"
    assert "kv_load_failure_policy" not in transfer("prefiller-0")


@pytest.mark.parametrize(("prefill", "decode", "cores", "want"), [
    # 2 cores: the decoder's API server and engine core on its worker's core 1, never the prefiller's core 0
    (1, 1, 2, {"decoder-0": {1}}),
    (1, 2, 2, {"decoder-0": {1}, "decoder-1": {1}}),
    # spare cores stay open; only the prefillers' worker cores are left out
    (1, 1, 4, {"decoder-0": {1, 2, 3}}),
    (2, 2, 4, {"decoder-0": {2, 3}, "decoder-1": {2, 3}}),
    (1, 1, 1, {}),  # one core: the roles share it, nothing to keep apart
])
def test_cpu_placement_keeps_decoder_processes_off_the_prefillers_cores(prefill: int, decode: int, cores: int,
                                                                        want: dict[str, set[int]]) -> None:
    args = build_parser().parse_args(["launch", "--prefill", str(prefill), "--decode", str(decode)])
    assert launch.cpu_sets(args, cores, usable=set(range(cores))) == {name: frozenset(cpus)
                                                                      for name, cpus in want.items()}


def test_cpu_placement_stays_inside_the_cpus_the_launcher_may_use() -> None:
    args = build_parser().parse_args(["launch", "--prefill", "1", "--decode", "1"])
    assert launch.cpu_sets(args, 4, usable={0, 1, 2}) == {"decoder-0": frozenset({1, 2})}
    assert launch.cpu_sets(args, 4, usable={0}) == {}  # nothing left for the decoder: no restriction


@pytest.mark.parametrize("argv", [["--cpu-placement", "workers"], ["--device", "cuda"]])
def test_cpu_placement_workers_or_gpus_restrict_nothing(argv: list[str]) -> None:
    args = build_parser().parse_args(["launch", "--prefill", "1", "--decode", "1", *argv])
    assert launch.cpu_sets(args, 2) == {}


def test_launched_children_carry_their_cpu_sets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: {0, 1})
    args = build_parser().parse_args(["launch", "--prefill", "1", "--decode", "1"])
    made = {i.name: launch.vllm_child(i, tmp_path / "model", args, tmp_path) for i in launch.plan(args)}
    made["proxy"] = launch.proxy_child(args, tmp_path)
    # the proxy and the prefiller's API server / engine core go wherever a core is free
    assert {name: c.cpus for name, c in made.items()} == {"prefiller-0": None, "decoder-0": {1}, "proxy": None}
    # vLLM still pins each worker to the instance's core (the decoder's inside its set)
    assert (made["prefiller-0"].env["VLLM_CPU_OMP_THREADS_BIND"], made["decoder-0"].env["VLLM_CPU_OMP_THREADS_BIND"]) \
        == ("0", "1")
    off = build_parser().parse_args(["launch", "--prefill", "1", "--decode", "1", "--cpu-placement", "workers"])
    assert all(launch.vllm_child(i, tmp_path / "model", off, tmp_path).cpus is None for i in launch.plan(off))


def test_launch_says_how_many_prompt_tokens_a_decoder_buffer_holds_and_how_to_size_it(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 32, "num_key_value_heads": 8,
                                                      "hidden_size": 4096, "num_hidden_layers": 32}))
    note = launch.buffer_sizing("4GB", tmp_path)  # 128 KiB of KV per token
    assert f"~{parse_size_bytes('x', '4GB') // 131072} prompt tokens" in note
    assert "128 KiB per token" in note and "served colocated" in note and "2 x N x 128 KiB (--buffer-size)" in note
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"]}))  # no KV shape: nothing said
    assert launch.buffer_sizing("4GB", tmp_path) is None


def test_host_binds_every_listener_there_and_needs_the_secret_beyond_loopback(tmp_path: Path) -> None:
    import yaml

    from lmcache_p2p.errors import ConfigError

    args = build_parser().parse_args(["launch", "--host", "198.18.0.7", "--shared-secret", "s3"])
    for inst in launch.plan(args):
        child = launch.vllm_child(inst, tmp_path / "model", args, tmp_path)
        assert child.argv[child.argv.index("--host") + 1] == "198.18.0.7"
        assert child.health_url == f"http://198.18.0.7:{inst.http_port}/health"
        p2p = yaml.safe_load(launch.write_lmcache_config(inst, args, tmp_path).read_text())["extra_config"]["p2p"]
        assert (p2p["host"], p2p["http_url"], p2p["proxy_url"], p2p["shared_secret"]) == (
            "198.18.0.7", f"http://198.18.0.7:{inst.http_port}", f"tcp://198.18.0.7:{args.proxy_control_port}", "s3")
    proxy = launch.proxy_child(args, tmp_path)
    assert proxy.argv[proxy.argv.index("--host") + 1] == "198.18.0.7" and proxy.env["LMCACHE_P2P_SECRET"] == "s3"
    open_args = build_parser().parse_args(["launch", "--host", "198.18.0.7"])
    open_args.shared_secret = None  # whatever $LMCACHE_P2P_SECRET says
    decoder = next(i for i in launch.plan(open_args) if i.role == "decoder")
    with pytest.raises(ConfigError, match=r"p2p\.shared_secret"):
        launch.write_lmcache_config(decoder, open_args, tmp_path)
    loopback = build_parser().parse_args(["launch"])
    p2p = yaml.safe_load(launch.write_lmcache_config(launch.plan(loopback)[0], loopback, tmp_path).read_text())
    assert p2p["extra_config"]["p2p"]["host"] == "127.0.0.1"


def test_proxy_arg_passes_early_decode_to_the_proxy_which_takes_it(tmp_path: Path) -> None:
    """``launch --proxy-arg=--early-decode``: the proxy's command carries the flag, and the proxy's own parser turns it
    into its setting (the lead's GPU A/B is one launch flag)."""
    import argparse

    from lmcache_p2p.proxy.server import add_arguments
    from lmcache_p2p.proxy.settings import ProxySettings

    args = build_parser().parse_args(["launch", "--proxy-arg=--early-decode"])
    child = launch.proxy_child(args, tmp_path)
    assert "--early-decode" in child.argv
    proxy_argv = list(child.argv[child.argv.index("proxy") + 1:])
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert ProxySettings.from_args(parser.parse_args(proxy_argv)).early_decode is True
    default = build_parser().parse_args(["launch"])
    default_argv = list(launch.proxy_child(default, tmp_path).argv)
    assert ProxySettings.from_args(parser.parse_args(default_argv[default_argv.index("proxy") + 1:])).early_decode \
        is False
    assert parser.parse_args(["--no-early-decode"]).early_decode is False


@pytest.mark.parametrize("argv, chat_parsers", [
    (["--vllm-arg=--reasoning-parser=qwen3"], True),  # vLLM splits the reasoning on its chat endpoint alone
    (["--vllm-arg=--reasoning-parser", "--vllm-arg=deepseek_r1"], True),
    (["--vllm-arg=--reasoning-parser=qwen3", "--proxy-arg=--no-chat-parsers"], False),  # the operator's word holds
    (["--vllm-arg=--tool-call-parser=hermes"], False),  # tool chats go to the chat endpoint whatever the flag
    ([], False),
])
def test_instances_with_a_reasoning_parser_get_a_proxy_that_decodes_chats_on_their_chat_endpoint(
        tmp_path: Path, argv: list[str], chat_parsers: bool) -> None:
    import argparse

    from lmcache_p2p.proxy.server import add_arguments
    from lmcache_p2p.proxy.settings import ProxySettings

    child = launch.proxy_child(build_parser().parse_args(["launch", *argv]), tmp_path)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    proxy_argv = list(child.argv[child.argv.index("proxy") + 1:])
    assert ProxySettings.from_args(parser.parse_args(proxy_argv)).chat_parsers is chat_parsers
