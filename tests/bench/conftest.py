"""bench/ scripts imported as modules (``bench.anchor``, ...), with the repository on sys.path."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _bench_module(name: str) -> ModuleType:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return importlib.import_module(f"bench.{name}")


@pytest.fixture(scope="session")
def anchor() -> ModuleType:
    return _bench_module("anchor")


@pytest.fixture(scope="session")
def meta() -> ModuleType:
    return _bench_module("meta")


@pytest.fixture(scope="session")
def report() -> ModuleType:
    return _bench_module("report")


@pytest.fixture(scope="session")
def e2e() -> ModuleType:
    return _bench_module("e2e")


@pytest.fixture(scope="session")
def transfer() -> ModuleType:
    return _bench_module("transfer")


@pytest.fixture(scope="session")
def tp_cpu() -> ModuleType:
    return _bench_module("tp_cpu")


@pytest.fixture(scope="session")
def routers() -> ModuleType:
    return _bench_module("routers")


@pytest.fixture(scope="session")
def e2e_gpu() -> ModuleType:
    return _bench_module("e2e_gpu")


@pytest.fixture(scope="session")
def mp_gpu() -> ModuleType:
    return _bench_module("e2e_gpu_lmcache_mp")
