"""A launcher child's CPU set (``Child.cpus``) holds for the child and for what it spawns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_p2p.cli.processes import Child

# prints its own CPU set, then its child's (vLLM's engine core and worker are children of the API server)
SCRIPT = ("import json, os, subprocess, sys; "
          "kid = subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'], "
          "capture_output=True, text=True, check=True).stdout.strip(); "
          "print(json.dumps([sorted(os.sched_getaffinity(0)), json.loads(kid)]))")


def run_child(tmp_path: Path, cpus: frozenset[int] | None) -> list[list[int]]:
    child = Child("probe", [sys.executable, "-c", SCRIPT], dict(os.environ), tmp_path / "probe.log",
                  "http://127.0.0.1:9/health", cpus=cpus)
    child.start()
    assert child.proc is not None
    assert child.proc.wait(60) == 0, child.log_tail()
    return json.loads(child.log_path.read_text().strip().splitlines()[-1])


def test_a_child_and_its_children_run_only_on_its_cpus(tmp_path: Path) -> None:
    mine = sorted(os.sched_getaffinity(0))
    one = mine[-1]
    assert run_child(tmp_path, frozenset({one})) == [[one], [one]]


def test_a_child_without_cpus_keeps_the_launchers_set(tmp_path: Path) -> None:
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("needs 2 CPUs to tell a restricted set from the launcher's own")
    assert run_child(tmp_path, None) == [mine, mine]
