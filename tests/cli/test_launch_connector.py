"""``launch --connector nixl | nixl-push``: plain vLLM instances running vLLM's own NIXL connector, named to the
proxy by URL (no processes: the planned argv, environment, ports and proxy flags, and the refusals)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from lmcache_p2p.cli import connectors, launch, ports
from lmcache_p2p.cli.instance import GpuAssignment
from lmcache_p2p.cli.main import build_parser
from lmcache_p2p.config import Role
from lmcache_p2p.errors import ConfigError, StartupError
from lmcache_p2p.proxy.router.instances import Backend
from lmcache_p2p.proxy.router.registry import Registry
from lmcache_p2p.proxy.settings import ProxySettings

CONNECTOR_NAMES = {"nixl": "NixlConnector", "nixl-push": "NixlPushConnector"}


def parse(tmp_path: Path, *argv: str):
    return build_parser().parse_args(["launch", "--model", str(tmp_path), "--log-dir", str(tmp_path), *argv])


def children(log_dir: Path, *argv: str) -> dict:
    """The launch's children, its files in ``log_dir`` (the model: ``log_dir``'s parent)."""
    log_dir.mkdir(exist_ok=True)
    args = parse(log_dir, "--model", str(log_dir.parent), *argv)
    return {c.name: c for c in launch.build_children(args, log_dir.parent, log_dir)}


def kv_config(argv: list[str]) -> dict:
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


@pytest.mark.parametrize("connector", ["nixl", "nixl-push"])
def test_instances_run_vllms_connector_with_our_flags_cores_and_supervision_but_no_lmcache(tmp_path, connector):
    ours = children(tmp_path / "ours", "--prefill", "1", "--decode", "2", "--max-model-len", "1024",
                    "--vllm-arg=--enforce-eager")
    made = children(tmp_path / "nixl", "--connector", connector, "--prefill", "1", "--decode", "2",
                    "--max-model-len", "1024", "--vllm-arg=--enforce-eager")
    assert list(made) == list(ours) == ["proxy", "prefiller-0", "decoder-0", "decoder-1"]
    side_channels = []
    for name in ("prefiller-0", "decoder-0", "decoder-1"):
        child, mine = made[name], ours[name]
        assert kv_config(child.argv) == {"kv_connector": CONNECTOR_NAMES[connector], "kv_role": "kv_both",
                                         "kv_buffer_device": "cpu"}
        at = child.argv.index("--kv-transfer-config")
        assert child.argv[:at] + child.argv[at + 2:] == mine.argv[:at] + mine.argv[at + 2:]  # same vLLM flags
        assert (child.cpus, child.health_url, child.log_path.name) == (mine.cpus, mine.health_url, f"{name}.log")
        env = child.env
        assert "LMCACHE_CONFIG_FILE" not in env and "LMCACHE_CONFIG_FILE" in mine.env
        # our plugin stays for its spin cap (placement like ours); nothing of LMCache is configured
        assert (env["VLLM_PLUGINS"], env["LMCACHE_P2P_VLLM_SPIN_S"]) == ("lmcache_p2p", mine.env["LMCACHE_P2P_VLLM_SPIN_S"])
        assert (env["UCX_TLS"], env["VLLM_NIXL_SIDE_CHANNEL_HOST"]) == ("tcp,self", "127.0.0.1")
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == mine.env["VLLM_CPU_OMP_THREADS_BIND"]
        side_channels.append(int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]))
    assert side_channels == [7300, 7301, 7302]  # --kv-port + the place in the launch order
    assert not list((tmp_path / "nixl").glob("*.yaml"))  # no LMCache YAML written
    assert sorted(p.name for p in (tmp_path / "ours").glob("*.yaml")) == ["decoder-0.yaml", "decoder-1.yaml",
                                                                         "prefiller-0.yaml"]


def test_the_proxy_names_every_instance_by_url_and_its_registry_lists_them_under_the_ids_launch_waits_for(tmp_path):
    args = parse(tmp_path, "--connector", "nixl", "--prefill", "2", "--decode", "1", "--proxy-arg=--kv-timeout-s=30")
    proxy = launch.proxy_child(args, tmp_path)
    assert proxy.argv[1:4] == ["-m", "lmcache_p2p.cli.main", "proxy"]
    flags = [a for a in proxy.argv if a.startswith("--nixl-")]
    assert flags == ["--nixl-prefill=http://127.0.0.1:7100", "--nixl-prefill=http://127.0.0.1:7101",
                     "--nixl-decode=http://127.0.0.1:7200"]
    assert "--kv-timeout-s=30" in proxy.argv
    settings = ProxySettings.from_args(build_parser().parse_args(proxy.argv[3:]))  # the proxy accepts them
    registry = Registry(ttl_s=10.0)
    registered = [registry.register(spec) for spec in settings.registered_instances]
    assert {i.backend for i in registered} == {Backend.VLLM_NIXL}
    assert [i.role for i in registered] == [Role.SENDER, Role.SENDER, Role.RECEIVER]
    assert connectors.registry_ids(args, launch.plan(args)) == [i.instance_id for i in registered]


def test_our_connector_stays_the_default_and_its_proxy_gets_no_nixl_flags(tmp_path):
    args = parse(tmp_path)
    assert connectors.connector_of(args) is connectors.Connector.LMCACHE_P2P
    assert not [a for a in launch.proxy_child(args, tmp_path).argv if a.startswith("--nixl-")]
    assert connectors.registry_ids(args, launch.plan(args)) == ["prefiller-0", "decoder-0"]
    decoder = launch.vllm_child(launch.plan(args)[1], tmp_path, args, tmp_path)
    assert kv_config(decoder.argv)["kv_connector"] == "LMCacheConnectorV1"
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in decoder.env


def test_side_channel_ports_are_planned_and_checked_instead_of_our_kv_ports(tmp_path):
    args = parse(tmp_path, "--connector", "nixl", "--prefill", "1", "--decode", "2", "--decode-tp", "2")
    planned = {u.port: u.purpose for u in launch.planned_ports(args)}
    assert sorted(planned) == [7100, 7200, 7201, 7300, 7301, 7302, 9100, 9101]
    assert "decoder-1's NIXL handshake" in planned[7302] and "KV control" not in " ".join(planned.values())
    # a side-channel port on another child's port is refused before anything starts, naming both
    clash = parse(tmp_path, "--connector", "nixl", "--decode", "2", "--kv-port", "7199")
    with pytest.raises(StartupError, match=r"port 7200 is planned twice: decoder-0's HTTP .* and decoder-0's NIXL"):
        ports.check_ports_free(launch.planned_ports(clash))


def test_on_a_gpu_no_plugin_is_loaded_the_kv_stays_in_vram_and_no_buffer_share_is_taken(tmp_path):
    args = parse(tmp_path, "--connector", "nixl-push", "--device", "cuda")
    decoder = launch.plan(args)[1]
    child = launch.vllm_child(decoder, tmp_path, args, tmp_path, GpuAssignment((1,), 0.85))
    assert kv_config(child.argv) == {"kv_connector": "NixlPushConnector", "kv_role": "kv_both"}
    assert (child.env["VLLM_PLUGINS"], child.env["CUDA_VISIBLE_DEVICES"]) == ("", "1")
    assert "cuda_ipc" in child.env["UCX_TLS"] and child.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "7301"
    total = 80 * 2**30
    assert launch.instance_utilization(decoder, args, total) == 0.85  # ours: less its 1 GB receive buffer
    assert launch.instance_utilization(decoder, parse(tmp_path, "--device", "cuda"), total) < 0.85


def test_vllm_router_in_front_of_nixl_instances_is_vllms_own_pd_stack(tmp_path):
    made = children(tmp_path / "logs", "--connector", "nixl", "--router", "vllm-router")
    router = made["router"]
    assert router.argv[1:4] == ["-m", "vllm_router.launch_router", "--vllm-pd-disaggregation"]
    assert " ".join(router.argv).endswith("--prefill http://127.0.0.1:7100 --decode http://127.0.0.1:7200")
    assert kv_config(made["decoder-0"].argv)["kv_connector"] == "NixlConnector"
    assert not list((tmp_path / "logs").glob("*.yaml"))  # no router keys in an LMCache config: there is none


@pytest.mark.parametrize(("flags", "named"), [
    (("--transport", "nccl"), "--transport"),
    (("--p2p", "alloc_timeout_s=20"), "--p2p"),
    (("--buffer-size", "1GB"), "--buffer-size"),  # refused even at its default value: it was given
    (("--send-buffer-size", "0"), "--send-buffer-size"),
    (("--prefill-tp", "2", "--decode-tp", "3"), "--decode-tp"),
])
def test_flags_of_our_plugin_are_refused_with_a_vllm_connector_naming_the_flag(tmp_path, caplog, flags, named):
    (tmp_path / "config.json").write_text("{}")
    caplog.set_level(logging.ERROR)
    args = parse(tmp_path, "--connector", "nixl", *flags)
    assert launch.run(args) == 2
    assert f"{named}:" in caplog.text
    ours = parse(tmp_path, *flags)
    if named != "--decode-tp":  # ours takes them (the TP pair is refused for every connector)
        (tmp_path / "ours").mkdir()
        launch.build_children(ours, tmp_path, tmp_path / "ours")


@pytest.mark.parametrize("connector", ["nixl", "nixl-push", "nixl-lmcache-mp"])
@pytest.mark.parametrize("tp", [("--prefill-tp", "2"), ("--decode-tp", "2"), ("--prefill-tp", "2", "--decode-tp", "4")])
def test_different_tp_with_a_vllm_connector_is_refused_on_vllm_cpu_only(tmp_path, caplog, connector, tp):
    """vLLM's NIXL connector hung with different TP sizes on vLLM-CPU (connectors.check_tp_runs_here); ours pairs
    them there, and on GPUs vLLM's own does."""
    caplog.set_level(logging.ERROR)
    with pytest.raises(ConfigError, match="--connector .* on vLLM-CPU") as refused:
        connectors.check_flags(parse(tmp_path, "--connector", connector, *tp))
    assert refused.value.key == "--decode-tp"
    connectors.check_flags(parse(tmp_path, *tp))  # ours
    connectors.check_flags(parse(tmp_path, "--connector", connector, "--device", "cuda", *tp))
    connectors.check_flags(parse(tmp_path, "--connector", connector, "--tp", "2"))  # one size: not refused


def test_flags_left_at_their_defaults_are_not_refused(tmp_path):
    args = parse(tmp_path, "--connector", "nixl")
    assert (args.buffer_size, args.transport, args.p2p) == ("1GB", "nixl", [])
    connectors.check_flags(args)
    assert parse(tmp_path, "--buffer-size", "2GB").buffer_size == "2GB"  # the recording action still stores it


def test_the_demo_proves_a_pull_with_the_decoders_external_prefix_cache_hits():
    from lmcache_p2p.cli import demo

    text = ('vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 187.0\n'
            'vllm:external_prefix_cache_queries_total{engine="0",model_name="m"} 188.0\n')
    assert "pulled the KV of 187 of the 188 prompt tokens" in demo.pulled_line(text)
    assert "asked no prefiller" in demo.pulled_line("vllm:external_prefix_cache_hits_total 0\n")


def test_the_wait_for_the_proxy_to_list_vllm_connector_instances_is_the_start_ups():
    """Ours must announce within a minute of their /health (else the plugin is not running); instances of a vLLM
    connector cannot fail to announce, so a proxy slow to list them on loaded cores gets --startup-timeout-s."""
    def args(*extra):
        return build_parser().parse_args(["launch", "--startup-timeout-s", "600", *extra])

    assert launch.register_timeout_s(args()) == launch.REGISTER_TIMEOUT_S == 60.0
    assert launch.register_timeout_s(args("--connector", "nixl")) == 600.0
    assert launch.register_timeout_s(args("--connector", "nixl-push")) == 600.0
