"""config: every mistake is one ConfigError naming the key and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lmcache_p2p.config import P2PConfig, Role, TransportKind, check_lmcache_settings, parse_size_bytes
from lmcache_p2p.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("text, expected", [
    ("2GB", 2 << 30), ("2GiB", 2 << 30), ("512MiB", 512 << 20), ("1.5g", 3 << 29), ("4096", 4096),
    (1024, 1024), ("64 kb", 64 << 10),
])
def test_sizes(text, expected):
    assert parse_size_bytes("p2p.buffer_size", text) == expected


@pytest.mark.parametrize("bad", ["two gigs", "-1GB", 0, True, "1PB", None, [1]])
def test_bad_size_names_the_key(bad):
    with pytest.raises(ConfigError, match=r"^p2p\.buffer_size: "):
        P2PConfig.from_mapping({"role": "receiver", "buffer_size": bad})


def test_shipped_yaml_files_validate():
    for name, role in (("prefiller.yaml", Role.SENDER), ("decoder.yaml", Role.RECEIVER)):
        raw = yaml.safe_load((ROOT / "configs" / name).read_text())
        assert raw["storage_plugins"] == ["p2p"]
        assert raw["extra_config"]["storage_plugin.p2p.module_path"] == "lmcache_p2p.backend"
        cfg = P2PConfig.from_mapping(raw["extra_config"]["p2p"])
        assert cfg.role is role and cfg.transport is TransportKind.NIXL


def test_defaults_and_ports():
    cfg = P2PConfig.from_mapping({"role": "receiver", "control_ports": [7300, 7310], "transport_ports": 7400})
    assert cfg.host == "127.0.0.1"
    assert (cfg.control_port(0), cfg.control_port(1)) == (7300, 7310)
    assert (cfg.transport_port(0), cfg.transport_port(3)) == (7400, 7403)
    with pytest.raises(ConfigError, match=r"p2p\.control_ports: lists 2 port\(s\) but TP rank 2"):
        cfg.control_port(2)


@pytest.mark.parametrize("raw, key, words", [
    (None, "p2p", "missing"),
    ({}, "p2p.role", "sender, receiver"),
    ({"role": "prefiller"}, "p2p.role", "must be one of sender, receiver"),
    ({"role": "sender", "transport": "rdma"}, "p2p.transport", "nixl, nccl"),
    ({"role": "sender", "buffer_device": "gpu"}, "p2p.buffer_device", "cpu, cuda, cuda:N"),
    ({"role": "sender", "alloc_timeout_s": 0}, "p2p.alloc_timeout_s", "positive number of seconds"),
    ({"role": "sender", "alloc_timeout": 3}, "p2p.alloc_timeout", "unknown key"),
    ({"role": "sender", "control_ports": [70000]}, "p2p.control_ports[0]", "1..65535"),
    ({"role": "sender", "proxy_url": "http://x:9"}, "p2p.proxy_url", "tcp://HOST:PORT"),
    ({"role": "sender", "shared_secret": ""}, "p2p.shared_secret", "non-empty"),
])
def test_errors_name_the_key(raw, key, words):
    with pytest.raises(ConfigError) as info:
        P2PConfig.from_mapping(raw)
    assert info.value.key == key
    assert words in str(info.value)


def test_lmcache_settings_that_break_the_plugin():
    class Cfg:
        enable_pd = True
        save_unfull_chunk = True

    with pytest.raises(ConfigError, match="^enable_pd: must be false"):
        check_lmcache_settings(Cfg())
    Cfg.enable_pd, Cfg.save_unfull_chunk = False, False
    with pytest.raises(ConfigError, match="^save_unfull_chunk: must be true"):
        check_lmcache_settings(Cfg())
    Cfg.save_unfull_chunk, Cfg.local_cpu = True, True
    check_lmcache_settings(Cfg(), Role.SENDER)  # a prefiller may cache (it just never hits)
    with pytest.raises(ConfigError, match="^local_cpu: must be false on a decoder"):
        check_lmcache_settings(Cfg(), Role.RECEIVER)


# ---- exposure and addresses -----------------------------------------------------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "decoder1.example", "::"])
def test_a_receiver_beyond_loopback_needs_a_secret(host):
    with pytest.raises(ConfigError, match=r"^p2p\.shared_secret: p2p\.host is .* p2p\.insecure: true") as err:
        P2PConfig.from_mapping({"role": "receiver", "host": host, "advertise_host": "10.1.2.3"})
    assert err.value.key == "p2p.shared_secret"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_loopback_needs_no_secret(host):
    assert P2PConfig.from_mapping({"role": "receiver", "host": host}).host == host


def test_secret_or_explicit_insecure_allows_binding_beyond_loopback(caplog):
    cfg = P2PConfig.from_mapping({"role": "receiver", "host": "10.1.2.3", "shared_secret": "s"})
    assert cfg.advertised_host() == "10.1.2.3"
    caplog.set_level("WARNING", logger="lmcache_p2p.config")
    cfg = P2PConfig.from_mapping({"role": "receiver", "host": "10.1.2.3", "insecure": True})
    assert cfg.insecure and "INSECURE" in caplog.text and "NOT authenticated" in caplog.text
    with pytest.raises(ConfigError, match=r"^p2p\.insecure: must be true or false"):
        P2PConfig.from_mapping({"role": "receiver", "insecure": "yes"})


def test_a_sender_binds_nothing_reachable_and_needs_no_secret():
    assert P2PConfig.from_mapping({"role": "sender", "host": "0.0.0.0"}).role is Role.SENDER


def test_advertise_host_is_separate_from_the_bind_host():
    cfg = P2PConfig.from_mapping({"role": "receiver", "host": "0.0.0.0", "advertise_host": "10.0.0.5",
                                  "shared_secret": "s"})
    assert (cfg.host, cfg.advertised_host()) == ("0.0.0.0", "10.0.0.5")
    assert P2PConfig.from_mapping({"role": "receiver"}).advertised_host() == "127.0.0.1"
    with pytest.raises(ConfigError, match=r"^p2p\.advertise_host: must be an address peers can dial"):
        P2PConfig.from_mapping({"role": "receiver", "advertise_host": "0.0.0.0"})


def test_a_wildcard_host_resolves_the_machine_or_asks_for_advertise_host(monkeypatch):
    import socket

    monkeypatch.setattr(socket, "gethostname", lambda: "node7")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: {"node7": "10.9.8.7"}[name])
    cfg = P2PConfig.from_mapping({"role": "receiver", "host": "0.0.0.0", "shared_secret": "s"})
    assert cfg.advertised_host() == "10.9.8.7"
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")  # Debian's /etc/hosts default
    with pytest.raises(ConfigError, match=r"^p2p\.advertise_host: .*'node7' resolves to loopback 127\.0\.1\.1"):
        P2PConfig.from_mapping({"role": "receiver", "host": "0.0.0.0", "shared_secret": "s"})

    def fail(name):
        raise OSError("unknown host")

    monkeypatch.setattr(socket, "gethostbyname", fail)
    with pytest.raises(ConfigError, match=r"^p2p\.advertise_host: .*does not resolve"):
        P2PConfig.from_mapping({"role": "receiver", "host": "::", "shared_secret": "s"})


def test_default_instance_ids_name_the_host(monkeypatch):
    import os
    import socket

    monkeypatch.setattr(socket, "gethostname", lambda: "node7")
    assert P2PConfig.from_mapping({"role": "receiver", "control_ports": 7310}).default_instance_id() == \
        "decoder-node7:7310"
    assert P2PConfig.from_mapping({"role": "sender"}).default_instance_id() == f"prefiller-node7-{os.getpid()}"
    assert P2PConfig.from_mapping({"role": "sender", "instance_id": "p0"}).default_instance_id() == "p0"


def test_auth_window_is_a_positive_number_of_seconds():
    assert P2PConfig.from_mapping({"role": "sender"}).auth_window_s == 30.0
    with pytest.raises(ConfigError, match=r"^p2p\.auth_window_s: must be a positive number"):
        P2PConfig.from_mapping({"role": "sender", "auth_window_s": 0})


def test_sender_request_and_settle_timeouts():
    cfg = P2PConfig.from_mapping({"role": "sender", "request_timeout_s": 120, "settle_timeout_s": 5})
    assert (cfg.request_timeout_s, cfg.settle_timeout_s) == (120.0, 5.0)
    assert P2PConfig(role=Role.SENDER).request_timeout_s >= 300  # generous: long prefills are legitimate
    for key in ("request_timeout_s", "settle_timeout_s"):
        with pytest.raises(ConfigError) as info:
            P2PConfig.from_mapping({"role": "sender", key: -1})
        assert info.value.key == f"p2p.{key}"


def test_reserve_lease_must_outlive_the_write_window():
    with pytest.raises(ConfigError, match=r"p2p\.reserve_lease_s.*p2p\.transfer_timeout_s \+ p2p\.quarantine_margin_s"):
        P2PConfig.from_mapping({"role": "receiver", "reserve_lease_s": 30, "transfer_timeout_s": 30})
    cfg = P2PConfig.from_mapping({"role": "receiver", "reserve_lease_s": 36, "transfer_timeout_s": 30})
    assert cfg.write_window_s == 35 and cfg.reserve_lease_s == 36


def test_reserve_lease_not_set_is_derived_from_the_transfer_deadline():
    assert P2PConfig.from_mapping({"role": "receiver"}).reserve_lease_s == 70  # 2 * (30 + 5)
    cfg = P2PConfig.from_mapping({"role": "receiver", "transfer_timeout_s": 100, "quarantine_margin_s": 10})
    assert cfg.reserve_lease_s == 220 and cfg.reserve_lease_s > cfg.write_window_s


def test_buffer_cache_is_on_by_default_and_must_be_a_boolean():
    assert P2PConfig.from_mapping({"role": "receiver"}).buffer_cache is True
    assert P2PConfig.from_mapping({"role": "receiver", "buffer_cache": False}).buffer_cache is False
    with pytest.raises(ConfigError, match=r"^p2p\.buffer_cache: must be true or false, got 'no'"):
        P2PConfig.from_mapping({"role": "receiver", "buffer_cache": "no"})


def test_write_poll_interval_defaults_by_where_chunks_live_and_is_bounded() -> None:
    assert P2PConfig.from_mapping({"role": "sender"}).write_poll_s == 0.001
    assert P2PConfig.from_mapping({"role": "sender", "buffer_device": "cuda"}).write_poll_s == 0.0001
    assert P2PConfig.from_mapping({"role": "sender", "buffer_device": "cuda",
                                   "write_poll_interval_s": 0.002}).write_poll_s == 0.002
    with pytest.raises(ConfigError, match=r"p2p\.write_poll_interval_s.*at most 0\.05s"):
        P2PConfig.from_mapping({"role": "sender", "write_poll_interval_s": 1})
    with pytest.raises(ConfigError, match=r"p2p\.write_poll_interval_s"):
        P2PConfig.from_mapping({"role": "sender", "write_poll_interval_s": 0})


def test_env_references_are_filled_in_at_load():
    raw = {"role": "receiver", "host": "${POD_IP}", "http_url": "http://${POD_IP}:7200", "instance_id": "${POD_NAME}",
           "shared_secret": "${LMCACHE_P2P_SECRET}", "control_ports": 7300}
    cfg = P2PConfig.from_mapping(raw, environ={"POD_IP": "10.1.2.3", "POD_NAME": "decoder-1",
                                               "LMCACHE_P2P_SECRET": "k"})
    assert (cfg.host, cfg.advertised_host(), cfg.http_url, cfg.instance_id, cfg.shared_secret) == (
        "10.1.2.3", "10.1.2.3", "http://10.1.2.3:7200", "decoder-1", "k")


def test_an_env_reference_to_an_unset_variable_names_the_key_and_the_variable():
    raw = {"role": "receiver", "host": "${POD_IP}", "shared_secret": "x"}
    with pytest.raises(ConfigError, match=r"p2p\.host: refers to \$\{POD_IP\} but the environment variable POD_IP "
                                          r"is not set"):
        P2PConfig.from_mapping(raw, environ={})
    # beyond loopback the secret stays required, also when it comes from the environment
    with pytest.raises(ConfigError, match=r"p2p\.shared_secret"):
        P2PConfig.from_mapping({"role": "receiver", "host": "${POD_IP}"}, environ={"POD_IP": "10.1.2.3"})


def test_nccl_queued_writes_bound_is_a_positive_count_named_in_its_errors():
    assert P2PConfig.from_mapping({"role": "sender"}).nccl_max_queued_writes == 4096
    assert P2PConfig.from_mapping({"role": "sender", "nccl_max_queued_writes": 8}).nccl_max_queued_writes == 8
    for bad in (0, -1, "many", 2.5, True):
        with pytest.raises(ConfigError, match=r"^p2p\.nccl_max_queued_writes: must be a positive whole number"):
            P2PConfig.from_mapping({"role": "sender", "nccl_max_queued_writes": bad})


def test_a_decoder_behind_a_foreign_router_refuses_ports_that_break_the_relation():
    ok = P2PConfig.from_mapping({"role": "receiver", "router_control_port_offset": 100,
                                 "http_url": "http://127.0.0.1:7200", "control_ports": [7300, 7301]})
    assert ok.router_control_port_offset == 100 and ok.router_kv_timeout_s == 5.0
    with pytest.raises(ConfigError, match=r"p2p.router_control_port_offset: is 100, .* rank 1 port 7305"):
        P2PConfig.from_mapping({"role": "receiver", "router_control_port_offset": 100,
                                "http_url": "http://127.0.0.1:7200", "control_ports": [7300, 7305]})
    with pytest.raises(ConfigError, match="p2p.router_control_port_offset: is set on a receiver but p2p.http_url"):
        P2PConfig.from_mapping({"role": "receiver", "router_control_port_offset": 100, "control_ports": 7300})
    with pytest.raises(ConfigError, match="p2p.router_control_port_offset: must be a whole number"):
        P2PConfig.from_mapping({"role": "sender", "router_control_port_offset": "100"})
    with pytest.raises(ConfigError, match="p2p.router_decoder_tp_size: must be a whole number of TP ranks"):
        P2PConfig.from_mapping({"role": "sender", "router_decoder_tp_size": -1})
    assert P2PConfig.from_mapping({"role": "sender", "router_control_port_offset": -50}).router_control_port_offset == -50
