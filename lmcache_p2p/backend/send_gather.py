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
The kernel is the one the connector's module calls, checked at install time: its parameters must be
exactly the ones this call passes (LMCache 0.5.3's ``lmcache.c_ops``), or nothing is installed (one
log line) and LMCache's own ``from_gpu`` stores. LMCache 0.5.6's kernel takes ``block_stride_elems``
too (the block stride of a padded layout): the same call would gather other bytes there.

Streams. The store stream waits for the engine's stream before the gather, and the engine's stream for the
store stream after it, both on the GPU: the gather then never depends on the engine's thread having waited
for the forward (``store_ready.py`` takes that wait away, for a connector that gathers here only:
:func:`gathers`), and vLLM, which frees a finished request's blocks at once, never rewrites one before it
was read. LMCache's own load stream is ordered after the store stream by the sender
(``store_ready.gpu_done``).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

_INSTALLED_ATTR = "_lmcache_p2p_batched_gather"
_OURS_ATTR = "_lmcache_p2p_gather"  # on our batched_from_gpu: a connector whose class has it gathers through us
# The kernel's parameters as LMCache 0.5.3's ``lmcache.c_ops.multi_layer_kv_transfer`` names them: exactly what
# ``_kernel_call`` passes. A kernel with any other list (0.5.6's adds ``block_stride_elems``, a padded layout's
# block stride) would gather other bytes from the same call, so the pass is then not installed.
KERNEL_PARAMETERS = ("key_value", "key_value_ptrs", "slot_mapping", "paged_memory_device", "page_buffer_size",
                     "direction", "engine_kv_format", "block_size", "head_size", "skip_prefix_n_tokens")
_KERNEL_HOLDERS = ("lmc_ops", "device_ops")  # what gpu_connectors.py calls its kernels through (0.5.3, 0.5.6)


@dataclasses.dataclass(frozen=True)
class GatherKernel:
    """LMCache's ``multi_layer_kv_transfer`` as the connector's module calls it, and its D2H direction."""

    transfer: Callable[..., None]
    d2h: Any
    source: str  # for the log: where it was found


def resolve_kernel(connector_cls: Any) -> GatherKernel | str:
    """The kernel ``connector_cls``'s own ``from_gpu`` calls, if its parameters are :data:`KERNEL_PARAMETERS`;
    else why not (a sentence for the log)."""
    module = sys.modules.get(getattr(connector_cls, "__module__", ""), None)
    names = vars(module) if module is not None else {}
    holder_name = next((n for n in _KERNEL_HOLDERS if hasattr(names.get(n), "multi_layer_kv_transfer")), None)
    if holder_name is None:
        return f"{getattr(module, '__name__', '?')} calls no multi_layer_kv_transfer through {' or '.join(_KERNEL_HOLDERS)}"
    holder = names[holder_name]
    source = f"{getattr(holder, '__name__', holder_name)}.multi_layer_kv_transfer"
    transfer = holder.multi_layer_kv_transfer
    params = parameters_of(transfer)
    if params != KERNEL_PARAMETERS:
        return (f"{source} takes ({', '.join(params) if params else 'an unreadable signature'}), not the "
                f"({', '.join(KERNEL_PARAMETERS)}) the pass calls it with")
    direction = getattr(holder, "TransferDirection", None) or getattr(names.get("lmcache_native"), "TransferDirection",
                                                                       None)
    d2h = getattr(direction, "D2H", None)
    if d2h is None:
        return f"{source} has no TransferDirection.D2H beside it"
    return GatherKernel(transfer, d2h, source)


def parameters_of(fn: Any) -> tuple[str, ...]:
    """``fn``'s parameter names (``*args`` / ``**kwargs`` spelled so); a compiled pybind11 function's from the
    signature line its docstring starts with. Empty when neither says."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return _doc_parameters(getattr(fn, "__doc__", None) or "", getattr(fn, "__name__", ""))
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return tuple(stars.get(p.kind, "") + p.name for p in sig.parameters.values())


def _doc_parameters(doc: str, name: str) -> tuple[str, ...]:
    first = doc.strip().splitlines()[0] if doc.strip() else ""
    if not name or not first.startswith(name + "(") or ")" not in first:
        return ()
    inside = first[len(name) + 1:first.rindex(")")]
    params, depth, current = [], 0, ""
    for ch in inside:  # split at top-level commas: types such as Dict[str, int] hold commas too
        depth += ch in "([{<"
        depth -= ch in ")]}>"
        if ch == "," and depth == 0:
            params.append(current)
            current = ""
        else:
            current += ch
    params.append(current)
    names = tuple(re.split(r"[:=]", p, maxsplit=1)[0].strip() for p in params if p.strip())
    return names if all(re.fullmatch(r"\*{0,2}\w+", n) for n in names) else ()


def install(connector_cls: Any = None, transfer: Callable[..., None] | None = None,
            on_device: Callable[[Any], bool] | None = None) -> Callable[[], None]:
    """Make ``connector_cls`` (default LMCache's ``VLLMPagedMemGPUConnectorV2``) gather a store's GPU
    chunks in one pass; returns the undo. A no-op (returning a no-op undo), with one log line, when LMCache
    has no such class, its connector lacks what the pass needs or its kernel is not the one the pass
    knows (:func:`resolve_kernel`; another LMCache version): the original runs. ``transfer`` replaces
    the kernel call (tests)."""
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
    if transfer is None:
        kernel = resolve_kernel(connector_cls)
        if isinstance(kernel, str):
            logger.warning("lmcache_p2p sender: the one-pass store gather is not installed (LMCache's own "
                           "per-chunk from_gpu stores, and the engine waits for each step's forward): %s", kernel)
            return lambda: None
        transfer = _kernel_call(kernel)
    original = connector_cls.__dict__.get("batched_from_gpu")
    kernel_call = transfer

    def batched_from_gpu(self: Any, memory_objs: Sequence[Any], starts: Sequence[int], ends: Sequence[int],
                         **kwargs: Any) -> None:
        gather_store(self, memory_objs, starts, ends, kwargs, kernel_call, on_device)

    setattr(batched_from_gpu, _OURS_ATTR, True)
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


def gathers(connector: Any) -> bool:
    """Whether ``connector`` (an engine's GPU connector) stores through :func:`gather_store`: its class, or
    a base it inherits the method from, was installed. LMCache's ``VLLMPagedMemGPUConnectorV3`` (LMCache's
    ``use_gpu_connector_v3``) and every other connector are not."""
    method = getattr(type(connector), "batched_from_gpu", None)
    return bool(getattr(method, _OURS_ATTR, False))


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


def _kernel_call(kernel: GatherKernel) -> Callable[..., None]:
    """``from_gpu``'s kernel call for a destination without the intermediate buffer (LMCache 0.5.3's)."""
    transfer, d2h = kernel.transfer, kernel.d2h

    def call(connector: Any, dst: Any, pointers: Any, slots: Any) -> None:
        transfer(dst, pointers, slots, connector.kvcaches[0].device, connector.page_buffer_size, d2h,
                 connector.engine_kv_format, block_size=connector.block_size, head_size=connector.head_size)

    return call
