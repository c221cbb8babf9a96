"""``launch --connector nixl-lmcache-mp | nixl-push-lmcache-mp``: LMCache's multi-process PD recipe (vLLM's
MultiConnector of the NIXL connector and LMCacheMPConnector, an LMCache server per instance) behind our proxy. No
processes: the planned servers, vLLM configs, ports, start order, and the refusals where it cannot run."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from lmcache_p2p.cli import connectors, launch, lmcache_servers, ports
from lmcache_p2p.cli.instance import GpuAssignment
from lmcache_p2p.cli.main import build_parser
from lmcache_p2p.errors import ConfigError, StartupError

from .test_launch_connector import children, kv_config, parse

NIXL_NAMES = {"nixl-lmcache-mp": "NixlConnector", "nixl-push-lmcache-mp": "NixlPushConnector"}


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.fixture
def lmcache_here(monkeypatch, tmp_path):
    """An lmcache whose own LMCacheMPConnector and CPU device are installed (vLLM takes LMCache's connector)."""
    root = tmp_path / "site" / "lmcache"
    for name in (connectors.LMCACHE_MP_CONNECTOR_FILE, connectors.LMCACHE_CPU_DEVICE_FILE):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("")
    monkeypatch.setattr(connectors, "installed_lmcache_dir", lambda: root)
    monkeypatch.delenv(connectors.UPSTREAM_MP_ENV, raising=False)
    return root


@pytest.mark.parametrize("connector", ["nixl-lmcache-mp", "nixl-push-lmcache-mp"])
def test_each_instance_gets_its_lmcache_server_and_a_multiconnector_dialing_it(tmp_path, lmcache_here, connector):
    nixl = children(tmp_path / "nixl", "--connector", connector.removesuffix("-lmcache-mp"), "--prefill", "1",
                    "--decode", "2", "--vllm-arg=--enforce-eager")
    made = children(tmp_path / "mp", "--connector", connector, "--prefill", "1", "--decode", "2",
                    "--vllm-arg=--enforce-eager", "--lmcache-l1-size", "512MB")
    assert list(made) == ["proxy", "prefiller-0-lmcache", "decoder-0-lmcache", "decoder-1-lmcache",
                          "prefiller-0", "decoder-0", "decoder-1"]
    for slot, name in enumerate(("prefiller-0", "decoder-0", "decoder-1")):
        server, inst, plain = made[f"{name}-lmcache"], made[name], nixl[name]
        port = 7600 + 2 * slot
        assert server.argv[1:5] == ["-m", "lmcache.cli.main", "server", "--host"]
        assert (flag(server.argv, "--port"), flag(server.argv, "--http-port")) == (str(port), str(port + 1))
        assert (flag(server.argv, "--l1-size-gb"), flag(server.argv, "--instance-id")) == ("0.5", name)
        assert (flag(server.argv, "--chunk-size"), flag(server.argv, "--supported-transfer-mode")) == ("256", "auto")
        assert server.health_url == f"http://127.0.0.1:{port + 1}/healthcheck"
        assert (server.log_path.name, server.cpus) == (f"{name}-lmcache.log", inst.cpus)
        assert server.env["LMCACHE_TRACK_USAGE"] == "false" and "CUDA_VISIBLE_DEVICES" not in server.env
        assert kv_config(inst.argv) == {
            "kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": [
                {"kv_connector": NIXL_NAMES[connector], "kv_role": "kv_both", "kv_buffer_device": "cpu"},
                {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
                    "lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port}}]}}
        at = inst.argv.index("--kv-transfer-config")
        # everything else is the plain NIXL connector's instance: flags, environment, cores, health, log
        assert inst.argv[:at] + inst.argv[at + 2:] == plain.argv[:at] + plain.argv[at + 2:]
        logging_file = "VLLM_LOGGING_CONFIG_PATH"  # each launch's own log folder
        assert {**inst.env, logging_file: ""} == {**plain.env, logging_file: ""}
        assert (inst.cpus, inst.health_url) == (plain.cpus, plain.health_url)
    assert launch.proxy_child(parse(tmp_path, "--connector", connector), tmp_path).argv[-2:] == \
        launch.proxy_child(parse(tmp_path, "--connector", "nixl"), tmp_path).argv[-2:]  # registered by URL alike
    assert not list((tmp_path / "mp").glob("*.yaml"))  # no LMCache YAML: the servers take flags


def test_the_servers_start_first_then_the_proxy_and_the_instances_in_their_waves(tmp_path, lmcache_here):
    made = children(tmp_path / "logs", "--connector", "nixl-lmcache-mp", "--decode", "2")
    waves = [[c.name for c in wave] for wave in lmcache_servers.start_waves(list(made.values()))]
    assert waves == [["prefiller-0-lmcache", "decoder-0-lmcache", "decoder-1-lmcache"],
                     ["proxy", "prefiller-0", "decoder-0", "decoder-1"]]
    plain = children(tmp_path / "plain", "--connector", "nixl", "--decode", "2")
    assert [[c.name for c in w] for w in lmcache_servers.start_waves(list(plain.values()))] == \
        [["proxy", "prefiller-0", "decoder-0", "decoder-1"]]


def test_server_ports_are_planned_and_checked_with_the_others(tmp_path):
    args = parse(tmp_path, "--connector", "nixl-lmcache-mp", "--decode", "2", "--lmcache-server-port", "8600")
    planned = {u.port: u.purpose for u in launch.planned_ports(args)}
    assert sorted(planned) == [7100, 7200, 7201, 7300, 7301, 7302, 8600, 8601, 8602, 8603, 8604, 8605, 9100, 9101]
    assert planned[8602] == "decoder-0's LMCache server (--lmcache-server-port)"
    assert planned[8605] == "decoder-1's LMCache server HTTP (--lmcache-server-port + 1)"
    clash = parse(tmp_path, "--connector", "nixl-lmcache-mp", "--lmcache-server-port", "7199")
    with pytest.raises(StartupError, match=r"port 7200 is planned twice: prefiller-0's LMCache server HTTP .* and "
                                           r"decoder-0's HTTP"):
        ports.check_ports_free(launch.planned_ports(clash))
    nixl = {u.port for u in launch.planned_ports(parse(tmp_path, "--connector", "nixl", "--decode", "2"))}
    assert set(planned) - nixl == {8600, 8601, 8602, 8603, 8604, 8605}


def test_on_a_gpu_each_server_sees_its_instances_gpus_and_takes_no_share_of_them(tmp_path, lmcache_here):
    args = parse(tmp_path, "--connector", "nixl-push-lmcache-mp", "--device", "cuda")
    decoder = launch.plan(args)[1]
    gpu = GpuAssignment((1,), 0.85)
    server = lmcache_servers.child(decoder, args, tmp_path, gpu)
    inst = launch.vllm_child(decoder, tmp_path, args, tmp_path, gpu)
    assert server.env["CUDA_VISIBLE_DEVICES"] == inst.env["CUDA_VISIBLE_DEVICES"] == "1"
    nixl, lmcache = kv_config(inst.argv)["kv_connector_extra_config"]["connectors"]
    assert nixl == {"kv_connector": "NixlPushConnector", "kv_role": "kv_both"}  # KV in VRAM
    assert lmcache["kv_connector_extra_config"]["lmcache.mp.port"] == 7602
    assert launch.instance_utilization(decoder, args, 80 * 2**30) == 0.85  # its L1 is host memory


def test_a_cpu_launch_is_refused_where_vllm_would_take_its_cuda_only_builtin_connector(tmp_path, lmcache_here):
    args = parse(tmp_path, "--connector", "nixl-lmcache-mp")
    connectors.check_runs_here(args, environ={})
    with pytest.raises(ConfigError, match=r"LMCACHE_USE_UPSTREAM_MP .*torch\.cuda\.Event\(interprocess=True\).*"
                                          r"vllm/distributed/kv_transfer/kv_connector/v1/lmcache_mp_connector\.py"):
        connectors.check_runs_here(args, environ={connectors.UPSTREAM_MP_ENV: "1"})
    (lmcache_here / connectors.LMCACHE_MP_CONNECTOR_FILE).unlink()
    with pytest.raises(ConfigError, match=r"^--connector: .*no lmcache/integration/vllm/lmcache_mp_connector\.py, so "
                                          r"vLLM falls back to vLLM's built-in LMCacheMPConnector.*needs CUDA"):
        connectors.check_runs_here(args, environ={})
    # on a GPU vLLM's built-in connector is a CUDA one: nothing to refuse
    connectors.check_runs_here(parse(tmp_path, "--connector", "nixl-lmcache-mp", "--device", "cuda"), environ={})


def test_a_launch_without_lmcache_is_refused_on_any_device(tmp_path, monkeypatch):
    monkeypatch.setattr(connectors, "installed_lmcache_dir", lambda: None)
    for device in ("cpu", "cuda"):
        with pytest.raises(ConfigError, match="starts an LMCache server per instance, and lmcache is not installed"):
            connectors.check_runs_here(parse(tmp_path, "--connector", "nixl-lmcache-mp", "--device", device), {})
    connectors.check_runs_here(parse(tmp_path, "--connector", "nixl"), {})  # no server, no lmcache needed


def test_launch_stops_before_starting_anything_when_the_recipe_cannot_run(tmp_path, caplog, monkeypatch, lmcache_here):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setenv(connectors.UPSTREAM_MP_ENV, "1")
    started = []
    monkeypatch.setattr(launch.Child, "start", lambda self: started.append(self.name))
    caplog.set_level(logging.ERROR)
    assert launch.run(parse(tmp_path, "--connector", "nixl-lmcache-mp")) == 2
    assert started == []
    assert "needs CUDA" in caplog.text and "--connector:" in caplog.text


def test_the_installed_lmcache_takes_its_own_connector_on_cpu():
    """This machine's lmcache (0.5.6) ships the connector vLLM prefers and its CPU device: a CPU launch goes ahead."""
    found = connectors.installed_lmcache_dir()
    if found is None:
        pytest.skip("lmcache is not installed")
    assert (found / connectors.LMCACHE_MP_CONNECTOR_FILE).is_file()
    connectors.check_runs_here(build_parser().parse_args(["launch", "--connector", "nixl-lmcache-mp"]), environ={})


@pytest.mark.parametrize(("connector", "flags", "named"), [
    ("nixl", ("--lmcache-l1-size", "1GB"), "--lmcache-l1-size"),
    ("lmcache_p2p", ("--lmcache-server-port", "8600"), "--lmcache-server-port"),
    ("nixl-lmcache-mp", ("--buffer-size", "1GB"), "--buffer-size"),
    ("nixl-lmcache-mp", ("--transport", "nccl"), "--transport"),
])
def test_flags_of_another_connector_are_refused_naming_the_flag(tmp_path, caplog, lmcache_here, connector, flags,
                                                                named):
    (tmp_path / "config.json").write_text("{}")
    caplog.set_level(logging.ERROR)
    assert launch.run(parse(tmp_path, "--connector", connector, *flags)) == 2
    assert f"{named}:" in caplog.text


def test_a_bad_l1_size_is_refused_naming_the_flag(tmp_path, lmcache_here):
    with pytest.raises(ConfigError, match="^--lmcache-l1-size: expected a size"):
        children(tmp_path / "logs", "--connector", "nixl-lmcache-mp", "--lmcache-l1-size", "lots")


def test_the_launcher_says_what_serves():
    args = build_parser().parse_args(["launch", "--connector", "nixl-push-lmcache-mp"])
    line = launch.serving_line(args, "http://127.0.0.1:9100", Path("/m"))
    assert line.startswith("vLLM's NixlPushConnector beside LMCache MP (MultiConnector) is serving 1P1D")
