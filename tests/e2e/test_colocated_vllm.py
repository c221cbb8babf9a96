"""Real vLLM-CPU: a request without disagg_spec works on our prefiller and our decoder, so the proxy
can serve a request colocated on whichever instance is left (``router/routing.py``).

1P1D (the deployment test_pd_vllm runs on: tests/e2e/conftest.py). The reference is the prefiller called
directly (a plain completion: ``transfer_spec=None`` reaches its sender plugin). Then the decoder answers
the same plain requests (it finds no KV and computes the prompt); then, with the prefiller drained, the
proxy serves on the decoder alone.
"""

from __future__ import annotations

import re

import httpx
import pytest

from lmcache_p2p.cli.drain import drain

from test_pd_vllm import MAX_TOKENS, PROMPTS, chat, complete  # tests/e2e is on sys.path (rootdir-relative)

pytestmark = pytest.mark.vllm

COLOCATED_RE = re.compile(r'^lmcache_p2p_proxy_colocated_total\{reason="no_prefiller",role="receiver"\} (\S+)$', re.M)


@pytest.fixture(scope="module")
def cluster(pd_cluster):
    """The shared 1P1D deployment (tests/e2e/conftest.py); stopped afterwards: its prefiller is drained."""
    c = pd_cluster.get()
    c.wait_registered(1, 1)  # whatever ran before, one decoder serves
    try:
        yield c
    finally:
        pd_cluster.stop()


def colocated_count(url: str) -> float:
    """Requests the proxy served on a decoder alone because no prefiller was there (its /metrics)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = COLOCATED_RE.search(text)
    return float(found.group(1)) if found else 0.0


def test_plain_requests_on_either_instance_and_colocated_through_the_proxy(cluster, tiny_model_dir):
    model = str(tiny_model_dir)
    prefiller, decoder = cluster.url_of("prefiller-0"), cluster.url_of("decoder-0")
    reference = {name: complete(prefiller, model, p) for name, p in PROMPTS.items()}
    reference["chat"] = chat(prefiller, model)
    for name, prompt in PROMPTS.items():  # what the proxy sends a colocated instance: streamed, no KV params
        assert complete(prefiller, model, prompt, stream=True)["text"] == reference[name]["text"], name
        assert complete(decoder, model, prompt, stream=True)["text"] == reference[name]["text"], name
    assert httpx.get(f"{prefiller}/health", timeout=10).status_code == 200  # no engine died
    assert httpx.get(f"{decoder}/health", timeout=10).status_code == 200

    colocated_before = colocated_count(cluster.url)
    assert drain(cluster.url, "prefiller-0", timeout_s=60)
    assert cluster.health()["prefillers"] == 0
    for name, prompt in PROMPTS.items():
        for stream in (False, True):
            got = complete(cluster.url, model, prompt, stream=stream)
            assert got["text"] == reference[name]["text"], (name, stream)
            assert got["usage"]["completion_tokens"] == MAX_TOKENS
            assert got["usage"]["prompt_tokens"] == reference[name]["usage"]["prompt_tokens"]
    assert chat(cluster.url, model, stream=True)["text"] == reference["chat"]["text"]
    assert colocated_count(cluster.url) - colocated_before == 9
