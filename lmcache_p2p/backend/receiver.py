"""``ReceiverBackend``: the decoder side of the plugin, as LMCache sees it.

Allocates the receive buffer once (slot = one full chunk of this model), registers it with the
transport, and serves LMCache's lookups from chunks that have fully arrived. Retrieval is
zero-copy: the MemoryObj handed to the engine is a view of the slot, and the slot returns to the
pool when the engine drops its last reference.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj, MemoryObjMetadata, TensorMemoryObj

from lmcache_p2p.backend.common import (
    build_transport,
    check_rank_stores,
    chunk_key,
    dtype_name,
    fingerprint_of,
    load_config,
    tp_rank_of,
    worker_gpu,
)
from lmcache_p2p.backend.plugin_base import P2PPlugin
from lmcache_p2p.backend.receive_service import Chunk, ReceiveService
from lmcache_p2p.buffer import SlotPool
from lmcache_p2p.buffer.memory import Memory
from lmcache_p2p.config import Role
from lmcache_p2p.errors import ConfigError

logger = logging.getLogger(__name__)


class _SlotLease:
    """The ``parent_allocator`` of one handed-out MemoryObj: freeing it frees the slot, once."""

    def __init__(self, service: ReceiveService, chunk: Chunk) -> None:
        self._service = service
        self._chunk = chunk
        self._lock = threading.Lock()
        self._freed = False

    def free(self, memory_obj: MemoryObj, *_: Any, **__: Any) -> None:
        with self._lock:
            if self._freed:
                return
            self._freed = True
        memory_obj.invalidate()
        self._service.release(self._chunk)

    def batched_free(self, memory_objs: Sequence[MemoryObj], *_: Any, **__: Any) -> None:
        for obj in memory_objs:
            self.free(obj)


def slot_bytes_of(metadata: Any) -> tuple[int, int, torch.dtype]:
    """Bytes of one full chunk of this model, the chunk size in tokens, and the KV dtype."""
    kv_shape = tuple(metadata.kv_shape)  # (layers, 2 or 1, chunk_tokens, kv_heads, head_size)
    dtype = metadata.kv_dtype
    return math.prod(kv_shape) * dtype.itemsize, int(kv_shape[2]), dtype


class ReceiverBackend(P2PPlugin):
    """Decoder side: a preallocated receive buffer that senders write chunks into."""

    def __init__(self, config: Any = None, metadata: Any = None, dst_device: str = "cpu",
                 local_cpu_backend: Any = None, loop: Any = None) -> None:
        super().__init__(dst_device=dst_device, config=config, metadata=metadata,
                         local_cpu_backend=local_cpu_backend, loop=loop)
        self.cfg = load_config(config, Role.RECEIVER)
        tp_rank, tp_size = tp_rank_of(metadata)
        slot_bytes, chunk_tokens, dtype = slot_bytes_of(metadata)
        num_slots = self.cfg.buffer_size_bytes // slot_bytes
        if num_slots < 1:
            raise ConfigError("p2p.buffer_size", f"{self.cfg.buffer_size_bytes} bytes is smaller than one chunk of "
                                                 f"this model ({slot_bytes} bytes); raise it")
        check_rank_stores(config, metadata)
        self._load_in_full_graphs()
        try:
            self._memory = Memory(num_slots * slot_bytes, self.cfg.buffer_device)
            self._buffer = self._memory.tensor
            self._transport = build_transport(self.cfg, f"p2p-recv-{tp_rank}-{id(self):x}", tp_rank,
                                              worker_gpu(dst_device))
            self._transport.start()
            region = self._transport.register(self._buffer)
            self._service = ReceiveService(
                self.cfg, tp_rank=tp_rank, tp_size=tp_size, transport=self._transport,
                pool=SlotPool(num_slots, write_window_s=self.cfg.write_window_s, cache=self.cfg.buffer_cache),
                slot_bytes=slot_bytes, region_addr=region.addr, chunk_tokens=chunk_tokens, dtype=dtype_name(dtype),
                fingerprint=fingerprint_of(metadata, self.cfg.kv_heads_total), buffer=self._buffer,
            )
            self._service.start()
        except Exception:
            logger.exception("lmcache_p2p receiver failed to start (p2p.* in LMCACHE_CONFIG_FILE)")
            self.close()
            raise
        self._slot_bytes = slot_bytes
        logger.info("lmcache_p2p receiver rank %d: %d slots x %d bytes on %s, control %s, transport %s",
                    tp_rank, num_slots, slot_bytes, self.cfg.buffer_device, self._service.control_endpoint,
                    self.cfg.transport.value)

    def __str__(self) -> str:
        return "P2PReceiverBackend"

    # ---- lookups ----
    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        return self.batched_contains([key], pin) == 1

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        return self._svc().count_ready([chunk_key(k) for k in keys], pin=pin)

    # ---- retrieval (zero-copy out of the slot pool) ----
    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        return self.batched_get_blocking([key])[0]

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        service = self._svc()
        out: list[MemoryObj | None] = []
        for key in keys:
            chunk = service.take(chunk_key(key)) if not out or out[-1] is not None else None
            out.append(self._memory_obj(chunk) if chunk is not None else None)
        return out

    def _memory_obj(self, chunk: Chunk) -> MemoryObj:
        shape = chunk.shape
        start = chunk.slot * self._slot_bytes
        dtype = getattr(torch, shape.dtype)
        meta = MemoryObjMetadata(shape=torch.Size(shape.shape), dtype=dtype, address=chunk.slot,
                                 phy_size=shape.nbytes, ref_count=1, fmt=MemoryFormat(shape.fmt))
        return TensorMemoryObj(self._buffer[start:start + shape.nbytes], meta, _SlotLease(self._svc(), chunk))

    # ---- the receiver never stores ----
    def batched_submit_put_task(self, keys: Sequence[CacheEngineKey], objs: list[MemoryObj],
                                transfer_spec: Any = None, on_complete_callback: Any = None) -> None:
        return None

    def pin(self, key: CacheEngineKey) -> bool:
        return self.batched_contains([key], pin=True) == 1

    def unpin(self, key: CacheEngineKey) -> bool:
        """LMCache's lookup_unpin, once per key its lookup pinned: a cached chunk may be evicted again."""
        self._svc().unpin(chunk_key(key))
        return True

    @property
    def free_slots(self) -> int:
        return self._svc().free_slots
