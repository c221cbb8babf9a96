"""The prefiller's store gather (backend/send_gather.py) on a stand-in of LMCache's GPU connector.

The stand-in has the attributes and methods of LMCache's ``VLLMPagedMemGPUConnectorV2`` that the
pass uses, and a host-memory kernel with the semantics of LMCache's ``multi_layer_kv_transfer``
(D2H into a KV_2LTD chunk: ``chunk[kv, layer, i] = kv_cache[layer][kv] at slot_mapping[i]``). Pages
of a real ``SendArena`` play the VRAM chunks (``on_device``); the GPU pass runs LMCache's own kernel
both ways and compares the bytes (bench/store_gather.py).
"""

from __future__ import annotations

import inspect
import logging
import sys

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


# ---- the kernel is resolved for the installed LMCache, its signature checked at install time -----------


def test_with_the_installed_lmcache_nothing_is_installed_and_one_line_says_why(caplog):
    import lmcache
    from lmcache.v1.gpu_connector.gpu_connectors import VLLMPagedMemGPUConnectorV2

    if lmcache.__version__.startswith("0.5.3"):
        pytest.skip("LMCache 0.5.3 has the kernel the pass knows (the GPU test covers it)")
    original = VLLMPagedMemGPUConnectorV2.__dict__["batched_from_gpu"]
    with caplog.at_level(logging.INFO, logger="lmcache_p2p.backend.send_gather"):
        undo = send_gather.install()
    undo()
    assert VLLMPagedMemGPUConnectorV2.__dict__["batched_from_gpu"] is original
    assert not send_gather.installed() and not send_gather.gathers(object.__new__(VLLMPagedMemGPUConnectorV2))
    lines = [r for r in caplog.records if r.name == "lmcache_p2p.backend.send_gather"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "not installed" in lines[0].getMessage() and "multi_layer_kv_transfer" in lines[0].getMessage()


class TransferDirection:
    H2D, D2H = "H2D", "D2H"


def kernel_053(calls: list):
    """LMCache 0.5.3's ``lmcache.c_ops.multi_layer_kv_transfer`` as a compiled pybind11 function shows it: no
    Python signature, the signature line first in its docstring."""

    class Compiled:
        __name__ = "multi_layer_kv_transfer"
        __doc__ = ("multi_layer_kv_transfer(key_value: torch.Tensor, key_value_ptrs: torch.Tensor, slot_mapping: "
                   "torch.Tensor, paged_memory_device: torch.device, page_buffer_size: int, direction: "
                   "lmcache.c_ops.TransferDirection, engine_kv_format: lmcache.c_ops.EngineKVFormat, "
                   "block_size: int = 0, head_size: int = 0, skip_prefix_n_tokens: int = 0) -> None\n")
        @property
        def __signature__(self):
            raise ValueError("no signature found for builtin")  # what inspect says of a pybind11 function

        def __call__(self, *args, **kwargs) -> None:
            calls.append((args, kwargs))

    return Compiled()


def kernel_056(key_value, key_value_ptrs, slot_mapping, paged_memory_device, page_buffer_size, direction,
               engine_kv_format, block_size=0, head_size=0, skip_prefix_n_tokens=0, block_stride_elems=0) -> None:
    raise AssertionError("never called: its block stride would be left out")


@pytest.fixture
def connector_module(monkeypatch):
    """A module shaped like LMCache's gpu_connectors.py, its kernel reached as ``lmc_ops`` (0.5.3's name)."""
    import types

    def make(kernel) -> type:
        module = types.ModuleType("fake_lmcache_gpu_connectors")
        module.lmc_ops = types.SimpleNamespace(__name__="lmcache.c_ops", multi_layer_kv_transfer=kernel,
                                               TransferDirection=TransferDirection)
        monkeypatch.setitem(sys.modules, module.__name__, module)
        return type("VLLMPagedMemGPUConnectorV2", (FakeConnector,),
                    {"batched_from_gpu": FakeConnector.batched_from_gpu, "__module__": module.__name__})

    return make


def test_a_kernel_with_lmcache_053s_signature_is_installed_and_called_as_from_gpu_calls_it(connector_module, store):
    calls: list = []
    kernel = kernel_053(calls)
    with pytest.raises(ValueError):
        inspect.signature(kernel)
    assert send_gather.parameters_of(kernel) == send_gather.KERNEL_PARAMETERS
    cls = connector_module(kernel)
    undo = send_gather.install(cls, on_device=lambda tensor: True)
    try:
        assert send_gather.installed(cls) and send_gather.gathers(cls())
        connector = cls()
        connector.engine_kv_format, connector.page_buffer_size, connector.block_size, connector.head_size = (
            "NL_X_TWO_NB_BS_NH_HS", BLOCKS * BLOCK, BLOCK, HEAD)
        kvcaches, slot_mapping, arena = store
        objs, starts, ends = chunks_of(arena, spill_last=False)
        connector.batched_from_gpu(objs, starts, ends, kvcaches=kvcaches, slot_mapping=slot_mapping)
    finally:
        undo()
    assert not send_gather.installed(cls)
    assert len(calls) == 4
    args, kwargs = calls[-1]
    assert args[0].data_ptr() == objs[-1].tensor.data_ptr() and args[0].shape[2] == 5 and args[1] == "pointers" and torch.equal(args[2], slot_mapping[starts[-1]:])
    assert args[3:] == (kvcaches[0].device, BLOCKS * BLOCK, "D2H", "NL_X_TWO_NB_BS_NH_HS")
    assert kwargs == {"block_size": BLOCK, "head_size": HEAD}


@pytest.mark.parametrize("kernel", [kernel_056, lambda *args, **kwargs: None], ids=["block-stride", "untyped"])
def test_a_kernel_with_any_other_signature_is_not_installed(connector_module, kernel, caplog):
    cls = connector_module(kernel)
    with caplog.at_level(logging.INFO, logger="lmcache_p2p.backend.send_gather"):
        send_gather.install(cls)()
    assert not send_gather.installed(cls) and cls.__dict__["batched_from_gpu"] is FakeConnector.batched_from_gpu
    [line] = [r.getMessage() for r in caplog.records if r.name == "lmcache_p2p.backend.send_gather"]
    assert "not installed" in line and "lmcache.c_ops.multi_layer_kv_transfer takes (" in line
