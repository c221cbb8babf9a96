"""``lmcache-p2p launch --connector nixl`` for real: one command starts a vLLM-CPU prefiller and decoder running
vLLM's own NixlConnector and, in front of them, our proxy or vllm-router (``--router vllm-router``: vLLM's own
PD stack); and ``--connector nixl-push`` (NixlPushConnector) behind our proxy, where only our guarantees are
asserted (every request served as one instance would, none hangs), not that the push connector pushed.

The launcher runs as a user runs it (its own process, Ctrl-C = SIGTERM). Greedy completions through the front,
plain and streamed, equal the decoder's own answers to the same prompts sent straight to it (one instance, the
same flags, no ``kv_transfer_params``); the decoder pulled the prompts' KV from the prefiller (vLLM's external
prefix cache hits on its /metrics); behind our proxy every request went the ``vllm-nixl`` way; SIGTERM stops
everything.
No prefix caching, so that the decoder's own answers are computed before the pulls and never reused by them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lmcache_p2p.cli import ports
from lmcache_p2p.cli.demo import metric_total
from test_nixl_backend_vllm import PROMPTS, chat_text, complete  # tests/e2e is on sys.path
from vllm_server import free_cluster_base_port

# Two vLLM servers for ~2 min per test: in `make test-long`.
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


@contextlib.contextmanager
def launched(connector: str, router: str, tiny_model_dir, tmp_path) -> Iterator[tuple[str, str, str]]:
    """``launch --connector CONNECTOR --router ROUTER`` 1P1D: (the front's URL, the decoder's, the model's name);
    on exit SIGTERM, which stops everything (exit 0, nothing left listening)."""
    # tp_size=2 claims base+50 and base+51: the two instances' NIXL handshake ports (--kv-port + slot)
    base = free_cluster_base_port(prefill=1, decode=1, tp_size=2)
    proc, out = launch_1p1d(base, tiny_model_dir, tmp_path, "--connector", connector, "--router", router)
    try:
        wait_serving(proc, out, SERVING_TIMEOUT_S)
        # one decoder: the same port whatever the router; the launcher serves the model under its resolved path
        yield f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 30}", str(tiny_model_dir.resolve())
    finally:
        code = stop(proc)
    assert code == 0, open(out).read()[-4000:]
    held = {p: ports.holders_of(p) for p in (base, base + 10, base + 30, base + 50, base + 51) if not ports.bindable(p)}
    assert not held, held  # nothing left listening (connections in TIME_WAIT do not count)


@pytest.mark.parametrize("router", ["lmcache_p2p", "vllm-router"])
def test_one_command_serves_vllm_nixl_instances_with_one_instances_outputs(router, tiny_model_dir, tmp_path):
    with launched("nixl", router, tiny_model_dir, tmp_path) as (front, decoder, model):
        reference = {p: complete(decoder, model, p) for p in PROMPTS}
        hits_before = metric_total(httpx.get(f"{decoder}/metrics", timeout=10).text, HITS)
        for prompt in PROMPTS:
            for stream in (False, True):
                assert complete(front, model, prompt, stream=stream) == reference[prompt], (prompt, stream)
        assert metric_total(httpx.get(f"{decoder}/metrics", timeout=10).text, HITS) > hits_before
        if router == "lmcache_p2p":  # vllm-router keeps no request timeline
            recent = httpx.get(f"{front}/stats", timeout=10).json()["recent"]
            assert len(recent) == 2 * len(PROMPTS) and {r["backend"] for r in recent} == {"vllm-nixl"}


def test_our_proxy_in_front_of_the_push_connector_serves_every_request_as_one_instance(tiny_model_dir, tmp_path):
    """NixlPushConnector on vLLM-CPU sometimes never pushes (the prefiller releases the blocks unread after its
    lease): this asserts what our proxy guarantees, not the push's success. Every request, plain, streamed and
    chat, ends with the decoder's own answer within the client's deadline (pushed, or moved after --kv-timeout-s),
    and went the ``vllm-nixl`` way."""
    with launched("nixl-push", "lmcache_p2p", tiny_model_dir, tmp_path) as (proxy, decoder, model):
        reference = {p: complete(decoder, model, p) for p in PROMPTS}
        chat_reference = chat_text(decoder, model)
        for prompt in PROMPTS:
            for stream in (False, True):
                assert complete(proxy, model, prompt, stream=stream) == reference[prompt], (prompt, stream)
        assert chat_text(proxy, model) == chat_reference
        assert chat_text(proxy, model) == chat_reference
        recent = httpx.get(f"{proxy}/stats", timeout=10).json()["recent"]
        assert len(recent) == 2 * len(PROMPTS) + 2 and {r["backend"] for r in recent} == {"vllm-nixl"}
    # the completions taught the proxy that the prefiller pushes: each chat prefill went as a completion of its
    # ids, never as a chat whose KV can never pair with its decode
    proxy_log = "\n".join(p.read_text(errors="replace") for p in (tmp_path / "logs").glob("proxy*.log"))
    assert "is serving" in open(tmp_path / "launch.out").read() and proxy_log
    assert "can never be pushed" not in proxy_log
