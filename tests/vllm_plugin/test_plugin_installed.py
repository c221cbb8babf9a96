"""vLLM runs our plugin only when lmcache_p2p is installed (its ``vllm.general_plugins`` entry point): a
backend built inside vLLM without it says so, and a copy run from ``PYTHONPATH`` (the GPU pass) gets the
entry point from ``scripts/plugin_metadata.py``."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from lmcache_p2p import vllm_plugin

ROOT = Path(__file__).resolve().parents[2]

SUBPROCESS_TIMEOUT_S = 60


@pytest.fixture
def inside_vllm(monkeypatch):
    """LMCache's vLLM adapter is loaded (a stand-in: only its presence is read), the plugin not registered."""
    monkeypatch.setitem(sys.modules, vllm_plugin.ADAPTER_MODULE, types.ModuleType(vllm_plugin.ADAPTER_MODULE))
    monkeypatch.setattr(vllm_plugin, "_registered", False)


def test_a_backend_inside_vllm_without_the_plugin_logs_an_error_naming_the_fix(inside_vllm, caplog) -> None:
    with caplog.at_level(logging.ERROR, logger="lmcache_p2p.vllm_plugin"):
        assert vllm_plugin.check_registered() is False
    assert "lmcache_p2p's vLLM plugin did not run in this process" in caplog.text
    assert "vllm.general_plugins" in caplog.text and "pip install" in caplog.text


def test_with_the_plugin_registered_or_outside_vllm_nothing_is_logged(monkeypatch, caplog) -> None:
    monkeypatch.delitem(sys.modules, vllm_plugin.ADAPTER_MODULE, raising=False)
    monkeypatch.setattr(vllm_plugin, "_registered", False)
    with caplog.at_level(logging.ERROR, logger="lmcache_p2p.vllm_plugin"):
        assert vllm_plugin.check_registered() is True  # a backend in a test or a tool, not in vLLM
        monkeypatch.setitem(sys.modules, vllm_plugin.ADAPTER_MODULE, types.ModuleType("adapter"))
        monkeypatch.setattr(vllm_plugin, "_registered", True)
        assert vllm_plugin.check_registered() is True
    assert caplog.text == ""


def test_both_backends_check_where_lmcache_builds_them(inside_vllm, monkeypatch, caplog) -> None:
    pytest.importorskip("lmcache")
    from lmcache_p2p.backend import plugin_base

    monkeypatch.setattr(plugin_base, "install_full_graph_load", lambda: None)
    backend = types.SimpleNamespace()  # the step both backends' constructors take (sender.py, receiver.py)
    with caplog.at_level(logging.ERROR, logger="lmcache_p2p.vllm_plugin"):
        plugin_base.P2PPlugin._load_in_full_graphs(backend)
    assert "did not run in this process" in caplog.text


def _plugins_seen(path: list[Path]) -> str:
    """vLLM's general plugins as a fresh interpreter finds them on ``path`` alone (no site-packages, and run
    from the first folder: the checkout's own ``.egg-info`` of its editable install stays out of sight)."""
    code = ("from importlib.metadata import entry_points\n"
            "for ep in entry_points(group='vllm.general_plugins'):\n"
            "    print(ep.name, ep.value, ep.load().__qualname__)\n")
    proc = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True,
                          env={"PYTHONPATH": ":".join(map(str, path)), "PATH": "/usr/bin:/bin"},
                          cwd=path[0], timeout=SUBPROCESS_TIMEOUT_S)
    return proc.stdout


def test_a_copy_on_pythonpath_gets_the_entry_point_from_pyproject(tmp_path) -> None:
    copy, site = tmp_path / "copy", tmp_path / "site"  # the code as the GPU pass carries it: no .egg-info
    shutil.copytree(ROOT / "lmcache_p2p", copy / "lmcache_p2p", ignore=shutil.ignore_patterns("__pycache__"))
    site.mkdir()
    assert _plugins_seen([copy, site]) == ""  # what vLLM saw on the GPU machine: the plugin never ran
    made = subprocess.run([sys.executable, str(ROOT / "scripts" / "plugin_metadata.py"), str(site)], check=True,
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)  # as gpu_pass.sh runs it
    dist = Path(made.stdout.strip())
    assert _plugins_seen([copy, site]) == "lmcache_p2p lmcache_p2p.vllm_plugin:register register\n"
    assert "[console_scripts]\nlmcache-p2p = lmcache_p2p.cli.main:main\n" in (dist / "entry_points.txt").read_text()
