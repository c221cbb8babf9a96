"""A prefiller's stores without the engine waiting for the GPU (``p2p.async_store``, VRAM send arena).

LMCache stores a step's KV in ``wait_for_save``, on the engine's thread, just after vLLM launched the step's
forward (and its sampling). Two waits in that call used to hold the engine's thread until the GPU had
finished: LMCache's adapter copies each request's slot mapping to the GPU from pageable memory
(``slot_mapping.to(self.device)``: a copy that synchronizes the engine's stream, so the CPU waits for the
whole forward), and the sender synchronized LMCache's store stream before it handed the chunks over. The
store's own CPU work (chunk hashes, pages, the gather's launches, the hand-over) then ran while the GPU had
nothing queued.

Here, each of those waits becomes an order on the GPU, where it is known to hold:

* every KV writer is ordered after the gather. vLLM's forward runs on the engine's stream, which waits for the
  store stream (``send_gather.gather_store``, and :func:`gpu_done` for any connector); LMCache's retrieve
  writes KV on the connector's ``load_stream`` (a prefiller with a cache backend still looks up), which
  :func:`gpu_done` also makes wait for the store stream, so no block freed after this step (a finished,
  aborted or preempted request's) is rewritten before the gather read it. Another vLLM KV connector beside
  LMCache (``MultiConnector``) writes on streams we cannot order: the store is then synchronous
  (:attr:`StoreMode.SYNC`);
* :func:`install_async_slot_mapping`: ``wait_for_save`` finds each request's slot mapping on the GPU already,
  copied from pinned memory without a wait, only when the engine's connector gathers through
  ``send_gather.gather_store`` (:attr:`StoreMode.WAIT_FREE`), whose store stream waits for the forward on the
  GPU. Any other connector (LMCache's ``VLLMPagedMemGPUConnectorV3``, ``use_gpu_connector_v3: true``, gathers
  on its store stream with no such wait) keeps LMCache's own wait (:attr:`StoreMode.HANDOFF`);
* the sender records an event after the store's GPU work and hands the batch to the send service at once,
  carrying a :class:`~lmcache_p2p.backend.send_types.StoreReady`: the service asks the receiver for slots
  (Alloc -> Grant) while the GPU still works, and posts the writes only once that is READY. :class:`StoreWatch`'s
  thread settles each store's readiness from its event, in order, off the engine's thread, each wait bounded by
  ``p2p.store_ready_timeout_s``: past it, or on a CUDA error, the readiness FAILED and the service fails the
  request (KvFailed, its granted slots cancelled, its pages back; the stalled work runs first on the store
  stream, so a page is rewritten only after it).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from lmcache_p2p.backend.send_types import StoreReady
from lmcache_p2p.errors import ClosedError, QueueFull

logger = logging.getLogger(__name__)

_INSTALLED_ATTR = "_lmcache_p2p_async_slot_mapping"
_MODE_ATTR = "_lmcache_p2p_store_mode"  # on the engine's GPU connector: how its latest store may be handed over
# How often the watch thread asks whether a store's GPU work is done: first after _READY_POLL_S, then twice as
# long each time up to _READY_POLL_MAX_S. Sleeping between questions leaves the engine's core and GIL alone (a
# blocking wait could not be bounded); a long store is asked about rarely, a short one is seen done soon.
_READY_POLL_S = 0.0001
_READY_POLL_MAX_S = 0.001
_IDLE_WAIT_S = 1.0  # the idle thread's wait for a store (a submission or close() wakes it at once)
_PLAIN_CONNECTOR = "LMCacheConnectorV1"  # vLLM's name for LMCache alone as the KV connector


class StoreMode(enum.Enum):
    """How a store's GPU work is waited for (decided per store by ``wait_for_save``'s wrapper)."""

    WAIT_FREE = "wait_free"  # slot mappings copied without a wait; the gather waits for the forward on the GPU
    HANDOFF = "handoff"  # LMCache's own wait for the forward; the watch thread waits for the gather
    SYNC = "sync"  # the engine's thread waits for the gather (a KV writer we cannot order exists)


def store_mode_of(connector: Any) -> StoreMode:
    """The mode ``wait_for_save``'s wrapper chose for ``connector``'s stores (SYNC when it never ran)."""
    mode = getattr(connector, _MODE_ATTR, None)
    return mode if isinstance(mode, StoreMode) else StoreMode.SYNC


def store_mode(adapter: Any) -> StoreMode | None:
    """The mode for this step's stores by LMCache's adapter; None when it stores nothing on a GPU here (a
    consumer, layerwise, no engine or a CPU engine)."""
    from lmcache_p2p.backend.send_gather import gathers

    engine = getattr(adapter, "lmcache_engine", None)
    if (engine is None or getattr(adapter, "kv_role", None) == "kv_consumer" or getattr(adapter, "use_layerwise", False)
            or not _is_cuda_device(getattr(adapter, "device", None))):
        return None
    transfer_config = getattr(getattr(adapter, "_vllm_config", None), "kv_transfer_config", None)
    if getattr(transfer_config, "kv_connector", None) != _PLAIN_CONNECTOR:
        return StoreMode.SYNC
    return StoreMode.WAIT_FREE if gathers(getattr(engine, "gpu_connector", None)) else StoreMode.HANDOFF


@dataclasses.dataclass
class _Watched:
    """One store whose GPU work is watched."""

    done: Callable[[], bool]  # whether its GPU work is done (raises on a CUDA error)
    readiness: StoreReady  # what its batches carry to the send service
    deadline: float  # monotonic: its GPU work must be done by then


class StoreWatch:
    """Settles each store's :class:`StoreReady` once its GPU work is done (READY) or cannot be (FAILED), in
    submission order, on one thread. It only watches: the store's batches are with the send service already.

    At most ``max_stores`` wait (``p2p.store_queue_max_stores``); each waits at most ``timeout_s``
    (``p2p.store_ready_timeout_s``) after its submission."""

    def __init__(self, name: str, *, timeout_s: float, max_stores: int, poll_s: float = _READY_POLL_S) -> None:
        self._timeout_s = timeout_s
        self._max_stores = max_stores
        self._poll_s = poll_s
        self._pending: collections.deque[_Watched] = collections.deque()
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, done: Callable[[], bool] | None) -> StoreReady | None:
        """The readiness of a store whose GPU work ``done()`` says is done, settled by this thread; None when
        ``done`` is None (nothing to wait for: ready now). ClosedError once closed; QueueFull when
        ``max_stores`` wait already (the caller hands the store's chunks back)."""
        with self._cond:
            if self._closed:
                raise ClosedError("sender backend is closed")
            if done is None:
                return None
            if len(self._pending) >= self._max_stores:
                raise QueueFull("p2p.store_queue_max_stores", (
                    f"{len(self._pending)} stores already wait for their GPU work (p2p.store_queue_max_stores "
                    f"{self._max_stores}); this one is not sent: raise p2p.store_queue_max_stores, or see why the "
                    "GPU is this far behind"))
            readiness = StoreReady()
            self._pending.append(_Watched(done, readiness, time.monotonic() + self._timeout_s))
            self._cond.notify()
            return readiness

    def waiting(self) -> int:
        """Stores submitted whose wait for their GPU work has not ended."""
        with self._cond:
            return len(self._pending)

    def close(self, timeout_s: float = 5.0) -> None:
        """Settle what was queued (its GPU work finishing or timing out), then stop the thread."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("lmcache_p2p sender: store watch thread did not stop within %.1fs", timeout_s)

    def _run(self) -> None:
        while (store := self._next()) is not None:
            problem = self._wait_ready(store)
            if problem:
                logger.error("lmcache_p2p sender: %s; its KV is not sent", problem)
                store.readiness.set_failed(problem)
            else:
                store.readiness.set_ready()

    def _next(self) -> _Watched | None:
        """The oldest store, left queued until its wait ends (it counts against ``max_stores``); None once
        closed and empty."""
        with self._cond:
            while not self._pending and not self._closed:
                self._cond.wait(_IDLE_WAIT_S)
            return self._pending[0] if self._pending else None

    def _wait_ready(self, store: _Watched) -> str:
        """"" once the store's GPU work is done; else why it will never be sent."""
        poll_s = self._poll_s
        try:
            while not store.done():
                if time.monotonic() >= store.deadline:
                    return (f"a store's GPU work did not finish within {self._timeout_s:g}s "
                            "(p2p.store_ready_timeout_s)")
                time.sleep(poll_s)
                poll_s = min(2 * poll_s, max(self._poll_s, _READY_POLL_MAX_S))
        except Exception as exc:  # a CUDA error: the chunks' bytes cannot be trusted
            logger.exception("lmcache_p2p sender: a store's GPU work failed")
            return f"a store's GPU work failed: {type(exc).__name__}: {exc}"
        finally:
            with self._cond:
                self._pending.popleft()
        return ""


def gpu_done(store_stream: Any, load_stream: Any = None) -> Callable[[], bool]:
    """Called on the engine's thread after a store's GPU work was queued: the engine's stream (the forward) and
    ``load_stream`` (LMCache's retrieve) are made to wait for ``store_stream`` on the GPU, and an event is
    recorded; the returned callable says whether it completed (it never blocks)."""
    import torch

    engine = torch.cuda.current_stream()
    engine.wait_stream(store_stream)
    if load_stream is not None:
        load_stream.wait_stream(store_stream)
    event = torch.cuda.Event()
    event.record(engine)
    return event.query


def install_async_slot_mapping(adapter_cls: Any = None, to_device: Callable[[Any, Any], Any] | None = None
                               ) -> Callable[[], None]:
    """Make LMCache's ``wait_for_save`` (default ``LMCacheConnectorV1Impl``'s) choose each step's
    :class:`StoreMode` (:func:`store_mode`, marked on the engine's GPU connector for the sender) and, in
    WAIT_FREE, find each request's slot mapping on its GPU, copied without a wait (:func:`_pinned_to_device`);
    returns the undo. A no-op (and a no-op undo) when LMCache has no such adapter or it is already installed:
    every store is then synchronous (SYNC)."""
    if adapter_cls is None:
        try:
            from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl as adapter_cls
        except ImportError:
            logger.info("lmcache_p2p sender: no LMCacheConnectorV1Impl in this LMCache; stores wait as before")
            return lambda: None
    original = adapter_cls.__dict__.get("wait_for_save")
    if original is None or adapter_cls.__dict__.get(_INSTALLED_ATTR):
        return lambda: None
    move = to_device or _pinned_to_device

    @functools.wraps(original)
    def wait_for_save(self: Any) -> Any:
        mode = store_mode(self)
        if mode is not None:
            _mark(self.lmcache_engine, mode)
        if mode is StoreMode.WAIT_FREE:
            slot_mappings_to_device(self, move)
        return original(self)

    adapter_cls.wait_for_save = wait_for_save
    setattr(adapter_cls, _INSTALLED_ATTR, True)
    logger.info("lmcache_p2p sender: %s.wait_for_save stores without the engine waiting for the store's GPU work",
                adapter_cls.__name__)

    def undo() -> None:
        adapter_cls.wait_for_save = original
        delattr(adapter_cls, _INSTALLED_ATTR)

    return undo


def _mark(engine: Any, mode: StoreMode) -> None:
    connector = getattr(engine, "gpu_connector", None)
    if connector is not None and getattr(connector, _MODE_ATTR, None) is not mode:
        if mode is not StoreMode.WAIT_FREE and not hasattr(connector, _MODE_ATTR):
            logger.info("lmcache_p2p sender: %s stores keep LMCache's wait for the forward (%s)",
                        type(connector).__name__, mode.value)
        setattr(connector, _MODE_ATTR, mode)


def slot_mappings_to_device(adapter: Any, move: Callable[[Any, Any], Any]) -> None:
    """Each request's slot mapping of this step, on the adapter's device (only for WAIT_FREE stores)."""
    device = getattr(adapter, "device", None)
    metadata = adapter._parent._get_connector_metadata()
    for request in getattr(metadata, "requests", ()):
        slots = getattr(request, "slot_mapping", None)
        if slots is not None and getattr(slots, "device", None) is not None and slots.device.type == "cpu":
            request.slot_mapping = move(slots, device)


def _is_cuda_device(device: Any) -> bool:
    if device is None:
        return False
    import torch

    return torch.device(device).type == "cuda"


def _pinned_to_device(slots: Any, device: Any) -> Any:
    """A copy on ``device`` queued on the current stream from pinned memory: the CPU does not wait. (PyTorch's
    pinned allocator keeps the staging memory until the copy ran.)"""
    return slots.pin_memory().to(device, non_blocking=True)
