"""The proxy's tokenizer provider: a slow first load never stalls requests."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest

from lmcache_p2p.proxy.http import tokenizer as tok

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
    provider = tok.TokenizerProvider(str(path), None, timeout_s=1.0)
    assert await provider.get([], wait_s=0.05) is None  # still loading: the request goes without
    assert not provider.settled
    slow_load.set()
    loaded = await provider.get([], wait_s=None)
    assert loaded is not None and provider.settled
    assert await provider.get([], wait_s=0) is loaded  # settled: answered at once


async def test_background_load_settles_before_any_request(tokenizer_dir):
    path, _ = tokenizer_dir
    provider = tok.TokenizerProvider(str(path), None, timeout_s=1.0)
    task = asyncio.get_running_loop().create_task(provider.load_in_background(list, retry_s=0.01))
    await asyncio.wait_for(task, 60)
    assert provider.settled and await provider.get([], wait_s=0) is not None


async def test_the_heap_is_frozen_once_the_tokenizer_is_loaded(tokenizer_dir):
    """transformers' objects are left out of full collections (each walked them all: ~185 ms stalls)."""
    path, _ = tokenizer_dir
    gc.unfreeze()
    try:
        provider = tok.TokenizerProvider(str(path), None, timeout_s=1.0)
        assert gc.get_freeze_count() == 0
        assert await provider.get([], wait_s=None) is not None
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
