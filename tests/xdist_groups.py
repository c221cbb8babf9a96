"""How ``make test`` spreads the suite over pytest-xdist workers (``-n N --dist loadgroup``): each test belongs
to a group, a group runs on one worker in collection order, and the groups are handed out in collection order.

``tests/conftest.py`` names the groups: the serial group (every test that starts vLLM servers or network
namespaces, one after another on one worker) and one group per other module (its module fixtures set up
once). xdist's own loadgroup reads ``xdist_group`` marks by appending the group to each test's node id,
which pytest 9 no longer lets a plugin change; so the workers write every test's group to a file that the
controller's scheduler reads (:data:`ENV` names it; the controller makes it before the workers start).

A worker lowers its CPU priority (:data:`OTHERS_NICE`) before its first test outside the serial group, and so
do the processes it starts: the serial group, the suite's longest path, gets the CPU it asks for and the other
tests the rest.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

ENV = "LMCACHE_P2P_XDIST_GROUPS"
OTHERS_NICE = 10

_niced = False


def _controller_with_groups(config: pytest.Config) -> bool:
    return (config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput")
            and bool(config.getoption("numprocesses", None)) and config.getoption("dist", None) == "loadgroup")


def configure(config: pytest.Config) -> None:
    """In the controller of a loadgroup run: make the groups file the workers will write."""
    if _controller_with_groups(config):
        fd, path = tempfile.mkstemp(prefix="lmcache-p2p-xdist-groups-", suffix=".json")
        os.close(fd)
        os.environ[ENV] = path


def unconfigure(config: pytest.Config) -> None:
    if _controller_with_groups(config) and ENV in os.environ:
        Path(os.environ.pop(ENV)).unlink(missing_ok=True)


def publish(config: pytest.Config, groups: dict[str, str]) -> None:
    """In a worker: every collected test's group (node id -> group), for the controller's scheduler."""
    path = os.environ.get(ENV)
    if path and hasattr(config, "workerinput"):
        tmp = f"{path}.{os.getpid()}"
        Path(tmp).write_text(json.dumps(groups))
        os.replace(tmp, path)  # every worker writes the same collection: the last whole file wins


def make_scheduler(config: pytest.Config, log):
    """The controller's scheduler of a loadgroup run (None: xdist's own)."""
    path = os.environ.get(ENV)
    if not (_controller_with_groups(config) and path):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupFileScheduling(LoadScopeScheduling):
        """LoadScopeScheduling whose scope of a test is its group from the workers' file."""

        _groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:  # read once the collection is complete: every worker has written it
                self._groups = json.loads(Path(path).read_text() or "{}")
            return self._groups.get(nodeid, nodeid)

    return GroupFileScheduling(config, log)


def yield_cpu(config: pytest.Config) -> None:
    """In a worker, before a test outside the serial group: lower this process's CPU priority (once)."""
    global _niced
    if hasattr(config, "workerinput") and not _niced:
        os.nice(OTHERS_NICE)
        _niced = True
