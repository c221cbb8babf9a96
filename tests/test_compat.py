"""lmcache_p2p.compat: installed vLLM / LMCache / NIXL against the versions each path is tested with."""

from __future__ import annotations

import logging
import re
from importlib import metadata
from pathlib import Path

import pytest

from lmcache_p2p import compat

ROOT = Path(__file__).resolve().parents[1]


def versions(**found: str):
    """A ``metadata.version`` stand-in: distribution name -> version; any other is not installed."""

    def version_of(dist: str) -> str:
        if dist in found:
            return found[dist]
        raise metadata.PackageNotFoundError(dist)

    return version_of


def lmcache_files(*names: str):
    return lambda dist: list(names)


KERNELS_056 = lmcache_files("lmcache/__init__.py", "lmcache/cuda_ops.cpython-311-x86_64-linux-gnu.so")


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch) -> None:
    monkeypatch.setattr(compat, "_warned", False)


def test_the_tested_cpu_set_as_installed_by_setup_env_warns_nothing(caplog) -> None:
    installed = versions(**{"vllm-cpu": "0.32.0", "lmcache": "0.5.6", "nixl": "1.5.1", "nixl-cu12": "1.5.1"})
    with caplog.at_level(logging.WARNING, logger="lmcache_p2p.compat"):
        assert compat.warn_untested(compat.Platform.CPU, installed, KERNELS_056) == []
    assert caplog.records == []


def test_an_untested_lmcache_is_named_with_the_tested_set(caplog) -> None:
    installed = versions(vllm="0.24.0+cu130", lmcache="0.5.6", **{"nixl-cu13": "1.5.1"})
    with caplog.at_level(logging.WARNING, logger="lmcache_p2p.compat"):
        messages = compat.warn_untested(compat.Platform.GPU, installed, KERNELS_056)
    assert len(caplog.records) == 1 and caplog.records[0].levelno == logging.WARNING
    text = caplog.records[0].getMessage()
    assert text == messages[0]
    assert "untested with lmcache 0.5.6 (tested: 0.5.3)" in text
    assert "tested with vllm 0.24.0, lmcache 0.5.3, nixl 1.5.1" in text
    assert "installed: vllm 0.24.0+cu130, lmcache 0.5.6, nixl 1.5.1" in text  # a local tag is the same release
    assert "vllm 0.24.0+cu130 (tested" not in text and "docs/COMPATIBILITY.md" in text


def test_every_untested_component_is_named_and_a_missing_one_is_not_untested() -> None:
    found = compat.survey(compat.Platform.CPU, versions(vllm="0.33.1", lmcache="0.5.7"))
    message = compat.untested_message(compat.Platform.CPU, found)
    assert "untested with vllm 0.33.1 (tested: 0.32.0), lmcache 0.5.7 (tested: 0.5.6)." in message
    assert "nixl not installed" in message and "nixl None" not in message
    assert compat.untested_message(compat.Platform.CPU, compat.survey(
        compat.Platform.CPU, versions(**{"vllm-cpu": "0.32.0", "lmcache": "0.5.6"}))) is None


def test_one_warning_per_process_however_often_vllm_calls_the_plugin(caplog) -> None:
    installed = versions(vllm="0.25.0", lmcache="0.5.3", nixl="1.5.1")
    with caplog.at_level(logging.WARNING, logger="lmcache_p2p.compat"):
        for _ in range(3):
            assert compat.warn_untested(compat.Platform.GPU, installed, KERNELS_056)
    assert len(caplog.records) == 1


def test_lmcache_without_its_kernels_on_a_gpu_is_warned_not_refused(caplog) -> None:
    installed = versions(vllm="0.24.0", lmcache="0.5.3", nixl="1.5.1")
    bare = lmcache_files("lmcache/__init__.py", "lmcache/v1/cache_engine.py", "lmcache/lmcache_fs.cpython-311.so")
    with caplog.at_level(logging.WARNING, logger="lmcache_p2p.compat"):
        messages = compat.warn_untested(compat.Platform.GPU, installed, bare)
    assert len(messages) == 1 and "lmcache 0.5.3 ships no compiled kernels" in messages[0]
    assert "p2p.batched_gather" in messages[0]
    assert [r.getMessage() for r in caplog.records] == messages
    with_c_ops = lmcache_files("lmcache/c_ops.cpython-312-x86_64-linux-gnu.so")
    assert compat.kernels_message(compat.Platform.GPU, "0.5.3", with_c_ops) is None
    assert compat.kernels_message(compat.Platform.CPU, "0.5.6", bare) is None  # vLLM-CPU runs no CUDA gather


def test_the_installed_lmcache_kernels_are_found_in_its_metadata() -> None:
    pytest.importorskip("lmcache")
    assert compat.lmcache_kernel_files(), "the venv's lmcache lists no lmcache/c_ops or cuda_ops module"


def test_compatibility_doc_lists_the_tested_table() -> None:
    doc = (ROOT / "docs" / "COMPATIBILITY.md").read_text()
    for platform, tested in compat.TESTED.items():
        row = next((line for line in doc.splitlines() if line.startswith(f"| {platform.value.upper()} ")), "")
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1:4] == [tested.vllm, tested.lmcache, tested.nixl], (platform, row)


def test_setup_env_installs_the_tested_cpu_versions() -> None:
    script = (ROOT / "scripts" / "setup_env.sh").read_text()
    tested = compat.TESTED[compat.Platform.CPU]
    for name, version in (("VLLM", tested.vllm), ("LMCACHE", tested.lmcache), ("NIXL", tested.nixl)):
        assert re.search(rf"{name}_VERSION:-{re.escape(version)}\}}", script), name
