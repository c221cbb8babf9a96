"""The prefiller's store gather (backend/send_gather.py) on a stand-in of LMCache's GPU connector.

The stand-in has the attributes and methods of LMCache's ``VLLMPagedMemGPUConnectorV2`` that the
pass uses, and a host-memory kernel with the semantics of LMCache's ``multi_layer_kv_transfer``
(D2H into a KV_2LTD chunk: ``chunk[kv, layer, i] = kv_cache[layer][kv] at slot_mapping[i]``). Pages
of a real ``SendArena`` play the VRAM chunks (``on_device``); the GPU pass runs LMCache's own kernel
both ways and compares the bytes (bench/store_gather.py).
"""

from __future__ import annotations

import logging

import pytest
import torch
from lmcache.v1.memory_management import MemoryFormat

from lmcache_p2p.backend import send_gather
from lmcache_p2p.backend.send_buffer import SendArena
from lmcache_p2p.config import P2PConfig
from lmcache_p2p.errors import ConfigError

LAYERS, BLOCKS, BLOCK, HEADS, HEAD = 3, 12, 4, 2, 8
CHUNK = 8
HD = HEADS * HEAD


def reference_gather(kvcaches: list[torch.Tensor], dst: torch.Tensor, slots: torch.Tensor) -> None:
    for layer, cache in enumerate(kvcaches):
        rows = cache.reshape(2, BLOCKS * BLOCK, HD)
        dst[:, layer] = rows[:, slots]


class FakeConnector:
    """LMCache's VLLMPagedMemGPUConnectorV2 as far as the store pass reads it."""

    use_mla = False
    store_stream = None

    def __init__(self) -> None:
        self.kvcaches = None
        self.view_derivations = 0
        self.from_gpu_calls = 0

    def initialize_kvcaches_ptr(self, **kwargs) -> None:
        self.view_derivations += 1
        self.kvcaches = list(kwargs["kvcaches"])

    def _initialize_pointers(self, kvcaches) -> str:
        return "pointers"

    def from_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        self.from_gpu_calls += 1
        self.initialize_kvcaches_ptr(**kwargs)
        reference_gather(self.kvcaches, memory_obj.tensor, kwargs["slot_mapping"][start:end])

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for obj, start, end in zip(memory_objs, starts, ends):
            self.from_gpu(obj, start, end, **kwargs)


def fresh_class() -> type:
    return type("Connector", (FakeConnector,), {"batched_from_gpu": FakeConnector.batched_from_gpu})


def host_kernel(calls: list[int]):
    def kernel(connector, dst, pointers, slots) -> None:
        assert pointers == "pointers"
        calls.append(len(slots))
        reference_gather(connector.kvcaches, dst, slots)

    return kernel


class HostChunk:
    def __init__(self, tokens: int) -> None:
        self.tensor = torch.zeros(2, LAYERS, tokens, HD, dtype=torch.bfloat16)


@pytest.fixture
def store():
    torch.manual_seed(3)
    kvcaches = [torch.randn(2, BLOCKS, BLOCK, HEADS, HEAD, dtype=torch.bfloat16) for _ in range(LAYERS)]
    slot_mapping = torch.randperm(BLOCKS * BLOCK)[:3 * CHUNK + 5]  # 3 full chunks and a partial one
    arena = SendArena(8 * 2 * LAYERS * CHUNK * HD * 2, "cpu", [torch.Size([2, LAYERS, CHUNK, HD])], [torch.bfloat16])
    return kvcaches, slot_mapping, arena


def chunks_of(arena: SendArena, spill_last: bool):
    sizes = [CHUNK, CHUNK, CHUNK, 5]
    objs = [arena.allocate([torch.Size([2, LAYERS, n, HD])], [torch.bfloat16], MemoryFormat.KV_2LTD) for n in sizes]
    if spill_last:
        objs[-1] = HostChunk(5)
    starts = [0, CHUNK, 2 * CHUNK, 3 * CHUNK]
    return objs, starts, [s + n for s, n in zip(starts, sizes)]


def in_arena(arena: SendArena):
    base, size = arena.buffer.data_ptr(), arena.buffer.numel()
    return lambda tensor: base <= tensor.data_ptr() < base + size


def test_a_store_gathers_every_arena_chunk_with_the_view_derived_once_and_equal_bytes(store):
    kvcaches, slot_mapping, arena = store
    objs, starts, ends = chunks_of(arena, spill_last=True)
    connector, calls = FakeConnector(), []
    send_gather.gather_store(connector, objs, starts, ends, {"kvcaches": kvcaches, "slot_mapping": slot_mapping},
                             host_kernel(calls), on_device=in_arena(arena))
    assert calls == [CHUNK, CHUNK, CHUNK]  # the arena chunks, one kernel each, their own slots
    assert connector.from_gpu_calls == 1  # the spilled host chunk: LMCache's own path
    assert connector.view_derivations == 2  # once for the store, once inside that from_gpu
    for obj, start, end in zip(objs, starts, ends):
        expected = torch.zeros_like(obj.tensor)
        reference_gather(kvcaches, expected, slot_mapping[start:end])
        assert torch.equal(obj.tensor, expected) and obj.tensor.abs().sum() > 0


def test_install_replaces_the_method_once_and_undo_restores_it(store, caplog):
    kvcaches, slot_mapping, arena = store
    cls = fresh_class()
    original = cls.__dict__["batched_from_gpu"]
    calls: list[int] = []
    with caplog.at_level(logging.INFO, logger="lmcache_p2p.backend.send_gather"):
        undo = send_gather.install(cls, host_kernel(calls), on_device=in_arena(arena))
    assert "gathers each store's VRAM chunks in one pass" in caplog.text
    send_gather.install(cls, host_kernel(calls))()  # a second install is a no-op, and so is its undo
    assert cls.__dict__["batched_from_gpu"] is not original
    objs, starts, ends = chunks_of(arena, spill_last=False)
    connector = cls()
    connector.batched_from_gpu(objs, starts, ends, kvcaches=kvcaches, slot_mapping=slot_mapping)
    assert calls == [CHUNK, CHUNK, CHUNK, 5] and connector.from_gpu_calls == 0 and connector.view_derivations == 1
    undo()
    assert cls.__dict__["batched_from_gpu"] is original
    connector = cls()
    connector.batched_from_gpu(objs, starts, ends, kvcaches=kvcaches, slot_mapping=slot_mapping)
    assert connector.from_gpu_calls == 4 and calls == [CHUNK, CHUNK, CHUNK, 5]


def test_mla_and_a_connector_without_the_methods_keep_lmcaches_path(store, caplog):
    kvcaches, slot_mapping, arena = store
    objs, starts, ends = chunks_of(arena, spill_last=False)
    connector, calls = FakeConnector(), []
    connector.use_mla = True
    send_gather.gather_store(connector, objs, starts, ends, {"kvcaches": kvcaches, "slot_mapping": slot_mapping},
                             host_kernel(calls), on_device=in_arena(arena))
    assert calls == [] and connector.from_gpu_calls == 4
    bare = type("Bare", (), {"batched_from_gpu": lambda self, *a, **k: None})
    with caplog.at_level(logging.WARNING, logger="lmcache_p2p.backend.send_gather"):
        send_gather.install(bare, host_kernel(calls))()
    assert "stores unchanged" in caplog.text and "from_gpu" in caplog.text


def test_batched_gather_is_on_by_default_and_must_be_a_bool():
    assert P2PConfig.from_mapping({"role": "sender"}).batched_gather is True
    assert P2PConfig.from_mapping({"role": "sender", "batched_gather": False}).batched_gather is False
    with pytest.raises(ConfigError, match=r"p2p\.batched_gather"):
        P2PConfig.from_mapping({"role": "sender", "batched_gather": "no"})
