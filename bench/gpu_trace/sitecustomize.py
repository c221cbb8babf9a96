"""Per-step trace of a vLLM engine process for bench/e2e_gpu.py (``--trace``); inert unless E2E_GPU_TRACE_DIR is set.

Put this folder on PYTHONPATH with E2E_GPU_TRACE_DIR=DIR: every Python process that imports the modules
below writes DIR/trace-<pid>.jsonl, one JSON object a line, times from ``time.perf_counter()`` (the
system's monotonic clock, the same in every process of the machine). Nothing here changes what the
engine computes: each wrapper times the original call and returns its result.

  {"ev": "proc", "argv": [...]}                            once per process
  {"ev": "exec", "t0", "t1", "reqs": {req_id: tokens}}     GPUModelRunner.execute_model (reqs: > 1 token)
  {"ev": "sample", "t0", "t1"}                             GPUModelRunner.sample_tokens
  {"ev": "first", "t", "reqs": [req_id]}                   Scheduler.update_from_output: requests whose
                                                           first output token the scheduler now holds
  {"ev": "save", "t0", "t1"}                               LMCache's wait_for_save (the step's stores)
  {"ev": "store", "t0", "t1", "req", "tokens"}             LMCacheEngine.store
  {"ev": "gather", "t0", "t1", "gpu_ms", "chunks"}         the GPU connector's batched_from_gpu; gpu_ms:
                                                           CUDA events around it on LMCache's store stream
  {"ev": "sync", "t0", "t1"}                               lmcache_p2p SenderBackend._wait_for_store
  {"ev": "submit", "t0", "t1", "chunks", "host_chunks"}    SenderBackend.batched_submit_put_task
  {"ev": "gpu_step", "t0", "gpu_ms", "gap_ms"}             CUDA events on the engine's stream at
                                                           execute_model entry/exit: the step's GPU span and
                                                           the stream's time since the previous step ended
"""

from __future__ import annotations

import functools
import importlib.abc
import json
import os
import sys
import threading
import time

_DIR = os.environ.get("E2E_GPU_TRACE_DIR")
_lock = threading.Lock()
_file = None
_pending: list = []  # (kind, fields, start event, end event, extra) until the end event completes
_last_step_end = [None]


def _emit(record: dict) -> None:
    global _file
    with _lock:
        if _file is None:
            os.makedirs(_DIR, exist_ok=True)
            _file = open(os.path.join(_DIR, f"trace-{os.getpid()}.jsonl"), "a", buffering=1)
            _file.write(json.dumps({"ev": "proc", "argv": sys.argv[:40], "t": time.perf_counter()}) + "\n")
        _file.write(json.dumps(record) + "\n")


def _resolve_pending() -> None:
    """Emit the event pairs whose end the GPU has reached (never waits)."""
    if _capturing():
        return
    keep = []
    for kind, fields, start, end, extra in _pending:
        try:
            if not end.query():
                keep.append((kind, fields, start, end, extra))
                continue
            fields["gpu_ms"] = round(start.elapsed_time(end), 3)
            if extra is not None:
                fields["gap_ms"] = round(extra.elapsed_time(start), 3)
            _emit(fields)
        except Exception:  # noqa: BLE001 - a trace never breaks the engine
            pass
    _pending[:] = keep[-256:]


def _timed(ev: str, details=None):
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                record = {"ev": ev, "t0": t0, "t1": time.perf_counter(), "cpu_ms": round((time.thread_time() - c0) * 1e3, 3)}
                if details is not None:
                    try:
                        record.update(details(*args, **kwargs))
                    except Exception as exc:  # noqa: BLE001
                        record["detail_error"] = repr(exc)[:200]
                _emit(record)
        return inner
    return wrap


def _capturing() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_current_stream_capturing())
    except Exception:  # noqa: BLE001
        return True


def _event():
    import torch

    return torch.cuda.Event(enable_timing=True)


def _patch_runner(module) -> None:
    cls = module.GPUModelRunner
    orig = cls.execute_model

    @functools.wraps(orig)
    def execute_model(self, scheduler_output, *args, **kwargs):
        if kwargs.get("dummy_run") or _capturing():  # profiling and CUDA graph capture: no events there
            return orig(self, scheduler_output, *args, **kwargs)
        t0 = time.perf_counter()
        start = end = None
        try:
            import torch

            start = _event()
            start.record(torch.cuda.current_stream())
        except Exception:  # noqa: BLE001
            start = None
        try:
            return orig(self, scheduler_output, *args, **kwargs)
        finally:
            t1 = time.perf_counter()
            try:
                reqs = {str(k): int(v) for k, v in scheduler_output.num_scheduled_tokens.items() if int(v) > 1}
                _emit({"ev": "exec", "t0": t0, "t1": t1, "reqs": reqs,
                       "total": int(scheduler_output.total_num_scheduled_tokens)})
                if start is not None:
                    import torch

                    end = _event()
                    end.record(torch.cuda.current_stream())
                    _pending.append(("gpu_step", {"ev": "gpu_step", "t0": t0, "prefill": bool(reqs)}, start, end,
                                     _last_step_end[0]))
                    _last_step_end[0] = end
                _resolve_pending()
            except Exception:  # noqa: BLE001
                pass

    cls.execute_model = execute_model
    if hasattr(cls, "sample_tokens"):
        cls.sample_tokens = _timed("sample")(cls.sample_tokens)


def _patch_scheduler(module) -> None:
    cls = module.Scheduler
    orig = cls.update_from_output

    @functools.wraps(orig)
    def update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs):
        t = time.perf_counter()
        try:
            firsts = []
            sampled = model_runner_output.sampled_token_ids or []
            for i, req_id in enumerate(model_runner_output.req_ids or []):
                req = self.requests.get(req_id)
                if req is not None and i < len(sampled) and len(sampled[i]) and req.num_output_tokens == 0:
                    firsts.append(str(req_id))
            if firsts:
                _emit({"ev": "first", "t": t, "reqs": firsts})
        except Exception as exc:  # noqa: BLE001
            _emit({"ev": "first_error", "t": t, "error": repr(exc)[:200]})
        return orig(self, scheduler_output, model_runner_output, *args, **kwargs)

    cls.update_from_output = update_from_output


def _patch_adapter(module) -> None:
    cls = module.LMCacheConnectorV1Impl
    cls.wait_for_save = _timed("save")(cls.wait_for_save)


def _store_details(self, tokens=None, *args, **kwargs):
    return {"req": str(kwargs.get("req_id")), "tokens": len(tokens) if tokens is not None else None}


def _patch_engine(module) -> None:
    cls = module.LMCacheEngine
    cls.store = _timed("store", _store_details)(cls.store)


def _timed_gather(orig):
    """``orig(connector, memory_objs, ...)`` timed as a "gather" event (wall, CPU, span on the store stream)."""
    def batched_from_gpu(self, memory_objs, *args, _orig=orig, **kwargs):
        t0, c0 = time.perf_counter(), time.thread_time()
        start = end = None
        stream = getattr(self, "store_stream", None)
        try:
            if stream is not None:
                start = _event()
                start.record(stream)
        except Exception:  # noqa: BLE001
            start = None
        try:
            return _orig(self, memory_objs, *args, **kwargs)
        finally:
            fields = {"ev": "gather", "t0": t0, "t1": time.perf_counter(), "chunks": len(memory_objs),
                      "cpu_ms": round((time.thread_time() - c0) * 1e3, 3)}
            try:
                if start is not None:
                    end = _event()
                    end.record(stream)
                    _pending.append(("gather", fields, start, end, None))
                else:
                    _emit(fields)
            except Exception:  # noqa: BLE001
                _emit(fields)

    return functools.wraps(orig)(batched_from_gpu)


def _patch_gpu_connectors(module) -> None:
    for name in ("VLLMPagedMemGPUConnectorV2", "VLLMPagedMemGPUConnectorV3"):
        cls = getattr(module, name, None)
        if cls is None or "batched_from_gpu" not in cls.__dict__:
            continue
        cls.batched_from_gpu = _timed_gather(cls.batched_from_gpu)


def _patch_send_gather(module) -> None:
    """lmcache_p2p's store pass replaces the connector's batched_from_gpu (and so the wrapper above): its own
    body is timed the same way."""
    module.gather_store = _timed_gather(module.gather_store)


def _submit_details(self, keys, objs, *args, **kwargs):
    return {"chunks": len(objs), "host_chunks": sum(1 for o in objs if not o.tensor.is_cuda)}


def _patch_sender(module) -> None:
    cls = module.SenderBackend
    cls._wait_for_store = _timed("sync")(cls._wait_for_store)
    cls.batched_submit_put_task = _timed("submit", _submit_details)(cls.batched_submit_put_task)
    orig_sync = cls._wait_for_store

    @functools.wraps(orig_sync)
    def wait_then_resolve(self, *args, **kwargs):
        try:
            return orig_sync(self, *args, **kwargs)
        finally:
            _resolve_pending()

    cls._wait_for_store = wait_then_resolve


def _patch_receive_service(module) -> None:
    """E2E_GPU_RECEIVER_SPIN_S: the receiver thread's spin window after activity (an A/B knob)."""
    value = os.environ.get("E2E_GPU_RECEIVER_SPIN_S")
    if value is not None and hasattr(module, "_SPIN_AFTER_ACTIVITY_S"):
        module._SPIN_AFTER_ACTIVITY_S = float(value)
        _emit({"ev": "knob", "name": "receiver_spin_s", "value": float(value), "t": time.perf_counter()})


_PATCHES = {
    "lmcache_p2p.backend.receive_service": _patch_receive_service,
    "vllm.v1.worker.gpu_model_runner": _patch_runner,
    "vllm.v1.worker.gpu.model_runner": _patch_runner,  # vLLM's model runner v2 (the default where it applies)
    "vllm.v1.core.sched.scheduler": _patch_scheduler,
    "lmcache.integration.vllm.vllm_v1_adapter": _patch_adapter,
    "lmcache.v1.cache_engine": _patch_engine,
    "lmcache.v1.gpu_connector.gpu_connectors": _patch_gpu_connectors,
    "lmcache_p2p.backend.sender": _patch_sender,
    "lmcache_p2p.backend.send_gather": _patch_send_gather,
}


class _Finder(importlib.abc.MetaPathFinder):
    """Patches each module of _PATCHES right after it is executed."""

    def find_spec(self, name, path, target=None):
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_and_patch(module):
            exec_module(module)
            try:
                patch(module)
                _emit({"ev": "patched", "module": name, "t": time.perf_counter()})
            except Exception as exc:  # noqa: BLE001
                _emit({"ev": "patch_error", "module": name, "error": repr(exc)[:300]})

        loader.exec_module = exec_and_patch
        return spec


if _DIR:
    sys.meta_path.insert(0, _Finder())
