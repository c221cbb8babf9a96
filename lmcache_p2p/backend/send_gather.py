"""How a prefiller with a VRAM send arena gathers each store's chunks out of vLLM's paged KV cache.

LMCache's ``VLLMPagedMemGPUConnectorV2.batched_from_gpu`` calls ``from_gpu`` once per chunk, and
each ``from_gpu`` re-derives the contiguous view of every layer's KV tensor
(``initialize_kvcaches_ptr`` -> ``attempt_permute_to_contiguous_view``: Python work per layer) and,
whenever LMCache made its intermediate GPU buffer (it does unless ``enable_pd``: ours is off), gathers
into that buffer and copies the buffer into the chunk. For a store of one chunked-prefill step (32
chunks of 256 tokens, 32 layers) the engine thread spends its time in that Python, not in the copy,
while vLLM's compute stream waits for it.

:func:`install` replaces that method, in the sender's worker process, with one that derives the
view once per store and runs LMCache's own kernel (``multi_layer_kv_transfer``) straight into each
chunk whose memory is on the GPU (an arena page): the same kernel, the same arguments as
``from_gpu``'s branch without the intermediate buffer, on the same store stream. Chunks in host
memory (the arena was full) still go through ``from_gpu`` as before, with its synchronization.
Nothing is synchronized for the GPU chunks: the sender waits on the store stream before it hands
them to a transport (``send_buffer.store_stream_of``), as it did.

Streams. The store stream waits for the engine's stream before the gather, and the engine's stream for the
store stream after it, both on the GPU: the gather then never depends on the engine's thread having waited
for the forward (``store_ready.py`` takes that wait away), and vLLM, which frees a finished request's blocks
at once, never rewrites one before it was read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

_INSTALLED_ATTR = "_lmcache_p2p_batched_gather"


def install(connector_cls: Any = None, transfer: Callable[..., None] | None = None,
            on_device: Callable[[Any], bool] | None = None) -> Callable[[], None]:
    """Make ``connector_cls`` (default LMCache's ``VLLMPagedMemGPUConnectorV2``) gather a store's GPU
    chunks in one pass; returns the undo. A no-op (returning a no-op undo) when LMCache has no such
    class or its connector lacks what the pass needs (another LMCache version): the original runs."""
    if connector_cls is None:
        try:
            from lmcache.v1.gpu_connector.gpu_connectors import VLLMPagedMemGPUConnectorV2 as connector_cls
        except ImportError:
            logger.info("lmcache_p2p sender: no VLLMPagedMemGPUConnectorV2 in this LMCache; stores unchanged")
            return lambda: None
    missing = [name for name in ("from_gpu", "initialize_kvcaches_ptr", "_initialize_pointers", "batched_from_gpu")
               if not hasattr(connector_cls, name)]
    if missing:
        logger.warning("lmcache_p2p sender: %s has no %s; stores unchanged", connector_cls.__name__, missing)
        return lambda: None
    if connector_cls.__dict__.get(_INSTALLED_ATTR):
        return lambda: None  # another sender of this process installed it; its undo restores
    original = connector_cls.__dict__.get("batched_from_gpu")
    kernel = transfer or _lmcache_transfer()

    def batched_from_gpu(self: Any, memory_objs: Sequence[Any], starts: Sequence[int], ends: Sequence[int],
                         **kwargs: Any) -> None:
        gather_store(self, memory_objs, starts, ends, kwargs, kernel, on_device)

    connector_cls.batched_from_gpu = batched_from_gpu
    setattr(connector_cls, _INSTALLED_ATTR, True)
    logger.info("lmcache_p2p sender: %s.batched_from_gpu gathers each store's VRAM chunks in one pass",
                connector_cls.__name__)

    def undo() -> None:
        if original is not None:
            connector_cls.batched_from_gpu = original
        else:  # it was inherited: drop ours, the base class's shows again
            delattr(connector_cls, "batched_from_gpu")
        delattr(connector_cls, _INSTALLED_ATTR)

    return undo


def installed(connector_cls: Any = None) -> bool:
    """Whether :func:`install` replaced ``connector_cls``'s (default LMCache's) ``batched_from_gpu``."""
    if connector_cls is None:
        try:
            from lmcache.v1.gpu_connector.gpu_connectors import VLLMPagedMemGPUConnectorV2 as connector_cls
        except ImportError:
            return False
    return bool(connector_cls.__dict__.get(_INSTALLED_ATTR))


def gather_store(connector: Any, memory_objs: Sequence[Any], starts: Sequence[int], ends: Sequence[int],
                 kwargs: dict[str, Any], kernel: Callable[..., None],
                 on_device: Callable[[Any], bool] | None = None) -> None:
    """One store: every GPU chunk (``on_device(tensor)``, default ``tensor.is_cuda``) through ``kernel`` on
    the store stream (the view derived once), every other chunk through the connector's own ``from_gpu``."""
    import torch

    on_device = on_device or _is_cuda
    store_stream = connector.store_stream
    engine_stream = None
    if store_stream is not None:  # the gather reads what the step's forward wrote (backend/store_ready.py)
        engine_stream = torch.cuda.current_stream()
        store_stream.wait_stream(engine_stream)
    try:
        _gather(connector, memory_objs, starts, ends, kwargs, kernel, on_device, torch)
    finally:
        if engine_stream is not None:  # no block freed after this step is rewritten before the gather read it
            engine_stream.wait_stream(store_stream)


def _gather(connector: Any, memory_objs: Sequence[Any], starts: Sequence[int], ends: Sequence[int],
            kwargs: dict[str, Any], kernel: Callable[..., None], on_device: Callable[[Any], bool], torch: Any) -> None:
    if getattr(connector, "use_mla", False) or "slot_mapping" not in kwargs:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            connector.from_gpu(obj, start, end, **kwargs)  # MLA's format, or the original's own error
        return
    on_gpu = [i for i, obj in enumerate(memory_objs) if obj.tensor is not None and on_device(obj.tensor)]
    if on_gpu:
        connector.initialize_kvcaches_ptr(**kwargs)
        if connector.kvcaches is None:
            raise ValueError("kvcaches should be provided in kwargs or initialized beforehand.")
        pointers = connector._initialize_pointers(connector.kvcaches)
        slot_mapping = kwargs["slot_mapping"]
        with torch.cuda.stream(connector.store_stream):
            for i in on_gpu:
                kernel(connector, memory_objs[i].tensor, pointers, slot_mapping[starts[i]:ends[i]])
    gpu = set(on_gpu)
    for i, obj in enumerate(memory_objs):
        if i not in gpu:
            connector.from_gpu(obj, starts[i], ends[i], **kwargs)


def _is_cuda(tensor: Any) -> bool:
    return bool(tensor.is_cuda)


def _lmcache_transfer() -> Callable[..., None]:
    """``from_gpu``'s kernel call for a destination without the intermediate buffer (LMCache 0.5.3)."""
    def transfer(connector: Any, dst: Any, pointers: Any, slots: Any) -> None:
        from lmcache import c_ops as lmc_ops

        lmc_ops.multi_layer_kv_transfer(dst, pointers, slots, connector.kvcaches[0].device,
                                        connector.page_buffer_size, lmc_ops.TransferDirection.D2H,
                                        connector.engine_kv_format, block_size=connector.block_size,
                                        head_size=connector.head_size)

    return transfer
