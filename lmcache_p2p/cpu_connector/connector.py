"""LMCache connector for vLLM-CPU's paged KV cache (plain torch; no CUDA, no LMCache kernels).

Copies between vLLM-CPU's per-layer caches ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
and LMCache memory objects in ``KV_2LTD`` format ``[2, num_layers, tokens, num_kv_heads * head_size]``.
The element order inside each (block, head) page is learned from vLLM's own writer
(:mod:`.layout`). A store (``from_gpu``) is one ``index_select`` per layer and K/V over a flat index
built once per chunk from the slot mapping: no Python loop per token. A load (``to_gpu``, on the
decoder's critical path before its first token) calls vLLM's own writer,
``cpu_attn_reshape_and_cache``, once per layer: the very kernel vLLM's attention uses to write the
same cache, so the layout is right by construction, and it is faster than the flat-index copy.

Call shapes match LMCache's ``VLLMPagedMemGPUConnectorV2``: ``kvcaches`` (list of per-layer
tensors) and ``slot_mapping`` (the FULL request's slot mapping; a chunk uses
``slot_mapping[start:end]``) arrive as kwargs; ``vllm_cached_tokens`` skips the prefix vLLM
already holds when loading.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.metadata import LMCacheMetadata

from lmcache_p2p.cpu_connector.layout import PageLayout, attention_isa, learn_page_layout

logger = logging.getLogger(__name__)


class CPUPagedKVConnector(GPUConnectorInterface):
    """Gather/scatter KV between vLLM-CPU paged caches and LMCache ``KV_2LTD`` memory objects."""

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_size: int, dtype: torch.dtype) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.hidden_dim_size = num_kv_heads * head_size
        self.dtype = dtype
        self.use_mla = False
        self.kvcaches: list[torch.Tensor] | None = None
        self._flat_caches: list[torch.Tensor] = []
        self._kv_views: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: vLLM's (key_cache, value_cache)
        self._index: _BlockIndex | None = None

    @classmethod
    def from_metadata(cls, metadata: LMCacheMetadata) -> CPUPagedKVConnector:
        """Build from LMCache's engine metadata (``kv_shape`` = layers, 2, chunk, kv heads, head size)."""
        if metadata.use_mla:
            raise ValueError("the CPU connector does not support MLA models (metadata.use_mla is true)")
        num_layers, _, _, num_kv_heads, head_size = metadata.kv_shape
        return cls(num_layers=num_layers, num_kv_heads=num_kv_heads, head_size=head_size, dtype=metadata.kv_dtype)

    # -- GPUConnectorInterface -------------------------------------------------------------------

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.hidden_dim_size])

    def initialize_kvcaches_ptr(self, **kwargs: Any) -> None:
        kvcaches = kwargs.get("kvcaches")
        if kvcaches is None:
            if self.kvcaches is None:
                raise ValueError("'kvcaches' must be passed in kwargs on the first transfer")
            return
        kvcaches = list(kvcaches)
        if self.kvcaches is not None and _same_tensors(self.kvcaches, kvcaches):
            return
        self._bind_caches(kvcaches)

    @torch.inference_mode()
    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Copy tokens ``[start, end)`` of the request from the paged cache into ``memory_obj``."""
        self.initialize_kvcaches_ptr(**kwargs)
        slots = _chunk_slots(kwargs, start, end)
        dst = self._checked_tensor(memory_obj, end - start)
        k_index, v_index = self._flat_indices(slots)
        for layer, flat in enumerate(self._flat_caches):
            torch.index_select(flat, 0, k_index, out=dst[0, layer].view(-1))
            torch.index_select(flat, 0, v_index, out=dst[1, layer].view(-1))
        memory_obj.metadata.fmt = MemoryFormat.KV_2LTD

    @torch.inference_mode()
    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Copy ``memory_obj`` into the paged cache at the slots of tokens ``[start, end)``."""
        self.initialize_kvcaches_ptr(**kwargs)
        if memory_obj.metadata.fmt != MemoryFormat.KV_2LTD:
            raise ValueError(f"the CPU connector loads KV_2LTD memory objects, got {memory_obj.metadata.fmt}")
        src = self._checked_tensor(memory_obj, end - start)
        skip_tokens = min(end - start, max(0, int(kwargs.get("vllm_cached_tokens", 0)) - start))
        slots = _chunk_slots(kwargs, start + skip_tokens, end)
        if slots.numel() == 0:
            return
        self._check_slots(slots)
        src = src[:, :, skip_tokens:]
        from vllm import _custom_ops as ops

        token_shape = (slots.numel(), self.num_kv_heads, self.head_size)
        for layer, (key_cache, value_cache) in enumerate(self._kv_views):
            ops.cpu_attn_reshape_and_cache(src[0, layer].view(token_shape), src[1, layer].view(token_shape),
                                           key_cache, value_cache, slots, self._index.layout.isa)

    def batched_from_gpu(
        self, memory_objs: Sequence[MemoryObj], starts: Sequence[int], ends: Sequence[int], **kwargs: Any
    ) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def batched_to_gpu(
        self,
        memory_objs: Sequence[MemoryObj] | None = None,
        starts: Sequence[int] | None = None,
        ends: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> None:
        if memory_objs is None or starts is None or ends is None:
            raise ValueError("the CPU connector is not layerwise: pass memory_objs, starts and ends")
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(memory_obj, start, end, **kwargs)

    # -- internals --------------------------------------------------------------------------------

    def _bind_caches(self, kvcaches: list[torch.Tensor]) -> None:
        if len(kvcaches) != self.num_layers:
            raise ValueError(f"got {len(kvcaches)} KV cache layers, LMCache metadata says {self.num_layers}")
        block_size = _check_layer(kvcaches[0], self.num_kv_heads, self.head_size, self.dtype)
        for cache in kvcaches[1:]:
            if cache.shape != kvcaches[0].shape or cache.dtype != kvcaches[0].dtype:
                raise ValueError(f"KV cache layers differ: {tuple(cache.shape)} vs {tuple(kvcaches[0].shape)}")
            _check_layer(cache, self.num_kv_heads, self.head_size, self.dtype)
        isa = attention_isa(self.dtype, block_size, self.head_size)
        layout = learn_page_layout(self.dtype, block_size, self.head_size, isa)
        self.kvcaches = kvcaches
        self._flat_caches = [cache.view(-1) for cache in kvcaches]
        # the (key_cache, value_cache) views vLLM's CPU attention backend hands its writer
        self._kv_views = [tuple(cache.view(cache.shape[0], self.num_kv_heads, 2 * block_size, self.head_size)
                                .chunk(2, dim=2)) for cache in kvcaches]
        self._index = _BlockIndex.build(layout, self.num_kv_heads, num_blocks=int(kvcaches[0].shape[0]))
        logger.info(
            "CPU connector bound %d KV cache layers of shape %s (%s, isa=%s)",
            len(kvcaches),
            tuple(kvcaches[0].shape),
            self.dtype,
            layout.isa,
        )

    def _flat_indices(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._index is None:
            raise RuntimeError("no KV caches bound: pass 'kvcaches' in kwargs")
        return self._index.flat_indices(slots)

    def _check_slots(self, slots: torch.Tensor) -> None:
        """Every slot inside the bound cache (vLLM's writer does not check: it would write out of bounds)."""
        if self._index is None:
            raise RuntimeError("no KV caches bound: pass 'kvcaches' in kwargs")
        self._index.check_slots(slots)

    def _checked_tensor(self, memory_obj: MemoryObj, num_tokens: int) -> torch.Tensor:
        tensor = memory_obj.tensor
        if tensor is None:
            raise ValueError("memory object has no tensor")
        expected = self.get_shape(num_tokens)
        if tensor.shape != expected or tensor.dtype != self.dtype:
            raise ValueError(
                f"memory object is {tuple(tensor.shape)} {tensor.dtype}, expected {tuple(expected)} {self.dtype}"
            )
        if not tensor.is_contiguous():
            raise ValueError("memory object tensor must be contiguous")
        return tensor


@dataclasses.dataclass(frozen=True)
class _BlockIndex:
    """Element offsets of every (head, token-in-block, dim) of K and V inside one cache block."""

    layout: PageLayout
    num_blocks: int
    block_elems: int
    k_rows: torch.Tensor  # [block_size, num_kv_heads * head_size] int64: offsets of each token-in-block
    v_rows: torch.Tensor

    @classmethod
    def build(cls, layout: PageLayout, num_kv_heads: int, *, num_blocks: int) -> _BlockIndex:
        head_base = torch.arange(num_kv_heads, dtype=torch.int64).view(-1, 1, 1) * layout.page_elems
        k_offsets = head_base + layout.k_offsets.unsqueeze(0)  # [heads, block_size, head_size]
        v_offsets = head_base + layout.v_offsets.unsqueeze(0)
        return cls(
            layout=layout,
            num_blocks=num_blocks,
            block_elems=num_kv_heads * layout.page_elems,
            # one contiguous row per token-in-block, in (head, dim) order: a token's indices are one row
            k_rows=k_offsets.permute(1, 0, 2).reshape(layout.block_size, -1).contiguous(),
            v_rows=v_offsets.permute(1, 0, 2).reshape(layout.block_size, -1).contiguous(),
        )

    def check_slots(self, slots: torch.Tensor) -> None:
        num_slots = self.num_blocks * self.layout.block_size
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_slots):
            raise ValueError(
                f"slot mapping holds slots outside [0, {num_slots}): min {int(slots.min())}, max {int(slots.max())}"
            )

    def flat_indices(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat element indices of K and V for each slot, in (token, head, dim) order."""
        self.check_slots(slots)
        block_size = self.layout.block_size
        block_base = ((slots // block_size) * self.block_elems).view(-1, 1)  # [T, 1]
        in_block = slots % block_size  # [T]
        k_index = torch.index_select(self.k_rows, 0, in_block).add_(block_base)  # [T, heads * head_size]
        v_index = torch.index_select(self.v_rows, 0, in_block).add_(block_base)
        return k_index.view(-1), v_index.view(-1)


def _chunk_slots(kwargs: dict[str, Any], start: int, end: int) -> torch.Tensor:
    slot_mapping = kwargs.get("slot_mapping")
    if slot_mapping is None:
        raise ValueError("'slot_mapping' must be passed in kwargs")
    if not isinstance(slot_mapping, torch.Tensor):
        slot_mapping = torch.as_tensor(slot_mapping)
    if end > slot_mapping.numel():
        raise ValueError(f"chunk [{start}, {end}) is past the slot mapping's {slot_mapping.numel()} tokens")
    return slot_mapping[start:end].to(device="cpu", dtype=torch.int64)


def _check_layer(cache: torch.Tensor, num_kv_heads: int, head_size: int, dtype: torch.dtype) -> int:
    """Validate one layer's cache tensor and return its block size."""
    if cache.device.type != "cpu":
        raise ValueError(f"the CPU connector needs CPU KV caches, got a tensor on {cache.device}")
    if cache.dim() != 4 or cache.shape[1] != num_kv_heads or cache.shape[3] != 2 * head_size:
        raise ValueError(
            f"KV cache layer shape {tuple(cache.shape)} is not vLLM-CPU's "
            f"[num_blocks, num_kv_heads={num_kv_heads}, block_size, 2*head_size={2 * head_size}]"
        )
    if cache.dtype != dtype:
        raise ValueError(f"KV cache dtype {cache.dtype} differs from LMCache's kv_dtype {dtype}")
    if not cache.is_contiguous():
        raise ValueError(f"KV cache layer must be contiguous (strides {cache.stride()})")
    return int(cache.shape[2])


def _same_tensors(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.data_ptr() == y.data_ptr() and x.shape == y.shape for x, y in zip(a, b))
