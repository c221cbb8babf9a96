"""The fault suite's cached reference outputs are keyed by what computes them (no processes)."""

from __future__ import annotations

import importlib.metadata

import fault_cluster
from fault_cluster import ClusterSpec, _cache_path


def test_a_reference_of_another_vllm_is_not_reused(tmp_path, monkeypatch):
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    prompts = [([1, 2, 3], 4)]
    spec = ClusterSpec()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.0")
    first = _cache_path(tmp_path / "cache", tmp_path, prompts, spec)
    assert _cache_path(tmp_path / "cache", tmp_path, prompts, spec) == first
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.0" if name == "vllm" else "1.0")
    assert _cache_path(tmp_path / "cache", tmp_path, prompts, spec) != first
    assert fault_cluster._engine_versions()[:3] == ["vllm==2.0", "torch==1.0", *fault_cluster._cpu_kernel_flags()][:3]


def test_a_reference_of_another_cpu_kind_is_not_reused(tmp_path, monkeypatch):
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    prompts, spec = [([1, 2, 3], 4)], ClusterSpec()
    monkeypatch.setattr(fault_cluster, "_cpu_kernel_flags", lambda: ["avx512_bf16", "avx512f"])
    without_amx = _cache_path(tmp_path, tmp_path, prompts, spec)
    monkeypatch.setattr(fault_cluster, "_cpu_kernel_flags", lambda: ["amx_bf16", "amx_tile", "avx512_bf16", "avx512f"])
    assert _cache_path(tmp_path, tmp_path, prompts, spec) != without_amx
