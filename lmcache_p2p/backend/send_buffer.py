"""The prefiller's chunks in VRAM (``p2p.buffer_device: cuda`` on a sender): no host round trip.

Without it, LMCache copies every chunk it stores out of vLLM's paged KV cache into its pinned
host buffer (LocalCPUBackend is the allocator whenever ``enable_pd`` is false), synchronizing on
each chunk, and the transport then moves it back onto a GPU for the peer write: for a 1k-token
8B prompt (128 MiB) that is ~2.5 ms down, ~2.5 ms up and ~0.4 ms over NVLink. With the chunks in
an arena on the worker's own GPU, the store is a device-to-device gather and the write goes
straight from that arena to the decoder's GPU.

How LMCache is made to use it. ``StorageManager`` allocates every stored chunk through
``LocalCPUBackend.allocate`` / ``batched_allocate`` ("regardless of whether local_cpu is True or
False", as LMCache's docstring says), and hands the same objects to every backend whose
allocator backend is LocalCPUBackend (ours is) without copying. On a sender whose LocalCPUBackend
keeps nothing (``local_cpu: false``: it is only the allocator), :func:`lend` replaces those two
methods on that one instance with ones that take pages of :class:`SendArena` first and fall back
to LocalCPUBackend's own host memory when the arena is full (a burst degrades to today's path
instead of dropping chunks). Nothing else of LMCache changes.

Ordering. LMCache's GPU connector gathers into a GPU destination on its ``store_stream`` and,
unlike for a host destination, does not wait for it (LMCache 0.5.3 ``from_gpu``). The sender
therefore waits for that stream before it hands VRAM chunks to a transport, which reads
them on other streams (:func:`gpu_connector_of`, ``store_ready.py``).
"""

from __future__ import annotations

import logging
import threading
import types
from collections.abc import Callable
from typing import Any

from lmcache_p2p.errors import ConfigError

logger = logging.getLogger(__name__)

_LENT_ATTR = "_lmcache_p2p_send_arena"


class SendArena:
    """A fixed arena of chunk-sized pages on one device (LMCache's own paged allocator on it).

    ``shapes``/``dtypes`` are a full chunk's (LMCache ``metadata.kv_shape`` / ``kv_dtype``), so each
    page holds one chunk, the partial last chunk of a prompt included.
    """

    def __init__(self, nbytes: int, device: str, shapes: list[Any], dtypes: list[Any]) -> None:
        import torch
        from lmcache.v1.memory_allocators.paged_tensor_memory_allocator import PagedTensorMemoryAllocator
        from lmcache.v1.memory_management import MemoryFormat

        page = _page_bytes(shapes, dtypes)
        pages = nbytes // page
        if pages < 1:
            raise ConfigError("p2p.buffer_size", (
                f"is {nbytes} bytes on a sender with buffer_device {device}, less than one chunk ({page} bytes: "
                f"chunk_size tokens of KV): raise p2p.buffer_size to at least {page} (a few requests' worth, e.g. "
                f"{16 * page})"))
        self.device = device
        self.page_bytes = page
        self.pages = pages
        self.buffer = torch.empty(pages * page, dtype=torch.uint8, device=device)
        self._fmt = MemoryFormat.KV_2LTD
        # Pages are taken on the engine's thread only and given back (ref_count_down) from the
        # sender's; the allocator's free list is a deque, whose appends and pops are atomic.
        self._allocator = PagedTensorMemoryAllocator(self.buffer, list(shapes), list(dtypes), self._fmt)
        self.spilled = 0  # chunks that found the arena full and went to host memory
        logger.info("lmcache_p2p sender: %d chunk pages (%.2f GiB) on %s for stored chunks", pages,
                    pages * page / 2**30, device)

    def allocate(self, shapes: Any, dtypes: Any, fmt: Any = None) -> Any:
        """One page, or None when the arena is full."""
        return self._allocator.allocate(shapes, dtypes, fmt if fmt is not None else self._fmt)

    def batched_allocate(self, shapes: Any, dtypes: Any, batch_size: int, fmt: Any = None) -> list[Any] | None:
        """``batch_size`` pages, or None (nothing taken) when fewer are free."""
        return self._allocator.batched_allocate(shapes, dtypes, batch_size, fmt if fmt is not None else self._fmt)

    def free_pages(self) -> int:
        return len(self._allocator.free_blocks)


def lend(local_cpu_backend: Any, arena: SendArena) -> Callable[[], None]:
    """Make ``local_cpu_backend`` allocate stored chunks from ``arena`` first; returns the undo.

    Refused (ConfigError naming ``local_cpu``) when LocalCPUBackend keeps chunks itself
    (``local_cpu: true``): it would then hold VRAM pages as a cache the arena was not sized for.
    """
    if getattr(local_cpu_backend, "use_hot", False):
        raise ConfigError("local_cpu", "must be false on a sender with p2p.buffer_device cuda: LocalCPUBackend "
                                       "would keep the VRAM chunks as its cache; set local_cpu: false")
    if getattr(local_cpu_backend, _LENT_ATTR, None) is not None:
        raise RuntimeError("LocalCPUBackend already allocates from a lmcache_p2p send arena")
    host_allocate = local_cpu_backend.allocate
    host_batched = local_cpu_backend.batched_allocate
    warned = threading.Event()

    def spill(n: int) -> None:
        arena.spilled += n
        if not warned.is_set():
            warned.set()
            logger.warning("lmcache_p2p sender: the %d-page VRAM arena (p2p.buffer_size) is full; chunks go through "
                           "host memory until pages free up (slower: raise p2p.buffer_size)", arena.pages)

    def allocate(self: Any, shapes: Any, dtypes: Any, fmt: Any = None, eviction: bool = True,
                 busy_loop: bool = True) -> Any:
        obj = arena.allocate(shapes, dtypes, fmt)
        if obj is not None:
            return obj
        spill(1)
        return host_allocate(shapes, dtypes, fmt, eviction, busy_loop)

    def batched_allocate(self: Any, shapes: Any, dtypes: Any, batch_size: int, fmt: Any = None,
                         eviction: bool = True, busy_loop: bool = True) -> Any:
        objs = arena.batched_allocate(shapes, dtypes, batch_size, fmt)
        if objs is not None:
            return objs
        spill(batch_size)
        return host_batched(shapes, dtypes, batch_size, fmt, eviction, busy_loop)

    local_cpu_backend.allocate = types.MethodType(allocate, local_cpu_backend)
    local_cpu_backend.batched_allocate = types.MethodType(batched_allocate, local_cpu_backend)
    setattr(local_cpu_backend, _LENT_ATTR, arena)

    def undo() -> None:
        for name in ("allocate", "batched_allocate", _LENT_ATTR):
            local_cpu_backend.__dict__.pop(name, None)

    return undo


def gpu_connector_of(storage_backend: Any) -> Any:
    """LMCache's GPU connector (its ``store_stream`` gathers, its ``load_stream`` retrieves) for the engine
    that owns ``storage_backend``.

    Found through ``LMCacheEngineBuilder``'s engines (a worker process has one per LMCache
    instance): the one whose storage manager holds this backend. None if there is none yet.
    """
    try:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
    except ImportError:
        return None
    for engine in list(getattr(LMCacheEngineBuilder, "_instances", {}).values()):
        backends = getattr(getattr(engine, "storage_manager", None), "storage_backends", None) or {}
        if any(b is storage_backend for b in backends.values()):
            return getattr(engine, "gpu_connector", None)
    return None


def _page_bytes(shapes: list[Any], dtypes: list[Any]) -> int:
    """One full chunk's bytes (what LMCache's paged allocator calls align_bytes)."""
    import torch

    return sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in zip(shapes, dtypes))
