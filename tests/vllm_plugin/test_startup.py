"""A server whose LMCache YAML names our plugin starts with the plugin running, or not at all."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import yaml

from lmcache_p2p.errors import ConfigError
from lmcache_p2p.vllm_plugin import startup

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def yaml_with(tmp_path: Path, base: str, **p2p) -> Path:
    """The shipped YAML ``base`` with ``p2p`` keys added or replaced."""
    cfg = yaml.safe_load((CONFIGS / base).read_text())
    cfg["extra_config"]["p2p"].update(p2p)
    path = tmp_path / base
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_misspelled_p2p_key_stops_the_start_naming_it(tmp_path) -> None:
    path = yaml_with(tmp_path, "decoder.yaml", bufer_size="1GB")
    with pytest.raises(ConfigError) as err:
        startup.check_config_file({"LMCACHE_CONFIG_FILE": str(path)})
    assert err.value.key == "p2p.bufer_size"
    assert "p2p.bufer_size: unknown key; known keys: " in str(err.value)
    assert "buffer_size" in str(err.value).split("known keys: ")[1]
    assert f"LMCACHE_CONFIG_FILE={path}" in str(err.value)


def test_a_role_that_disagrees_with_the_plugin_class_stops_the_start(tmp_path) -> None:
    path = yaml_with(tmp_path, "prefiller.yaml", role="receiver")
    with pytest.raises(ConfigError, match=r"p2p\.role: is receiver but the plugin class is the sender"):
        startup.check_config_file({"LMCACHE_CONFIG_FILE": str(path)})


def test_shipped_configs_and_foreign_configs_pass(tmp_path) -> None:
    for name in ("prefiller.yaml", "decoder.yaml"):
        startup.check_config_file({"LMCACHE_CONFIG_FILE": str(CONFIGS / name)})
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({"chunk_size": 256, "local_cpu": True, "extra_config": {"p2p": {"bad": 1}}}))
    startup.check_config_file({"LMCACHE_CONFIG_FILE": str(other)})  # names no plugin of ours
    startup.check_config_file({})


def test_lmcache_swallowing_our_constructor_error_ends_the_engine_instead(tmp_path) -> None:
    pytest.importorskip("lmcache")
    import lmcache.v1.storage_backend as storage_backend
    from lmcache.v1.config import LMCacheEngineConfig

    original = storage_backend.storage_plugin_launcher
    config = LMCacheEngineConfig.from_file(str(yaml_with(tmp_path, "decoder.yaml", bufer_size="1GB")))
    backends: OrderedDict = OrderedDict()
    original(config, None, None, None, "cpu", backends)  # what LMCache does alone: logs and goes on
    assert "p2p" not in backends
    aborts: list[str] = []
    startup.guard_plugin_launcher(storage_backend, abort=aborts.append)  # the default ends the process
    try:
        storage_backend.storage_plugin_launcher(config, None, None, None, "cpu", backends)
    finally:
        storage_backend.storage_plugin_launcher = original
    assert len(aborts) == 1
    assert "lmcache_p2p plugin 'p2p' (lmcache_p2p.backend.ReceiverBackend) did not start" in aborts[0]
    assert "p2p.bufer_size: unknown key; known keys: " in aborts[0]


def test_exit_process_ends_the_process_with_the_config_exit_code() -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "from lmcache_p2p.vllm_plugin import startup\n"
                           "startup.exit_process('plugin p2p did not start')\nprint('still here')"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == startup.PLUGIN_START_EXIT_CODE and "still here" not in proc.stdout

