from __future__ import annotations

import argparse

import pytest

from lmcache_p2p.config import Role
from lmcache_p2p.errors import ConfigError
from lmcache_p2p.proxy.router.prefix import PrefixSettings
from lmcache_p2p.proxy.router.routing import Policy
from lmcache_p2p.proxy.server import add_arguments
from lmcache_p2p.proxy.settings import KvFailurePolicy, ProxySettings, parse_decode_flag, parse_prefill_flag


def parse(*argv: str) -> ProxySettings:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return ProxySettings.from_args(parser.parse_args(list(argv)))


def test_defaults_bind_loopback():
    s = parse()
    assert (s.host, s.port, s.control_host, s.control_port) == ("127.0.0.1", 9100, "127.0.0.1", 9101)
    assert s.policy is Policy.PREFIX and s.on_kv_failure is KvFailurePolicy.RETRY
    assert s.shared_secret is None and s.static_instances == ()


def test_decode_flag_defaults_and_base_ports():
    d = parse_decode_flag("http://10.0.0.5:8200/")
    assert d.role is Role.RECEIVER and d.http_url == "http://10.0.0.5:8200"
    assert (d.control_host, d.control_ports, d.transport_ports, d.tp_size) == ("10.0.0.5", (7300,), (7400,), 1)
    d = parse_decode_flag("http://127.0.0.1:8200,tp=2,control=7310,transport=7410,host=192.168.1.2")
    assert (d.control_host, d.control_ports, d.transport_ports) == ("192.168.1.2", (7310, 7311), (7410, 7411))


def test_decode_flag_explicit_port_lists():
    d = parse_decode_flag("http://127.0.0.1:8200,control=7300+7310,transport=7400+7410")
    assert d.tp_size == 2 and d.control_ports == (7300, 7310) and d.transport_ports == (7400, 7410)


@pytest.mark.parametrize("value, message", [
    ("127.0.0.1:8200", "must be an http"),
    ("http://h:1,ctrl=7300", "unknown option 'ctrl=7300'"),
    ("http://h:1,tp=2,control=7300+7301+7302", "lists 3 ports but tp=2"),
    ("http://h:1,control=70000", "1..65535"),
    ("http://h:1,tp=zero", "positive integer"),
])
def test_decode_flag_mistakes_name_the_flag(value, message):
    with pytest.raises(ConfigError, match=message) as info:
        parse_decode_flag(value)
    assert info.value.key.startswith("--decode")


def test_flags_collect_static_instances_and_secret_from_env(monkeypatch):
    monkeypatch.setenv("LMCACHE_P2P_SECRET", "from-env")
    s = parse("--prefill", "http://127.0.0.1:8100", "--prefill", "http://127.0.0.1:8101",
              "--decode", "http://127.0.0.1:8200,control=7300", "--policy", "round_robin", "--on-kv-failure", "fail")
    assert [i.role for i in s.static_instances] == [Role.SENDER, Role.SENDER, Role.RECEIVER]
    assert s.shared_secret == "from-env" and s.policy is Policy.ROUND_ROBIN
    assert s.on_kv_failure is KvFailurePolicy.FAIL
    assert parse("--shared-secret", "flag").shared_secret == "flag"
    assert parse_prefill_flag("https://p:1").role is Role.SENDER


def test_bad_flag_values_fail_at_parse_time(capsys):
    with pytest.raises(SystemExit):
        parse("--decode", "nope")
    assert "--decode: must be an http" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--kv-timeout-s"):
        parse("--kv-timeout-s", "0")


def test_health_flags():
    s = parse()
    assert (s.health_probe_interval_s, s.health_probe_timeout_s, s.max_connect_failures) == (1.0, 2.0, 2)
    s = parse("--health-probe-interval-s", "0.5", "--health-probe-timeout-s", "3", "--max-connect-failures", "5")
    assert (s.health_probe_interval_s, s.health_probe_timeout_s, s.max_connect_failures) == (0.5, 3.0, 5)
    with pytest.raises(ConfigError, match="--max-connect-failures"):
        parse("--max-connect-failures", "0")
    with pytest.raises(ConfigError, match="--health-probe-interval-s"):
        parse("--health-probe-interval-s", "0")


def test_prefix_policy_flags():
    s = parse("--policy", "prefix", "--prefix-cache-threshold", "0.3", "--prefix-balance-abs", "4",
              "--prefix-balance-rel", "2", "--prefix-index-chunks", "100", "--prefix-hash-seed", "7")
    assert s.policy is Policy.PREFIX
    assert s.prefix == PrefixSettings(cache_threshold=0.3, balance_abs_requests=4, balance_rel=2.0, index_chunks=100,
                                      hash_seed=7)
    assert parse("--policy", "round_robin").policy is Policy.ROUND_ROBIN


@pytest.mark.parametrize("flag, value", [("--prefix-cache-threshold", "1.5"), ("--prefix-balance-rel", "0.5"),
                                         ("--prefix-balance-abs", "-1"), ("--prefix-index-chunks", "0"),
                                         ("--prefix-hash-seed", "-1")])
def test_prefix_policy_flags_are_checked(flag, value):
    with pytest.raises(ConfigError, match=flag):
        parse(flag, value)
