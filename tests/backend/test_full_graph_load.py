"""LMCache's KV load on a step vLLM replays as a FULL CUDA graph (backend/full_graph_load.py).

vLLM's V2 model runner calls the connector's ``start_load_kv`` before it replays a FULL CUDA graph outside the
step's forward context, so the context it passes has no attention metadata, and LMCache's adapter then returns
without loading: the decoder computes from KV blocks that were never written. These tests run LMCache's real
``LMCacheConnectorV1Impl.start_load_kv`` on an adapter that holds only what it reads, with an engine whose
retrieve writes each token's KV (its token id) into the KV cache at the request's slots, and check which slots
hold the prompt's KV after the call.
"""

from __future__ import annotations

import logging
import sys
from types import SimpleNamespace

import pytest
import torch

from lmcache_p2p.backend import full_graph_load
from lmcache_p2p.backend.full_graph_load import NO_ATTENTION_METADATA, LoadContext

SLOTS = 64
EMPTY = -1.0  # what a KV block holds before anything wrote it


class WritingEngine:
    """LMCache's engine as far as a blocking retrieve goes: each token's KV is its id, written at its slot."""

    def __init__(self) -> None:
        self.retrieved: list[str] = []

    def retrieve(self, tokens, mask, kvcaches, slot_mapping, vllm_cached_tokens, request_configs=None,
                 req_id=None, **_):
        for cache in kvcaches:
            cache[slot_mapping[mask]] = torch.tensor(tokens, dtype=cache.dtype)[mask]
        self.retrieved.append(req_id)
        return mask.clone()

    def lookup_unpin(self, req_id) -> None:
        return None


def load_request(req_id: str, tokens: list[int], slots: list[int], can_load: bool = True):
    spec = SimpleNamespace(can_load=can_load, vllm_cached_tokens=0, lmcache_cached_tokens=len(tokens))
    return SimpleNamespace(req_id=req_id, token_ids=tokens, slot_mapping=torch.tensor(slots), load_spec=spec,
                           request_configs=None)


def adapter(requests, async_loading: bool = False):
    """The real LMCacheConnectorV1Impl, with only what start_load_kv reads."""
    from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorMetadata, LMCacheConnectorV1Impl

    metadata = object.__new__(LMCacheConnectorMetadata)  # checked with isinstance; its requests are all it reads
    metadata.__dict__["requests"] = requests
    impl = object.__new__(LMCacheConnectorV1Impl)
    impl.__dict__.update(
        kv_caches={"layer.0": torch.full((SLOTS,), EMPTY), "layer.1": torch.full((SLOTS,), EMPTY)},
        _parent=SimpleNamespace(_get_connector_metadata=lambda: metadata),
        _manager=SimpleNamespace(lmcache_engine=WritingEngine()),  # LMCache's lmcache_engine property reads it
        device="cpu", _lmcache_chunk_size=256, use_layerwise=False, enable_blending=False,
        async_loading=async_loading, _invalid_block_ids=set(), layerwise_retrievers=[],
        _stats_monitor=SimpleNamespace(update_interval_vllm_hit_tokens=lambda n: None,
                                       update_interval_prompt_tokens=lambda n: None))
    return impl


def full_graph_context():
    """What vLLM's V2 model runner hands start_load_kv before a FULL graph replay: a forward context made outside
    the step's, without attention metadata."""
    return SimpleNamespace(attn_metadata=None, no_compile_layers={}, virtual_engine=0)


def kv_at(impl, slots: list[int]) -> list[list[float]]:
    return [cache[slots].tolist() for cache in impl.kv_caches.values()]


@pytest.fixture
def installed():
    import lmcache.integration.vllm.vllm_v1_adapter  # noqa: F401 (a vLLM worker's connector loaded it)

    undo = full_graph_load.install()
    yield
    undo()


def test_a_full_graph_step_loads_the_promised_kv_into_its_slots(installed, caplog):
    tokens, slots = [11, 12, 13, 14, 15], [40, 41, 42, 8, 9]
    impl = adapter([load_request("req-a", tokens, slots), load_request("req-b", [7, 8], [20, 21])])
    with caplog.at_level(logging.INFO, logger=full_graph_load.__name__):
        impl.start_load_kv(full_graph_context())
        impl.start_load_kv(full_graph_context())
    assert kv_at(impl, slots) == [[11.0, 12.0, 13.0, 14.0, 15.0]] * 2
    assert kv_at(impl, [20, 21]) == [[7.0, 8.0]] * 2
    assert impl.lmcache_engine.retrieved == ["req-a", "req-b"] * 2
    noted = [r.getMessage() for r in caplog.records if "loads the KV of" in r.getMessage()]
    assert noted == ["lmcache_p2p: a step with no attention metadata (vLLM's V2 model runner before a FULL CUDA "
                     "graph) loads the KV of 2 request(s) that LMCache alone would skip"]  # once per adapter


def test_vllm_s_own_context_without_attention_metadata_loads_too(installed):
    """The context vLLM's V2 model runner really makes there (``set_forward_context(None, vllm_config)``)."""
    from vllm.config import VllmConfig
    from vllm.forward_context import get_forward_context, set_forward_context

    impl = adapter([load_request("req-a", [3, 4, 5], [1, 2, 3])])
    with set_forward_context(None, VllmConfig()):
        context = get_forward_context()
        assert context.attn_metadata is None
        impl.start_load_kv(context)
    assert kv_at(impl, [1, 2, 3]) == [[3.0, 4.0, 5.0]] * 2


def test_other_calls_are_lmcache_s_own(installed):
    """With attention metadata LMCache loads as it would by itself; with none, a step that promised no load and
    LMCache's async loading are left to it (it skips)."""
    with_metadata = SimpleNamespace(attn_metadata=object(), no_compile_layers={}, virtual_engine=0)
    impl = adapter([load_request("req-a", [1, 2], [5, 6])])
    assert full_graph_load.needs_context(impl, with_metadata) == 0
    impl.start_load_kv(with_metadata)
    assert kv_at(impl, [5, 6]) == [[1.0, 2.0]] * 2
    for impl in (adapter([load_request("req-a", [1, 2], [5, 6], can_load=False)]),
                 adapter([load_request("req-a", [1, 2], [5, 6])], async_loading=True)):
        assert full_graph_load.needs_context(impl, full_graph_context()) == 0
        impl.start_load_kv(full_graph_context())
        assert kv_at(impl, [5, 6]) == [[EMPTY, EMPTY]] * 2 and impl.lmcache_engine.retrieved == []


def test_the_load_context_is_the_forward_context_but_for_its_marker():
    context = SimpleNamespace(attn_metadata=None, no_compile_layers={"l": 1}, virtual_engine=3)
    wrapped = LoadContext(context)
    assert wrapped.attn_metadata is NO_ATTENTION_METADATA and wrapped.no_compile_layers == {"l": 1}
    assert wrapped.virtual_engine == 3
    with pytest.raises(AttributeError):
        NO_ATTENTION_METADATA.query_start_loc  # used beyond "exists": loud, not made up


def test_without_lmcache_s_adapter_loaded_nothing_is_imported_or_installed(monkeypatch):
    from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl

    before = LMCacheConnectorV1Impl.__dict__["start_load_kv"]
    monkeypatch.delitem(sys.modules, full_graph_load.ADAPTER_MODULE)
    full_graph_load.install()()
    assert full_graph_load.ADAPTER_MODULE not in sys.modules
    assert LMCacheConnectorV1Impl.__dict__["start_load_kv"] is before


def test_install_is_once_and_undo_restores_lmcache_s_method():
    from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl

    before = LMCacheConnectorV1Impl.__dict__["start_load_kv"]
    undo = full_graph_load.install()
    try:
        wrapped = LMCacheConnectorV1Impl.__dict__["start_load_kv"]
        assert wrapped is not before and wrapped.__wrapped__ is before
        full_graph_load.install()()  # a second install is a no-op, and so is its undo
        assert LMCacheConnectorV1Impl.__dict__["start_load_kv"] is wrapped
    finally:
        undo()
    assert LMCacheConnectorV1Impl.__dict__["start_load_kv"] is before
    impl = adapter([load_request("req-a", [1, 2], [5, 6])])
    impl.start_load_kv(full_graph_context())  # LMCache alone: the promised KV is not loaded
    assert kv_at(impl, [5, 6]) == [[EMPTY, EMPTY]] * 2


def test_each_backend_installs_it_and_undoes_it_when_closed(monkeypatch):
    """A sender that fails to start (a VRAM buffer on a CPU worker) installed it first and undid it on close."""
    from lmcache.v1.config import LMCacheEngineConfig

    from lmcache_p2p.backend import plugin_base
    from lmcache_p2p.backend.sender import SenderBackend
    from lmcache_p2p.errors import ConfigError
    from test_send_buffer import TOKENS, host_backend

    calls: list[str] = []
    monkeypatch.setattr(plugin_base, "install_full_graph_load",
                        lambda: calls.append("install") or (lambda: calls.append("undo")))
    config = LMCacheEngineConfig.from_defaults(chunk_size=TOKENS, local_cpu=False, max_local_cpu_size=0.01,
                                               save_unfull_chunk=True, extra_config={
                                                   "p2p": {"role": "sender", "transport": "nccl",
                                                           "buffer_device": "cuda", "buffer_size": "1MB"}})
    with pytest.raises(ConfigError):
        SenderBackend(config=config, dst_device="cpu", local_cpu_backend=host_backend())
    assert calls == ["install", "undo"]
