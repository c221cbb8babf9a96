"""A prefiller's stores without the engine waiting for the GPU (``p2p.async_store``, VRAM send arena).

LMCache stores a step's KV in ``wait_for_save``, on the engine's thread, just after vLLM launched the step's
forward (and its sampling). Two waits in that call used to hold the engine's thread until the GPU had
finished: LMCache's adapter copies each request's slot mapping to the GPU from pageable memory
(``slot_mapping.to(self.device)``: a copy that synchronizes the engine's stream, so the CPU waits for the
whole forward), and the sender synchronized LMCache's store stream before it handed the chunks over. The
store's own CPU work (chunk hashes, pages, the gather's launches, the hand-over) then ran while the GPU had
nothing queued: at every chunked-prefill step the GPU idled ~6 ms, and the last step's store delayed the
first token (run 12 on one H200: 24 ms per 32k prompt, 0.13 ms for the single instance).

Here, each of those waits becomes an order on the GPU:

* :func:`install_async_slot_mapping`: ``wait_for_save`` finds each request's slot mapping on the GPU already,
  copied from pinned memory without a wait, so LMCache's own ``.to`` is a no-op;
* ``send_gather.gather_store``: the store stream waits (on the GPU) for the engine's stream, so the gather
  reads what the forward wrote, and the engine's stream waits for the gather, so no block the engine frees
  after this step (a finished or preempted request's) is written by a later step before it was read;
* the sender records an event after the store's GPU work and :class:`StoreHandoff`'s thread hands the batch to
  the send service once that event completed: in order, off the engine's thread.

The slot mapping goes async only with the batched gather (it is what orders the store stream after the
forward; LMCache's own ``from_gpu`` relies on the wait).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from lmcache_p2p.errors import ClosedError

logger = logging.getLogger(__name__)

_INSTALLED_ATTR = "_lmcache_p2p_async_slot_mapping"


class StoreHandoff:
    """Runs each store's hand-over in submission order, each once its GPU work is done, on one thread."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], None] | None, Callable[[], None],
                                             Callable[[], None]] | None] = queue.SimpleQueue()
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, ready: Callable[[], None] | None, hand_over: Callable[[], None],
               release: Callable[[], None]) -> None:
        """Queue ``hand_over`` to run after ``ready`` (which blocks until the store's GPU work is done; None:
        nothing to wait for) and after every earlier submission. ``release`` hands the chunks back when
        ``hand_over`` cannot run. ClosedError (after ``release``) once closed."""
        with self._lock:
            if not self._closed:
                self._queue.put((ready, hand_over, release))
                return
        release()
        raise ClosedError("sender backend is closed")

    def close(self, timeout_s: float = 5.0) -> None:
        """Run what was queued (its GPU work finishing), then stop the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("lmcache_p2p sender: store hand-over thread did not stop within %.1fs", timeout_s)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            ready, hand_over, release = item
            try:
                if ready is not None:
                    ready()
            except Exception:  # a CUDA error: the chunks' bytes cannot be trusted; the proxy's KV wait fails it
                logger.exception("lmcache_p2p sender: a store's GPU work failed; its KV is not sent")
                release()
                continue
            try:
                hand_over()
            except Exception:
                logger.exception("lmcache_p2p sender: handing a store to the send service failed")


def gpu_done(store_stream: Any) -> Callable[[], None]:
    """Called on the engine's thread after a store's GPU work was queued: the engine's stream is made to wait
    for ``store_stream`` (on the GPU) and an event recorded on it; the returned callable blocks until it
    completed (the GIL released)."""
    import torch

    engine = torch.cuda.current_stream()
    engine.wait_stream(store_stream)
    event = torch.cuda.Event()
    event.record(engine)
    return event.synchronize


def install_async_slot_mapping(adapter_cls: Any = None, to_device: Callable[[Any, Any], Any] | None = None
                               ) -> Callable[[], None]:
    """Make LMCache's ``wait_for_save`` (default ``LMCacheConnectorV1Impl``'s) find each request's slot mapping
    on its GPU, copied without a wait (:func:`_pinned_to_device`); returns the undo. A no-op (and a no-op undo)
    when LMCache has no such adapter or it is already installed."""
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
        slot_mappings_to_device(self, move)
        return original(self)

    adapter_cls.wait_for_save = wait_for_save
    setattr(adapter_cls, _INSTALLED_ATTR, True)
    logger.info("lmcache_p2p sender: %s.wait_for_save stores without waiting for the step's forward",
                adapter_cls.__name__)

    def undo() -> None:
        adapter_cls.wait_for_save = original
        delattr(adapter_cls, _INSTALLED_ATTR)

    return undo


def slot_mappings_to_device(adapter: Any, move: Callable[[Any, Any], Any]) -> None:
    """Each request's slot mapping of this step, on the adapter's device (a producer that stores whole steps
    on a GPU; any other adapter is left as it is)."""
    device = getattr(adapter, "device", None)
    if (getattr(adapter, "kv_role", None) == "kv_consumer" or getattr(adapter, "use_layerwise", False)
            or getattr(adapter, "lmcache_engine", None) is None or not _is_cuda_device(device)):
        return
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
