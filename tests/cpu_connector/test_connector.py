"""CPUPagedKVConnector against vLLM-CPU's own KV writer (``cpu_attn_reshape_and_cache``).

The reference cache is always written by vLLM's writer; the connector must read exactly the K/V
that went in, and writing back through the connector must produce the same bytes vLLM's writer
produced. A layout mistake (e.g. K not transposed) fails these tests even though a plain
store/load round trip through the connector would pass.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj  # noqa: E402

from lmcache_p2p.cpu_connector.connector import CPUPagedKVConnector  # noqa: E402
from lmcache_p2p.cpu_connector.layout import attention_isa, learn_page_layout  # noqa: E402

NUM_LAYERS = 2
NUM_KV_HEADS = 2
NUM_BLOCKS = 12
CHUNK_TOKENS = 128


@dataclasses.dataclass
class PagedCase:
    dtype: torch.dtype
    block_size: int
    head_size: int
    num_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens]
    keys: list[torch.Tensor]  # per layer [num_tokens, heads, head_size]
    values: list[torch.Tensor]
    caches: list[torch.Tensor]  # per layer, written by vLLM's writer into zeros

    def empty_caches(self) -> list[torch.Tensor]:
        return [torch.zeros_like(c) for c in self.caches]

    def chunks(self) -> tuple[list[int], list[int]]:
        starts = list(range(0, self.num_tokens, CHUNK_TOKENS))
        ends = [min(s + CHUNK_TOKENS, self.num_tokens) for s in starts]
        return starts, ends


def vllm_write(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Write K/V exactly as vLLM's CPU attention backend does (same views, same op)."""
    from vllm import _custom_ops as ops

    num_blocks, num_heads, block_size, _ = cache.shape
    key_cache, value_cache = cache.view(num_blocks, num_heads, 2 * block_size, -1).chunk(2, dim=2)
    isa = attention_isa(cache.dtype, block_size, key.shape[-1])
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)


def random_slot_mapping(num_tokens: int, block_size: int, gen: torch.Generator) -> torch.Tensor:
    """Slots of one request over randomly chosen, out-of-order blocks; the last block partial."""
    num_req_blocks = -(-num_tokens // block_size)
    blocks = torch.randperm(NUM_BLOCKS, generator=gen)[:num_req_blocks]
    positions = torch.arange(num_tokens)
    return blocks[positions // block_size] * block_size + positions % block_size


def make_case(dtype: torch.dtype, block_size: int, head_size: int, num_tokens: int, seed: int = 0) -> PagedCase:
    gen = torch.Generator().manual_seed(seed)
    slots = random_slot_mapping(num_tokens, block_size, gen)
    keys, values, caches = [], [], []
    for _ in range(NUM_LAYERS):
        key = torch.randn(num_tokens, NUM_KV_HEADS, head_size, generator=gen).to(dtype)
        value = torch.randn(num_tokens, NUM_KV_HEADS, head_size, generator=gen).to(dtype)
        cache = torch.zeros(NUM_BLOCKS, NUM_KV_HEADS, block_size, 2 * head_size, dtype=dtype)
        vllm_write(key, value, cache, slots)
        keys.append(key)
        values.append(value)
        caches.append(cache)
    return PagedCase(dtype, block_size, head_size, num_tokens, slots, keys, values, caches)


def make_memory_obj(shape: torch.Size, dtype: torch.dtype) -> TensorMemoryObj:
    num_bytes = shape.numel() * dtype.itemsize
    meta = MemoryObjMetadata(
        shape=shape, dtype=dtype, address=0, phy_size=num_bytes, ref_count=1, fmt=MemoryFormat.KV_2LTD
    )
    return TensorMemoryObj(torch.zeros(num_bytes, dtype=torch.uint8), meta, None)


def make_connector(case: PagedCase) -> CPUPagedKVConnector:
    return CPUPagedKVConnector(
        num_layers=NUM_LAYERS, num_kv_heads=NUM_KV_HEADS, head_size=case.head_size, dtype=case.dtype
    )


def store_chunks(connector: CPUPagedKVConnector, case: PagedCase) -> tuple[list[TensorMemoryObj], list[int], list[int]]:
    starts, ends = case.chunks()
    objs = [make_memory_obj(connector.get_shape(e - s), case.dtype) for s, e in zip(starts, ends)]
    connector.batched_from_gpu(objs, starts, ends, kvcaches=case.caches, slot_mapping=case.slot_mapping)
    return objs, starts, ends


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


CASES = [
    pytest.param(torch.bfloat16, 128, 32, 300, id="bf16-bs128-hs32"),
    pytest.param(torch.bfloat16, 16, 32, 150, id="bf16-bs16-hs32"),
    pytest.param(torch.bfloat16, 32, 64, 301, id="bf16-bs32-hs64"),
    pytest.param(torch.float32, 128, 32, 300, id="fp32-bs128-hs32"),
    pytest.param(torch.float32, 32, 64, 77, id="fp32-bs32-hs64"),
    pytest.param(torch.float16, 128, 32, 260, id="fp16-bs128-hs32"),
]


@pytest.mark.parametrize(("dtype", "block_size", "head_size", "num_tokens"), CASES)
def test_from_gpu_reads_exactly_what_vllm_wrote(dtype, block_size, head_size, num_tokens):
    case = make_case(dtype, block_size, head_size, num_tokens)
    connector = make_connector(case)
    objs, starts, ends = store_chunks(connector, case)
    for obj, start, end in zip(objs, starts, ends):
        assert obj.metadata.fmt == MemoryFormat.KV_2LTD
        for layer in range(NUM_LAYERS):
            want_k = case.keys[layer][start:end].reshape(end - start, -1)
            want_v = case.values[layer][start:end].reshape(end - start, -1)
            assert torch.equal(as_bytes(obj.tensor[0, layer]), as_bytes(want_k)), (start, layer, "K")
            assert torch.equal(as_bytes(obj.tensor[1, layer]), as_bytes(want_v)), (start, layer, "V")


@pytest.mark.parametrize(("dtype", "block_size", "head_size", "num_tokens"), CASES)
def test_to_gpu_writes_the_bytes_vllm_writes(dtype, block_size, head_size, num_tokens):
    case = make_case(dtype, block_size, head_size, num_tokens)
    connector = make_connector(case)
    objs, starts, ends = store_chunks(connector, case)

    target = case.empty_caches()
    connector.batched_to_gpu(objs, starts, ends, kvcaches=target, slot_mapping=case.slot_mapping)
    # Unwritten slots stay zero in both caches, so whole-cache equality covers "only the
    # written slots changed" as well as "every written slot holds vLLM's bytes".
    for layer in range(NUM_LAYERS):
        assert torch.equal(as_bytes(target[layer]), as_bytes(case.caches[layer])), layer


def test_to_gpu_from_kv_not_produced_by_the_connector():
    """Load KV built straight from K/V tensors (as a peer would send it), not from a store."""
    case = make_case(torch.bfloat16, 128, 32, 200, seed=3)
    connector = make_connector(case)
    obj = make_memory_obj(connector.get_shape(case.num_tokens), case.dtype)
    for layer in range(NUM_LAYERS):
        obj.tensor[0, layer].copy_(case.keys[layer].reshape(case.num_tokens, -1))
        obj.tensor[1, layer].copy_(case.values[layer].reshape(case.num_tokens, -1))
    target = case.empty_caches()
    connector.to_gpu(obj, 0, case.num_tokens, kvcaches=target, slot_mapping=case.slot_mapping)
    for layer in range(NUM_LAYERS):
        assert torch.equal(as_bytes(target[layer]), as_bytes(case.caches[layer]))


def test_to_gpu_skips_tokens_vllm_already_holds():
    case = make_case(torch.bfloat16, 32, 32, 200, seed=1)
    connector = make_connector(case)
    objs, starts, ends = store_chunks(connector, case)
    target = case.empty_caches()
    cached_tokens = 160  # inside the second chunk
    connector.batched_to_gpu(
        objs, starts, ends, kvcaches=target, slot_mapping=case.slot_mapping, vllm_cached_tokens=cached_tokens
    )
    expected = case.empty_caches()
    for layer in range(NUM_LAYERS):
        vllm_write(
            case.keys[layer][cached_tokens:],
            case.values[layer][cached_tokens:],
            expected[layer],
            case.slot_mapping[cached_tokens:],
        )
        assert torch.equal(as_bytes(target[layer]), as_bytes(expected[layer]))


def test_slot_mapping_is_indexed_by_absolute_token_position():
    """starts/ends index the FULL request's slot mapping, as LMCache passes it."""
    case = make_case(torch.float32, 32, 32, 256, seed=2)
    connector = make_connector(case)
    obj = make_memory_obj(connector.get_shape(64), case.dtype)
    connector.from_gpu(obj, 128, 192, kvcaches=case.caches, slot_mapping=case.slot_mapping)
    assert torch.equal(obj.tensor[0, 1], case.keys[1][128:192].reshape(64, -1))


def test_learned_layout_is_a_permutation_of_the_page():
    for dtype in (torch.bfloat16, torch.float32):
        layout = learn_page_layout(dtype, 128, 32, attention_isa(dtype, 128, 32))
        offsets = torch.cat([layout.k_offsets.reshape(-1), layout.v_offsets.reshape(-1)])
        assert torch.equal(torch.sort(offsets).values, torch.arange(layout.page_elems))


def test_rejects_memory_obj_of_wrong_dtype():
    case = make_case(torch.bfloat16, 32, 32, 64)
    connector = make_connector(case)
    obj = make_memory_obj(connector.get_shape(64), torch.float32)
    with pytest.raises(ValueError, match="expected"):
        connector.from_gpu(obj, 0, 64, kvcaches=case.caches, slot_mapping=case.slot_mapping)


def test_rejects_slots_outside_the_cache():
    case = make_case(torch.bfloat16, 32, 32, 64)
    connector = make_connector(case)
    obj = make_memory_obj(connector.get_shape(64), case.dtype)
    bad_slots = case.slot_mapping.clone()
    bad_slots[5] = NUM_BLOCKS * 32
    with pytest.raises(ValueError, match="outside"):
        connector.from_gpu(obj, 0, 64, kvcaches=case.caches, slot_mapping=bad_slots)


@pytest.mark.parametrize("bad_slot", [NUM_BLOCKS * 32, -1])
def test_load_rejects_slots_outside_the_cache_and_writes_nothing(bad_slot):
    """vLLM's writer (the load path) does not check slots: the connector must, before any write."""
    case = make_case(torch.bfloat16, 32, 32, 64)
    connector = make_connector(case)
    objs, starts, ends = store_chunks(connector, case)
    bad_slots = case.slot_mapping.clone()
    bad_slots[5] = bad_slot
    target = case.empty_caches()
    with pytest.raises(ValueError, match="outside"):
        connector.batched_to_gpu(objs, starts, ends, kvcaches=target, slot_mapping=bad_slots)
    assert all(not t.any() for t in target)


def test_rejects_a_cache_that_is_not_vllm_cpu_shaped():
    connector = CPUPagedKVConnector(
        num_layers=NUM_LAYERS, num_kv_heads=NUM_KV_HEADS, head_size=32, dtype=torch.bfloat16
    )
    nhd_caches = [torch.zeros(2, NUM_BLOCKS, 32, NUM_KV_HEADS, 32, dtype=torch.bfloat16) for _ in range(NUM_LAYERS)]
    obj = make_memory_obj(connector.get_shape(8), torch.bfloat16)
    with pytest.raises(ValueError, match="vLLM-CPU"):
        connector.from_gpu(obj, 0, 8, kvcaches=nhd_caches, slot_mapping=torch.arange(8))
