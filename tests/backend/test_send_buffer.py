"""The sender's chunk arena lent to LMCache's real LocalCPUBackend (backend/send_buffer.py).

On this machine the arena lives in host memory (the code path is the same on a GPU: a
``torch.empty`` on the worker's device and LMCache's paged allocator over it); the GPU pass
runs the VRAM form end to end (tests/backend/test_engine_gpu.py, sender_device cuda).
"""

from __future__ import annotations

import pytest
import torch
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_allocators.paged_tensor_memory_allocator import PagedTensorMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

from lmcache_p2p.backend.send_buffer import SendArena, lend
from lmcache_p2p.errors import ConfigError

LAYERS, TOKENS, HIDDEN = 2, 16, 8
FULL = [torch.Size([2, LAYERS, TOKENS, HIDDEN])]
DTYPES = [torch.bfloat16]
PAGE = 2 * LAYERS * TOKENS * HIDDEN * 2


def shape_of(tokens: int) -> list[torch.Size]:
    return [torch.Size([2, LAYERS, tokens, HIDDEN])]


def host_backend(local_cpu: bool = False, host_pages: int = 4) -> LocalCPUBackend:
    config = LMCacheEngineConfig.from_defaults(chunk_size=TOKENS, local_cpu=local_cpu, max_local_cpu_size=0.01)
    host = PagedTensorMemoryAllocator(torch.empty(host_pages * PAGE, dtype=torch.uint8), FULL, DTYPES)
    return LocalCPUBackend(config, memory_allocator=host)


def inside(obj, buffer: torch.Tensor) -> bool:
    start = buffer.data_ptr()
    return start <= obj.tensor.data_ptr() < start + buffer.numel()


@pytest.fixture
def arena() -> SendArena:
    return SendArena(3 * PAGE + 100, "cpu", FULL, DTYPES)  # 3 pages; the 100 spare bytes are not used


def test_arena_pages_and_a_too_small_size_names_the_key():
    with pytest.raises(ConfigError, match=r"p2p\.buffer_size.*less than one chunk"):
        SendArena(PAGE - 1, "cpu", FULL, DTYPES)
    arena = SendArena(3 * PAGE + 100, "cpu", FULL, DTYPES)
    assert (arena.pages, arena.page_bytes, arena.buffer.numel()) == (3, PAGE, 3 * PAGE)


def test_lent_backend_allocates_from_the_arena_then_spills_to_host_and_frees_back(arena):
    backend = host_backend()
    host_buffer = backend.memory_allocator.buffer
    lend(backend, arena)
    objs = [backend.allocate(shape_of(TOKENS), DTYPES, MemoryFormat.KV_2LTD) for _ in range(3)]
    assert all(inside(obj, arena.buffer) for obj in objs)
    assert len({obj.tensor.data_ptr() for obj in objs}) == 3 and arena.free_pages() == 0
    spilled = backend.allocate(shape_of(TOKENS), DTYPES, MemoryFormat.KV_2LTD)
    assert spilled is not None and inside(spilled, host_buffer) and arena.spilled == 1
    objs[1].ref_count_down()  # the sender's reference after the write: the page goes back to the arena
    assert arena.free_pages() == 1
    again = backend.allocate(shape_of(TOKENS), DTYPES, MemoryFormat.KV_2LTD)
    assert inside(again, arena.buffer) and again.tensor.data_ptr() == objs[1].tensor.data_ptr()


def test_partial_chunk_takes_one_page_and_returns_it_whole(arena):
    backend = host_backend()
    lend(backend, arena)
    part = backend.allocate(shape_of(5), DTYPES, MemoryFormat.KV_2LTD)
    assert tuple(part.tensor.shape) == (2, LAYERS, 5, HIDDEN) and inside(part, arena.buffer)
    part.tensor.fill_(1)
    part.ref_count_down()
    assert arena.free_pages() == 3
    whole = [backend.allocate(shape_of(TOKENS), DTYPES, MemoryFormat.KV_2LTD) for _ in range(3)]
    assert all(tuple(o.tensor.shape) == (2, LAYERS, TOKENS, HIDDEN) and inside(o, arena.buffer) for o in whole)


def test_batched_allocate_is_all_or_nothing_in_the_arena(arena):
    backend = host_backend(host_pages=8)
    lend(backend, arena)
    first = backend.batched_allocate(shape_of(TOKENS), DTYPES, 2, MemoryFormat.KV_2LTD)
    assert len(first) == 2 and all(inside(o, arena.buffer) for o in first)
    second = backend.batched_allocate(shape_of(TOKENS), DTYPES, 2, MemoryFormat.KV_2LTD)  # 1 page left: host
    assert len(second) == 2 and not any(inside(o, arena.buffer) for o in second)
    assert arena.free_pages() == 1 and arena.spilled == 2


def test_lend_refuses_a_backend_that_caches_and_undo_restores_host_allocation(arena):
    with pytest.raises(ConfigError, match=r"local_cpu.*must be false"):
        lend(host_backend(local_cpu=True), arena)
    backend = host_backend()
    undo = lend(backend, arena)
    with pytest.raises(RuntimeError, match="already"):
        lend(backend, arena)
    undo()
    obj = backend.allocate(shape_of(TOKENS), DTYPES, MemoryFormat.KV_2LTD)
    assert inside(obj, backend.memory_allocator.buffer) and arena.free_pages() == 3


def test_a_sender_asking_for_a_vram_buffer_without_a_gpu_names_the_key(tmp_path):
    from lmcache_p2p.backend.sender import SenderBackend

    config = LMCacheEngineConfig.from_defaults(chunk_size=TOKENS, local_cpu=False, max_local_cpu_size=0.01,
                                               save_unfull_chunk=True, extra_config={
                                                   "p2p": {"role": "sender", "transport": "nccl",
                                                           "buffer_device": "cuda", "buffer_size": "1MB"}})
    with pytest.raises(ConfigError, match=r"p2p\.buffer_device.*worker runs on the CPU"):
        SenderBackend(config=config, dst_device="cpu", local_cpu_backend=host_backend())


class _Submits:
    """Stands in for SendService: records each submitted batch."""

    def __init__(self) -> None:
        self.batches: list[tuple[list, bool]] = []

    def submit(self, req_id, target, chunks, last, called_s=0.0, wire_id="", queued_s=0.0, ready=None) -> None:
        self.batches.append((chunks, last))


def test_a_store_whose_chunks_are_partly_spilled_is_submitted_as_one_batch_per_device():
    """With the arena full midway through a store (LMCache 0.5.3 allocates chunk by chunk), some of
    its chunks are on the GPU and the rest in host memory; one write moves sources of one device
    (NIXL refuses a mix: "the sources of one write must be ... on one device", failing the request),
    so the sender hands them over as consecutive batches, in order, ``last`` on the final one."""
    from types import SimpleNamespace

    from lmcache.utils import CacheEngineKey

    from lmcache_p2p.backend.sender import SenderBackend

    backend = object.__new__(SenderBackend)
    backend._service, backend._arena, backend._tp_rank, backend._warned_no_spec = _Submits(), None, 0, False
    backend._layout, backend._watch = None, None  # equal TP: rank r sends to rank r; handed over at once
    host = PagedTensorMemoryAllocator(torch.empty(4 * PAGE, dtype=torch.uint8), FULL, DTYPES)
    other = PagedTensorMemoryAllocator(torch.empty(4 * PAGE, dtype=torch.uint8, device="meta"), FULL, DTYPES)
    objs = [other.allocate(FULL, DTYPES), other.allocate(FULL, DTYPES), host.allocate(FULL, DTYPES),
            other.allocate(FULL, DTYPES)]
    keys = [CacheEngineKey(model_name="m", world_size=1, worker_id=0, chunk_hash=i + 1, dtype=torch.bfloat16)
            for i in range(4)]
    spec = SimpleNamespace(receiver_host="127.0.0.1", receiver_alloc_port=[7300], req_id="req-1",
                           is_last_prefill=True)
    backend.batched_submit_put_task(keys, objs, transfer_spec=spec)
    batches = backend._service.batches
    assert [[c.key for c in chunks] for chunks, _ in batches] == [["1", "2"], ["3"], ["4"]]
    assert all(len({c.tensor.device for c in chunks}) == 1 for chunks, _ in batches)
    assert [last for _, last in batches] == [False, False, True]


def test_a_partial_chunk_in_an_arena_page_names_its_own_bytes_not_the_page(arena):
    """LMCache's paged allocator keeps a page object's size from its first (full) shape: get_size()
    of a partial last chunk is the whole page. The Alloc must name the bytes the write moves (the
    receiver counts them, and compares shapes before reusing a cached chunk of the same key)."""
    from types import SimpleNamespace

    from lmcache.utils import CacheEngineKey

    from lmcache_p2p.backend.sender import SenderBackend

    backend = object.__new__(SenderBackend)
    backend._service, backend._arena, backend._tp_rank, backend._warned_no_spec = _Submits(), None, 0, False
    backend._layout, backend._watch = None, None  # equal TP: rank r sends to rank r; handed over at once
    part = arena.allocate(shape_of(5), DTYPES)
    key = CacheEngineKey(model_name="m", world_size=1, worker_id=0, chunk_hash=7, dtype=torch.bfloat16)
    spec = SimpleNamespace(receiver_host="127.0.0.1", receiver_alloc_port=[7300], req_id="req-1",
                           is_last_prefill=True)
    backend.batched_submit_put_task([key], [part], transfer_spec=spec)
    [chunk] = backend._service.batches[0][0]
    assert chunk.shape.shape == [2, LAYERS, 5, HIDDEN]
    assert chunk.shape.nbytes == chunk.tensor.nbytes == 2 * LAYERS * 5 * HIDDEN * 2
