"""The 1P1D deployment of the tiny model and the plain instance's answers, shared by the e2e modules
(``tests/shared.py``): test_pd_vllm, test_prompt_kv_vllm and test_colocated_vllm run on one deployment,
test_pd_vllm and test_vllm_router compare with one set of reference answers."""

from __future__ import annotations

import pytest

import shared
from test_pd_vllm import plain_answers, spawn_cluster


@pytest.fixture(scope="session")
def pd_cluster(tiny_model_dir, tmp_path_factory) -> shared.SharedDeployment:
    """1P1D through our proxy with ``--on-kv-failure fail`` (a KV handover that did not work is an error, never
    a silent recompute), every port of a second decoder checked free (test_pd_vllm's join)."""
    return shared.SharedDeployment(
        "pd_cluster", lambda: spawn_cluster(tiny_model_dir, tmp_path_factory.mktemp("pd") / "logs", decoders_ever=2),
        lambda c: c.wait_ready(), lambda c: c.stop())


@pytest.fixture(scope="session")
def tiny_reference(plain_tiny, tiny_model_dir) -> tuple[dict, list[dict]]:
    """The plain tiny instance's answers to test_pd_vllm's prompts, chat and conversation."""
    child = plain_tiny.get()
    return plain_answers(child.health_url.removesuffix("/health"), str(tiny_model_dir))
