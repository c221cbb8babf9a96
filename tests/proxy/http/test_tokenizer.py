"""The proxy's tokenizer provider: a slow first load never stalls requests."""

from __future__ import annotations

import asyncio
import gc
import sys
import threading

import pytest

from lmcache_p2p.proxy.http import tokenizer as tok

from .test_detokenize import random_dataset_prompt

pytestmark = pytest.mark.anyio


@pytest.fixture
def slow_load(monkeypatch):
    """``load_tokenizer`` blocks until the test releases it; returns the release event."""
    release = threading.Event()
    real = tok.load_tokenizer

    def load(path: str):
        assert release.wait(30), "the test never released the load"
        return real(path)

    monkeypatch.setattr(tok, "load_tokenizer", load)
    return release


async def test_a_request_does_not_wait_past_its_bound_for_a_slow_first_load(slow_load, tokenizer_dir):
    path, _ = tokenizer_dir
    provider = tok.TokenizerProvider(str(path), None, timeout_s=1.0, load_timeout_s=60.0)
    assert await provider.get([], wait_s=0.05) is None  # still loading: the request goes without
    assert not provider.settled
    slow_load.set()
    loaded = await provider.get([], wait_s=None)
    assert loaded is not None and provider.settled
    assert await provider.get([], wait_s=0) is loaded  # settled: answered at once


async def test_background_load_settles_before_any_request(tokenizer_dir):
    path, _ = tokenizer_dir
    provider = tok.TokenizerProvider(str(path), None, timeout_s=1.0, load_timeout_s=60.0)
    task = asyncio.get_running_loop().create_task(provider.load_in_background(list, retry_s=0.01))
    await asyncio.wait_for(task, 60)
    assert provider.settled and await provider.get([], wait_s=0) is not None


async def test_the_heap_is_frozen_once_the_tokenizer_is_loaded(tokenizer_dir):
    """transformers' objects are left out of full collections (each walked them all: ~185 ms stalls)."""
    path, _ = tokenizer_dir
    gc.unfreeze()
    try:
        provider = tok.TokenizerProvider(str(path), None, timeout_s=1.0, load_timeout_s=60.0)
        assert gc.get_freeze_count() == 0
        assert await provider.get([], wait_s=None) is not None
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("truncating_backend", [False, True])
def test_prompt_ids_are_the_ids_vllm_makes(tokenizer_dir, truncating_backend):
    """The ids the prefiller gets in place of the text: ``hf.encode``'s (what vLLM's API server calls), with
    and without special tokens, for long prompts cut mid-character, markup and special tokens' text; a
    backend that truncates on its own is not used alone."""
    _, hf = tokenizer_dir
    if truncating_backend:
        hf = type(hf).from_pretrained(tokenizer_dir[0])
        hf._tokenizer.enable_truncation(max_length=16)
    proxy = tok.ProxyTokenizer(hf, "test")
    assert proxy._fast_encode is not truncating_backend
    special = hf.all_special_tokens[0]
    prompts = [hf.decode(random_dataset_prompt(hf, seed, 3000)[:3000]) for seed in range(3)]  # cut as vllm bench
    prompts += [f"{special} Hello,\n\n  world <b>x</b> {special}", "", " ", "ünïcödé 中文 ½\t12 345.6"]
    for prompt in prompts:
        for add in (True, False):
            expected = hf.encode(prompt, add_special_tokens=add, truncation=False)
            assert proxy.text_prompt_ids({"prompt": prompt, "add_special_tokens": add}) == expected


async def test_an_import_of_transformers_that_does_not_end_is_waited_for_at_most_the_load_timeout(tokenizer_dir,
                                                                                                    caplog):
    path, _ = tokenizer_dir
    provider = tok.TokenizerProvider(str(path), None, timeout_s=1.0, load_timeout_s=0.2)
    provider._prefetch = asyncio.get_running_loop().create_future()  # the prefetching import hangs
    assert await asyncio.wait_for(provider.get([], wait_s=None), 10) is None
    assert "raise --tokenizer-load-timeout-s" in caplog.text
    assert not provider.settled  # the load gave up its place: a later request tries again
    provider._prefetch.set_result(None)
    assert await provider.get([], wait_s=None) is not None and provider.settled


@pytest.fixture
def slow_library(tmp_path, monkeypatch):
    """The tokenizer library is a module whose import takes 0.5 s; yields its name."""
    name = "slow_tokenizer_library_for_test"
    (tmp_path / f"{name}.py").write_text("import time\ntime.sleep(0.5)\n\n\nclass AutoTokenizer:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(tok, "TOKENIZER_MODULE", name)
    yield name
    sys.modules.pop(name, None)


async def test_the_proxy_imports_the_tokenizer_library_before_it_serves(slow_library):
    # the real import (torch's C extensions) holds the GIL for seconds, many times that on a loaded machine: run
    # beside the serving event loop it stalls every request, /health, /instances and the control socket
    from lmcache_p2p.proxy.server import Proxy
    from lmcache_p2p.proxy.settings import ProxySettings

    proxy = Proxy(ProxySettings(port=0, control_port=0, summary_interval_s=0))
    try:
        await proxy.start()
        assert slow_library in sys.modules  # imported before anything of the proxy runs
    finally:
        await proxy.close()


async def test_a_relay_worker_imports_the_tokenizer_library_before_it_listens(slow_library, monkeypatch):
    from lmcache_p2p.proxy.relay import worker

    class Listening(Exception):
        pass

    imported_when_bound = []

    def bind_http(*args, **kwargs):
        imported_when_bound.append(slow_library in sys.modules)
        raise Listening

    monkeypatch.setattr(worker, "bind_http", bind_http)
    args = worker.parse_args(["--host", "127.0.0.1", "--port", "1", "--uds", "/nonexistent", "--index", "0",
                              "--chars-per-token", "4", "--connect-timeout-s", "1", "--coordinator-timeout-s", "1",
                              "--graceful-shutdown-s", "1", "--tokenizer", "auto", "--tokenizer-load-timeout-s", "30"])
    with pytest.raises(Listening):
        await worker.serve(args)
    assert imported_when_bound == [True]
