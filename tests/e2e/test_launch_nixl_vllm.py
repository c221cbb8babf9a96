"""``lmcache-p2p launch --connector nixl`` for real: one command starts a vLLM-CPU prefiller and decoder running
vLLM's own NixlConnector and our proxy in front of them.

The launcher runs as a user runs it (its own process, Ctrl-C = SIGTERM). Greedy completions through the proxy,
plain and streamed, equal the decoder's own answers to the same prompts sent straight to it (one instance, the
same flags, no ``kv_transfer_params``); the decoder pulled the prompts' KV from the prefiller (vLLM's external
prefix cache hits on its /metrics); every request went the ``vllm-nixl`` way; SIGTERM stops everything.
No prefix caching, so that the decoder's own answers are computed before the pulls and never reused by them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from lmcache_p2p.cli import ports
from lmcache_p2p.cli.demo import metric_total
from test_nixl_backend_vllm import PROMPTS, complete  # tests/e2e is on sys.path
from vllm_server import free_cluster_base_port

# Two vLLM servers for ~2 min: in `make test-long`.
pytestmark = [pytest.mark.vllm, pytest.mark.long]

SERVING_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 90.0
HITS = "vllm:external_prefix_cache_hits_total"


def wait_serving(proc: subprocess.Popen, out: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while "is serving" not in open(out, errors="replace").read():
        assert proc.poll() is None, f"the launcher exited {proc.returncode}:\n{open(out).read()[-4000:]}"
        assert time.monotonic() < deadline, f"not serving after {timeout_s:.0f}s:\n{open(out).read()[-4000:]}"
        time.sleep(1.0)


def launch_1p1d(base: int, model_dir: Path, tmp_path: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """The launcher, as a user starts it, for 1P1D of ``model_dir`` laid out from ``base`` (proxy ``base``, prefiller
    ``base+10``, decoder ``base+30``, NIXL handshakes from ``base+50``), no prefix caching, stopping at the first
    exit; ``flags`` added. Returns the process and the file its output goes to."""
    argv = [sys.executable, "-m", "lmcache_p2p.cli.main", "launch", "--prefill", "1", "--decode", "1",
            "--model", str(model_dir), "--proxy-port", str(base), "--proxy-control-port", str(base + 1),
            "--prefill-port", str(base + 10), "--decode-port", str(base + 30), "--kv-port", str(base + 50),
            "--log-dir", str(tmp_path / "logs"), "--no-prefix-caching", "--on-exit", "stop", *flags]
    out = str(tmp_path / "launch.out")
    with open(out, "wb") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, out


def stop(proc: subprocess.Popen) -> int:
    """SIGTERM the launcher as Ctrl-C would; its exit code (its whole session killed if it does not stop)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def test_one_command_serves_vllm_nixl_instances_behind_our_proxy_with_one_instances_outputs(tiny_model_dir, tmp_path):
    # tp_size=2 claims base+50 and base+51: the two instances' NIXL handshake ports (--kv-port + slot)
    base = free_cluster_base_port(prefill=1, decode=1, tp_size=2)
    proxy, decoder = f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 30}"
    proc, out = launch_1p1d(base, tiny_model_dir, tmp_path, "--connector", "nixl")
    try:
        wait_serving(proc, out, SERVING_TIMEOUT_S)
        model = str(tiny_model_dir.resolve())  # the launcher serves the model under its resolved path
        reference = {p: complete(decoder, model, p) for p in PROMPTS}
        hits_before = metric_total(httpx.get(f"{decoder}/metrics", timeout=10).text, HITS)
        for prompt in PROMPTS:
            for stream in (False, True):
                assert complete(proxy, model, prompt, stream=stream) == reference[prompt], (prompt, stream)
        assert metric_total(httpx.get(f"{decoder}/metrics", timeout=10).text, HITS) > hits_before
        recent = httpx.get(f"{proxy}/stats", timeout=10).json()["recent"]
        assert len(recent) == 2 * len(PROMPTS) and {r["backend"] for r in recent} == {"vllm-nixl"}
    finally:
        code = stop(proc)
    assert code == 0, open(out).read()[-4000:]
    held = {p: ports.holders_of(p) for p in (base, base + 10, base + 30, base + 50, base + 51) if not ports.bindable(p)}
    assert not held, held  # nothing left listening (connections in TIME_WAIT do not count)
