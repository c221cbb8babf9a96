"""The proxy process loads its tokenizer (found with bench/proxy_relay.py: it never did with --tokenizer DIR), and a
relay worker waits for its own load of it at most --tokenizer-load-timeout-s.

``TokenizerProvider.prefetch`` imports ``transformers`` in one thread while ``_load`` imported it
in another: the second saw a half-initialized module ("cannot import name 'AutoTokenizer'") and
the proxy ran without a tokenizer (estimated counts, text from the instances). Run in a fresh
interpreter, where ``transformers`` is not imported yet (this test process has it imported).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import httpx
import pytest

from lmcache_p2p.proxy.errors import ProxyError
from lmcache_p2p.proxy.http import tokenizer as http_tokenizer
from lmcache_p2p.proxy.relay import tokenizers as relay_tokenizers
from lmcache_p2p.proxy.relay import workers as relay_workers
from lmcache_p2p.proxy.relay.link import CoordinatorLink
from lmcache_p2p.proxy.relay.worker import WorkerApp
from lmcache_p2p.proxy.upstream import Upstream

from ..conftest import eventually, make_cluster
from ..fakes import MODEL, PROMPT, expected_text, tokenize
from ..router.test_routing import assert_idle

pytestmark = pytest.mark.timeout(300)

_CHILD = """
import asyncio, logging, sys
logging.basicConfig(level=logging.WARNING)
from lmcache_p2p.proxy.http.tokenizer import TokenizerProvider

async def main():
    provider = TokenizerProvider(sys.argv[1], None, 1.0, load_timeout_s=240.0)
    await asyncio.wait_for(provider.load_in_background(lambda: []), 240)
    tokenizer = await provider.get([])
    print("LOADED" if tokenizer is not None else "NONE")

asyncio.run(main())
"""


def test_a_tokenizer_folder_loads_in_a_fresh_proxy_process(tokenizer_dir):
    path, _ = tokenizer_dir
    done = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, timeout=280)
    assert done.stdout.strip().splitlines()[-1:] == ["LOADED"], done.stderr[-2000:]


# ---- a relay worker's wait for its load of the tokenizer ----------------------------------------------


@pytest.fixture
async def hung_load(monkeypatch):
    """A relay worker's ``load_tokenizer`` that does not return until the test ends (released by an async
    fixture's teardown, which runs on the test's event loop before it closes: the loop's executor waits for
    its threads)."""
    release = threading.Event()

    def load(path: str):
        release.wait(60)
        raise RuntimeError("released")

    monkeypatch.setattr(relay_tokenizers, "load_tokenizer", load)
    yield
    release.set()


@pytest.mark.anyio
async def test_a_relay_worker_waits_for_its_tokenizer_at_most_the_load_timeout(hung_load):
    tokenizers = relay_tokenizers.Tokenizers(load_timeout_s=0.2)
    with pytest.raises(ProxyError, match="within 0.2 s: raise --tokenizer-load-timeout-s") as raised:
        await asyncio.wait_for(tokenizers.get("/models/tiny"), 10)
    assert raised.value.status_code == 503


@pytest.mark.anyio
async def test_a_request_whose_worker_cannot_load_the_tokenizer_in_time_frees_what_the_coordinator_took(
        hung_load, tokenizer_dir):
    path, _ = tokenizer_dir
    async with make_cluster(workers=2, tokenizer=str(path)) as c:
        await eventually(lambda: c.proxy.orchestrator.tokenizers.loaded_source is not None, timeout_s=60)
        uds = os.path.join(c.proxy._relay_dir, "coordinator.sock")
        link = CoordinatorLink(uds, 7, 10.0, relay_tokenizers.Tokenizers(load_timeout_s=0.2))  # beside the two
        upstream = Upstream(connect_timeout_s=2.0)
        app = WorkerApp(link, upstream, chars_per_token=4.0).build()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
                resp = await asyncio.wait_for(client.post("/v1/completions", json={
                    "model": MODEL, "prompt": PROMPT, "max_tokens": 6}), 20)
        finally:
            await link.aclose()
            await upstream.aclose()
        assert resp.status_code == 503 and "--tokenizer-load-timeout-s" in resp.json()["error"]["message"]
        await eventually(lambda: len(c.proxy.coordinator) == 0)  # closed there: its lease and KV waiter freed
        await eventually(lambda: len(c.proxy.waiters) == 0)
        assert_idle(c)


# ---- a relay worker's start ---------------------------------------------------------------------------


@pytest.fixture
def slow_worker_import(tmp_path, monkeypatch):
    """Relay workers started from now on import a tokenizer library that takes 4 s (their ``transformers``, first on
    their PYTHONPATH); this process imports a quick one of its own."""
    slow = tmp_path / "slow"
    auto = slow / "transformers" / "models" / "auto"
    auto.mkdir(parents=True)
    for package in (slow / "transformers", slow / "transformers" / "models", auto):
        (package / "__init__.py").write_text("")
    (auto / "tokenization_auto.py").write_text("import time\ntime.sleep(4)\n\n\nclass AutoTokenizer:\n    pass\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(slow), os.environ.get("PYTHONPATH")) if p))
    name = "quick_tokenizer_library_for_test"
    (tmp_path / f"{name}.py").write_text("class AutoTokenizer:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(http_tokenizer, "TOKENIZER_MODULE", name)
    yield
    sys.modules.pop(name, None)


@pytest.mark.anyio
async def test_a_relay_worker_is_given_its_tokenizer_imports_wait_to_start(slow_worker_import, monkeypatch):
    """A worker imports the tokenizer library before it serves, for up to --tokenizer-load-timeout-s (the import
    takes seconds, many more on a loaded machine): the pool waits for its hello that much longer than for a start
    without one, rather than stopping the proxy as if the worker never started."""
    monkeypatch.setattr(relay_workers, "WORKER_START_TIMEOUT_S", 3.0)  # shorter than the import: the base alone fails
    async with make_cluster(workers=2, tokenizer="auto", tokenizer_load_timeout_s=60.0) as c:
        assert len(c.proxy.workers.pids) == 2
        resp = await c.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        assert resp.json()["choices"][0]["text"] == expected_text(tokenize(PROMPT), 4)
