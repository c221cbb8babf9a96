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


def test_reserve_lease_must_outlive_the_write_window():
    with pytest.raises(ConfigError, match=r"p2p\.reserve_lease_s.*p2p\.transfer_timeout_s \+ p2p\.quarantine_margin_s"):
        P2PConfig.from_mapping({"role": "receiver", "reserve_lease_s": 30, "transfer_timeout_s": 30})
    cfg = P2PConfig.from_mapping({"role": "receiver", "reserve_lease_s": 36, "transfer_timeout_s": 30})
    assert cfg.write_window_s == 35 and cfg.reserve_lease_s == 36


def test_reserve_lease_not_set_is_derived_from_the_transfer_deadline():
    assert P2PConfig.from_mapping({"role": "receiver"}).reserve_lease_s == 70  # 2 * (30 + 5)
    cfg = P2PConfig.from_mapping({"role": "receiver", "transfer_timeout_s": 100, "quarantine_margin_s": 10})
    assert cfg.reserve_lease_s == 220 and cfg.reserve_lease_s > cfg.write_window_s
