"""The fault suite tells a wrong continuation from a right one (real processes, as test_faults.py).

``decoder_killed_mid_stream`` (short form) run through a proxy whose continuations drop the last
token already sent (``broken_proxy.py``): every stream cut after two tokens or more must be counted
wrong, first wrong at its cut, and every stream that never moved must still equal the plain instance.
Were the suite's reference not exact for this deployment (a decoder's batch changing greedy outputs),
this could not hold: the scenario's 0 wrong means something only because this test passes.

Run (holding the machine's vLLM lock):
    flock /tmp/lmcache_p2p_vllm.lock .venv/bin/python -m pytest -m faults tests/faults/test_detects_wrong_continuation.py -s
"""

from __future__ import annotations

import pytest

from fault_suite import print_table, run_suite

# A proof that the suite sees a wrong continuation (a ~3 min fault run of its own): `make test-long` runs it.
pytestmark = [pytest.mark.faults, pytest.mark.vllm, pytest.mark.long, pytest.mark.timeout(1800)]


def test_a_continuation_that_drops_a_token_is_reported_wrong(tiny_model_dir, tmp_path):
    row, = run_suite(tiny_model_dir, tmp_path, ["decoder_killed_mid_stream"],
                     cache_dir=tiny_model_dir.parent / ".fault-reference", broken_continuation="drop")
    print_table([row])
    broken = [s for s in row.streams if s["cuts"] and s["cuts"][0] >= 2]
    assert broken, f"no stream was cut after 2 tokens or more: {row.streams}"
    assert all(s["outcome"] == "ok" for s in row.streams), row
    for s in row.streams:
        if s in broken:
            assert s["first_difference"] == s["cuts"][0], s
        elif not s["cuts"]:
            assert s["first_difference"] is None, s
    assert row.wrong_outputs >= len(broken) and not row.passed(False)
