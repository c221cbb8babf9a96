"""The vLLM general plugin, loaded as vLLM loads it, in a fresh interpreter each time."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from test_startup import yaml_with

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

SUBPROCESS_TIMEOUT_S = 180
CHILD_ENV = {"LMCACHE_TRACK_USAGE": "false", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S, env={**CHILD_ENV, **env}, cwd=ROOT)


def test_a_bad_p2p_section_fails_vllms_plugin_load(tmp_path) -> None:
    config = yaml_with(tmp_path, "decoder.yaml", bufer_size="1GB")
    proc = run_python("""
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        print("served on")
        """, LMCACHE_CONFIG_FILE=str(config))
    assert proc.returncode != 0 and "served on" not in proc.stdout
    assert "lmcache_p2p.errors.ConfigError: p2p.bufer_size: unknown key; known keys: " in proc.stderr


def test_the_plugin_guards_lmcaches_plugin_launcher_when_it_is_imported() -> None:
    proc = run_python("""
        import sys
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        print("lmcache imported at plugin load:", any(m.split(".")[0] == "lmcache" for m in sys.modules))
        import lmcache.v1.storage_backend as sb
        print("guarded:", getattr(sb.storage_plugin_launcher, "_lmcache_p2p_fail_loud", False))
        """, LMCACHE_CONFIG_FILE=str(ROOT / "configs" / "decoder.yaml"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lmcache imported at plugin load: False" in proc.stdout
    assert "guarded: True" in proc.stdout


def test_the_plugin_warns_at_load_when_an_installed_version_is_untested() -> None:
    proc = run_python("""
        from lmcache_p2p import compat
        compat.TESTED = {**compat.TESTED, compat.Platform.CPU: compat.Tested("0.0.1", "0.5.6", "1.5.1")}
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        print("loaded")
        """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lmcache_p2p is untested with vllm 0.32.0 (tested: 0.0.1)" in proc.stderr
    assert proc.stderr.count("lmcache_p2p is untested") == 1
