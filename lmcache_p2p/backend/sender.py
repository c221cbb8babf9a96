"""``SenderBackend``: the prefiller side of the plugin, as LMCache sees it.

``batched_submit_put_task`` runs on the engine's thread: it takes a reference on each chunk,
hands the batch to the sender service and returns at once. With ``p2p.async_store`` a store in VRAM
is handed over before its GPU work is done, with its readiness (``store_ready.StoreWatch``): the
service asks for slots at once and writes only once the GPU is done. Where the KV goes comes only from
``transfer_spec`` (LMCache's DisaggSpec); a put without one (a request that was not routed for
disaggregation) is a no-op that never breaks the engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj

from lmcache_p2p import protocol
from lmcache_p2p import kv_layout
from lmcache_p2p.backend.common import (build_transport, check_rank_stores, chunk_key, dtype_name, fingerprint_of,
                                        load_config, tp_rank_of, worker_gpu)
from lmcache_p2p.backend.relayout import pack_heads
from lmcache_p2p.backend.plugin_base import P2PPlugin
from lmcache_p2p.backend.send_buffer import SendArena, gpu_connector_of, lend
from lmcache_p2p.backend.send_gather import install as install_batched_gather
from lmcache_p2p.backend.send_service import Chunk, SendService, Target
from lmcache_p2p.backend.send_types import StoreReady, release
from lmcache_p2p.backend.store_ready import StoreMode, StoreWatch, gpu_done, install_async_slot_mapping, store_mode_of
from lmcache_p2p.config import Role
from lmcache_p2p.errors import ClosedError, ConfigError, P2PError, QueueFull

logger = logging.getLogger(__name__)


def target_of(spec: Any, tp_rank: int) -> Target:
    """The receiver endpoint for this TP rank, from a DisaggSpec; ValueError names the bad field."""
    host = getattr(spec, "receiver_host", None)
    ports = getattr(spec, "receiver_alloc_port", None)
    if not isinstance(host, str) or not host:
        raise ValueError(f"disagg_spec.receiver_host must be a host name, got {host!r}")
    if isinstance(ports, int):
        ports = [ports]
    if not isinstance(ports, (list, tuple)) or len(ports) <= tp_rank:
        raise ValueError(f"disagg_spec.receiver_alloc_port must list one port per TP rank (rank {tp_rank}), "
                         f"got {ports!r}")
    return Target(host, int(ports[tp_rank]))


class SenderBackend(P2PPlugin):
    """Prefiller side: pushes every stored chunk to the receiver named in the request's DisaggSpec."""

    def __init__(self, config: Any = None, metadata: Any = None, dst_device: str = "cpu",
                 local_cpu_backend: Any = None, loop: Any = None) -> None:
        super().__init__(dst_device=dst_device, config=config, metadata=metadata,
                         local_cpu_backend=local_cpu_backend, loop=loop)
        self.cfg = load_config(config, Role.SENDER)
        self._tp_rank, tp_size = tp_rank_of(metadata)
        self._warned_no_spec = False
        self._layout: kv_layout.KvLayout | None = None  # our rank's KV split (None: unknown, rank r -> r)
        self._arena: SendArena | None = None
        self._unlend: Callable[[], None] | None = None
        self._connector: Any = None  # LMCache's GPU connector, once looked up (False: none found)
        self._watch: StoreWatch | None = None  # p2p.async_store: stores go before their GPU work is done
        self._load_in_full_graphs()
        try:
            gpu = worker_gpu(dst_device)
            self._transport = build_transport(self.cfg, f"p2p-send-{self._tp_rank}-{id(self):x}", self._tp_rank, gpu)
            self._transport.start()
            self._register_allocator_memory()
            if self.cfg.buffer_device != "cpu":
                self._start_arena(metadata, gpu)
            fingerprint = fingerprint_of(metadata, self.cfg.kv_heads_total)
            check_rank_stores(config, metadata)
            self._layout = kv_layout.layout_of(fingerprint) if fingerprint is not None else None
            self._service = SendService(self.cfg, tp_rank=self._tp_rank, tp_size=tp_size, transport=self._transport,
                                        fingerprint=fingerprint)
            self._service.start()
        except Exception:
            logger.exception("lmcache_p2p sender failed to start (p2p.* in LMCACHE_CONFIG_FILE)")
            self.close()
            raise
        logger.info("lmcache_p2p sender rank %d ready (transport %s)", self._tp_rank, self.cfg.transport.value)

    def _register_allocator_memory(self) -> None:
        """Register LMCache's host buffer once, so chunks are written without per-chunk registration."""
        allocator = getattr(self.local_cpu_backend, "memory_allocator", None)
        buffer = getattr(allocator, "buffer", None)
        if buffer is not None and buffer.numel() > 0:
            self._transport.register(buffer)

    def _start_arena(self, metadata: Any, gpu: str | None) -> None:
        """Chunks stored in VRAM on the worker's GPU (p2p.buffer_device: cuda; see send_buffer.py)."""
        want = self.cfg.buffer_device
        if gpu is None or (want != "cuda" and want != gpu):
            raise ConfigError("p2p.buffer_device", (
                f"is {want} on a sender whose worker runs on {gpu or 'the CPU'}: a prefiller's chunks must live on "
                f"its own GPU; set buffer_device: cuda (its GPU) or cpu"))
        if metadata is None or self.local_cpu_backend is None:
            raise ConfigError("p2p.buffer_device", "cuda needs LMCache's metadata and LocalCPUBackend (the allocator)")
        get_shapes = getattr(metadata, "get_shapes", None)
        shapes = get_shapes() if get_shapes else [list(metadata.kv_shape)]
        dtypes = metadata.get_dtypes() if hasattr(metadata, "get_dtypes") else [metadata.kv_dtype]
        self._arena = SendArena(self.cfg.buffer_size_bytes, gpu, shapes, dtypes)
        self._transport.register(self._arena.buffer)
        unlend = lend(self.local_cpu_backend, self._arena)
        ungather = install_batched_gather() if self.cfg.batched_gather else (lambda: None)
        unslots: Callable[[], None] = lambda: None
        if self.cfg.async_store:
            self._watch = StoreWatch(f"p2p-store-{self._tp_rank}", timeout_s=self.cfg.store_ready_timeout_s,
                                     max_stores=self.cfg.store_queue_max_stores)
            unslots = install_async_slot_mapping()  # each step's StoreMode is chosen where the connector is known

        def undo() -> None:
            unslots()
            ungather()
            unlend()

        self._unlend = undo

    def _after_store(self, device: str) -> Callable[[], bool] | None:
        """VRAM chunks: LMCache's connector gathered them on its store stream without waiting. With a store watch
        (the store's StoreMode is not SYNC), the engine's stream (a split of heads below runs on it) and LMCache's
        load stream are ordered after that stream and a check for all of it is returned; else this thread waits
        now, and None is returned."""
        if self._connector is None:  # looked up once: the engine exists by the first store
            self._connector = gpu_connector_of(self) or False
        connector = self._connector
        store_stream = getattr(connector, "store_stream", None) if connector else None
        if store_stream is not None and self._watch is not None and store_mode_of(connector) is not StoreMode.SYNC:
            return gpu_done(store_stream, getattr(connector, "load_stream", None))
        if store_stream is not None:
            store_stream.synchronize()
        else:
            import torch

            torch.cuda.synchronize(device)
        return None

    def close(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.close()  # every store's readiness is settled before the service closes
        unlend, self._unlend = self._unlend, None
        if unlend is not None:
            unlend()
        super().close()

    def __str__(self) -> str:
        return "P2PSenderBackend"

    def batched_submit_put_task(self, keys: Sequence[CacheEngineKey], objs: list[MemoryObj],
                                transfer_spec: Any = None, on_complete_callback: Any = None) -> None:
        called_s = time.perf_counter()  # the request's submit time, reported to the proxy (KvSent)
        if transfer_spec is None:
            if not self._warned_no_spec:
                self._warned_no_spec = True
                logger.info("a request without disagg_spec was stored: nothing is sent (not routed for PD)")
            return None
        service = self._service
        if service is None:
            raise ClosedError("sender backend is closed")
        ports = getattr(transfer_spec, "receiver_alloc_port", None)
        receiver_tp = len(ports) if isinstance(ports, (list, tuple)) else 1
        ready = None
        if self._arena is not None and any(obj.tensor.is_cuda for obj in objs):
            ready = self._after_store(self._arena.device)
        req_id, last = str(transfer_spec.req_id), bool(transfer_spec.is_last_prefill)
        sends = self._sends(keys, objs, transfer_spec, req_id, receiver_tp)
        if sends is None:
            return None
        queued_s = time.perf_counter()
        watch = self._watch
        if watch is None:
            _hand_over(service, req_id, sends, last, called_s, queued_s)
            return None

        def fail(reason: str) -> None:
            service.fail_request(req_id, [(target, wire_id) for target, _, wire_id in sends], reason)

        try:
            readiness = watch.watch(ready)
        except P2PError as exc:
            release(c for _, chunks, _ in sends for c in chunks)
            if not isinstance(exc, QueueFull):
                raise
            logger.error("request %s: KV not sent: %s", req_id, exc)  # the engine goes on, the request fails
            fail(str(exc))
            return None
        try:  # the Alloc goes out now; the writes once ``readiness`` is READY
            _hand_over(service, req_id, sends, last, called_s, queued_s, readiness)
        except Exception as exc:  # what it did not give the service, it released
            logger.exception("lmcache_p2p sender: handing a store to the send service failed")
            fail(f"handing a store to the sender failed: {type(exc).__name__}: {exc}")
        return None

    def _sends(self, keys: Sequence[CacheEngineKey], objs: list[MemoryObj], transfer_spec: Any, req_id: str,
               receiver_tp: int) -> list[tuple[Target, list[Chunk], str]] | None:
        """Each receiver's chunks of this store (and its wire id); None (nothing taken) on a bad spec."""
        layout = self._layout
        if layout is None or receiver_tp == layout.tp_size:  # the same split: rank r -> rank r, as is
            try:
                target = target_of(transfer_spec, self._tp_rank)
            except ValueError as exc:
                logger.error("request %s: bad transfer_spec, KV not sent: %s", req_id, exc)
                return None
            chunks = []
            for key, obj in zip(keys, objs):
                obj.ref_count_up()
                tensor = obj.tensor
                chunks.append(Chunk(chunk_key(key), _shape_of(obj, tensor), tensor, obj.ref_count_down))
            return [(target, chunks, "")]
        routes = kv_layout.routes_of(layout, receiver_tp)
        try:
            targets = [target_of(transfer_spec, piece.dst_rank) for piece in routes]
        except ValueError as exc:
            logger.error("request %s: bad transfer_spec, KV not sent: %s", req_id, exc)
            return None
        return [(target, [self._piece_chunk(key, obj, piece) for key, obj in zip(keys, objs)],
                 kv_layout.sub_request_id(req_id, piece)) for piece, target in zip(routes, targets)]

    def _piece_chunk(self, key: CacheEngineKey, obj: MemoryObj, piece: kv_layout.Piece) -> Chunk:
        """One chunk's share for one decoder rank: the chunk itself when it is all of our heads (or
        the MLA latent), else a packed copy of those heads (split on the sender: one copy, and the
        decoder rank's slot gets exactly its own chunk)."""
        layout = self._layout
        if layout.mla or (piece.head_lo, piece.head_hi) == (layout.head_start, layout.head_end):
            obj.ref_count_up()
            return Chunk(chunk_key(key), _shape_of(obj, obj.tensor), obj.tensor, obj.ref_count_down)
        packed = pack_heads(obj.tensor, piece.head_lo - layout.head_start, piece.head_hi - layout.head_start,
                            layout.heads_per_rank)
        shape = protocol.ChunkShape(shape=list(packed.shape), dtype=dtype_name(packed.dtype), nbytes=int(packed.nbytes),
                                    fmt=int(obj.get_memory_format().value))
        return Chunk(chunk_key(key), shape, packed, _no_reference)

    # ---- the sender serves no lookups ----
    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        return False

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        return 0

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        return None

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        return [None] * len(keys)

    def pin(self, key: CacheEngineKey) -> bool:
        return False

    def unpin(self, key: CacheEngineKey) -> bool:
        return False

    @property
    def arena(self) -> SendArena | None:
        """The VRAM arena chunks are stored in (p2p.buffer_device: cuda), else None."""
        return self._arena

    @property
    def service(self) -> SendService:
        return self._svc()


def _no_reference() -> None:
    """A packed copy holds no reference of LMCache's: nothing to drop."""


def _hand_over(service: SendService, req_id: str, sends: list[tuple[Target, list[Chunk], str]], last: bool,
               called_s: float, queued_s: float, ready: StoreReady | None = None) -> None:
    """Every receiver's chunks of one store to the service (``ready``: its GPU work, None when done). Whatever
    happens, each chunk is given to the service or released: an error releases those of the receivers not
    reached yet, then propagates."""
    if not sends and last:
        service.nothing_to_send(req_id)  # another rank feeds every decoder rank
    for n, (target, chunks, wire_id) in enumerate(sends):
        try:
            _submit_runs(service, req_id, target, chunks, last, called_s, wire_id, queued_s, ready)
        except BaseException:
            release(c for _, later, _ in sends[n + 1:] for c in later)
            raise


def _submit_runs(service: SendService, req_id: str, target: Target, chunks: list[Chunk], last: bool,
                 called_s: float, wire_id: str = "", queued_s: float = 0.0, ready: StoreReady | None = None) -> None:
    """Submit ``chunks`` to ``target``. One write moves sources of one device: a store that found the
    arena full midway (some chunks in VRAM, the rest in host memory) goes as consecutive batches,
    ``last`` on the final one. A refusal (P2PError) is logged; any other error propagates. Either way the
    runs not submitted are released (``submit`` releases its own batch's chunks when it raises)."""
    runs = _runs_by_device(chunks) or [chunks]  # an empty store still carries its last flag
    for i, run in enumerate(runs):
        try:
            service.submit(req_id, target, run, last and i == len(runs) - 1, called_s, wire_id, queued_s, ready)
        except BaseException as exc:
            release(c for later in runs[i + 1:] for c in later)
            if not isinstance(exc, P2PError):
                raise
            logger.error("request %s: KV not sent to %s: %s", req_id, target.endpoint, exc)
            break


def _runs_by_device(chunks: list[Chunk]) -> list[list[Chunk]]:
    """``chunks`` in order, cut wherever the device of their bytes changes."""
    runs: list[list[Chunk]] = []
    for c in chunks:
        if runs and runs[-1][-1].tensor.device == c.tensor.device:
            runs[-1].append(c)
        else:
            runs.append([c])
    return runs


def _shape_of(obj: MemoryObj, tensor: Any) -> protocol.ChunkShape:
    """``nbytes``: what the write moves. Not get_size(): a page of LMCache's paged allocator (the
    send arena) keeps the size of its first, full shape, so a partial last chunk would name a page."""
    return protocol.ChunkShape(shape=list(obj.get_shape()), dtype=dtype_name(obj.get_dtype()),
                               nbytes=int(tensor.nbytes), fmt=int(obj.get_memory_format().value))
