"""bench/ scripts imported as modules (``bench.anchor``, ...), with the repository on sys.path."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def _bench_module(name: str) -> ModuleType:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return importlib.import_module(f"bench.{name}")


def _module_fixture(name: str) -> Any:
    """A session fixture that returns ``bench/<name>.py`` imported as a module."""

    @pytest.fixture(scope="session")
    def module() -> ModuleType:
        return _bench_module(name)

    return module


anchor = _module_fixture("anchor")
meta = _module_fixture("meta")
report = _module_fixture("report")
e2e = _module_fixture("e2e")
transfer = _module_fixture("transfer")
tp_cpu = _module_fixture("tp_cpu")
routers = _module_fixture("routers")
e2e_gpu = _module_fixture("e2e_gpu")
mp_gpu = _module_fixture("e2e_gpu_lmcache_mp")
