"""The 1P1D deployment of the tiny model, shared by the e2e modules (``tests/shared.py``): test_pd_vllm,
test_prompt_kv_vllm and test_colocated_vllm run on one deployment."""

from __future__ import annotations

import pytest

import shared
from test_pd_vllm import spawn_cluster


@pytest.fixture(scope="session")
def pd_cluster(tiny_model_dir, tmp_path_factory) -> shared.SharedDeployment:
    """1P1D through our proxy with ``--on-kv-failure fail`` (a KV handover that did not work is an error, never
    a silent recompute), every port of a second decoder checked free (test_pd_vllm's join)."""
    return shared.SharedDeployment(
        "pd_cluster", lambda: spawn_cluster(tiny_model_dir, tmp_path_factory.mktemp("pd") / "logs", decoders_ever=2),
        lambda c: c.wait_ready(), lambda c: c.stop())
