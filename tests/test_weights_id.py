"""The weights part of the KV fingerprint: copies agree, other weights under the same layout differ."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from lmcache_p2p import weights_id
from lmcache_p2p.weights_id import SAMPLE_BYTES, sample_offsets, weights_identity


@pytest.fixture(autouse=True)
def _fresh_cache():
    weights_identity.cache_clear()
    yield
    weights_identity.cache_clear()


def _model(folder: Path, payload: bytes, config: str = '{"hidden_size": 64}') -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(config)
    (folder / "model-00001-of-00002.safetensors").write_bytes(payload)
    (folder / "model-00002-of-00002.safetensors").write_bytes(payload[::-1])
    (folder / "tokenizer.json").write_text("{}")  # not weights: ignored
    return folder


def _payload(size: int, seed: int) -> bytes:
    return bytes((i * 31 + seed) % 251 for i in range(size))


def test_a_copy_of_the_same_files_has_the_same_identity(tmp_path) -> None:
    payload = _payload(3 * SAMPLE_BYTES + 123, seed=1)
    a = _model(tmp_path / "node-a" / "llama", payload)
    b = tmp_path / "node-b" / "llama"
    shutil.copytree(a, b)
    assert weights_identity(str(a)).startswith("files:")
    assert weights_identity(str(a)) == weights_identity(str(b))


def test_other_weights_of_the_same_shape_and_config_differ(tmp_path) -> None:
    size = 40 * SAMPLE_BYTES
    base = _payload(size, seed=1)
    tuned = bytearray(base)
    middle = sample_offsets(size)[8]  # a fine-tune changes (at least) the tensors a sample lands on
    tuned[middle + 100] ^= 0xFF
    a = _model(tmp_path / "a", base)
    b = _model(tmp_path / "b", bytes(tuned))
    assert weights_identity(str(a)) != weights_identity(str(b))


def test_another_config_with_the_same_weights_differs(tmp_path) -> None:
    payload = _payload(SAMPLE_BYTES, seed=2)
    assert (weights_identity(str(_model(tmp_path / "a", payload, '{"rope_theta": 1}')))
            != weights_identity(str(_model(tmp_path / "b", payload, '{"rope_theta": 2}'))))


def test_a_folder_without_weight_files_is_named_by_its_config(tmp_path) -> None:
    folder = tmp_path / "dummy"  # served with --load-format dummy: vLLM's seeded weights, config decides
    folder.mkdir()
    (folder / "config.json").write_text('{"hidden_size": 64}')
    assert weights_identity(str(folder)).startswith("config:")


@pytest.mark.parametrize("model", ["", "/nonexistent/model/folder", "not a valid/hub id!", "org/never-downloaded-xyz"])
def test_unknown_when_neither_a_folder_nor_a_cached_hub_model(model, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert weights_identity(model) == ""


def test_a_cached_hub_model_is_named_by_its_snapshot_commit(monkeypatch, tmp_path) -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    found = tmp_path / "models--org--llama" / "snapshots" / commit / "config.json"

    def lookup(repo_id: str, filename: str) -> str | None:
        return str(found) if (repo_id, filename) == ("org/llama", "config.json") else None

    hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setattr(hub, "try_to_load_from_cache", lookup)
    assert weights_identity("org/llama") == f"hub:{commit}"


def test_samples_cover_the_whole_file() -> None:
    size = 100 * SAMPLE_BYTES + 7
    offsets = sample_offsets(size)
    assert offsets[0] == 0 and offsets[-1] + SAMPLE_BYTES == size
    assert len(offsets) == weights_id.SAMPLES_PER_FILE
    assert sample_offsets(10) == [0]


def test_the_kv_fingerprint_carries_the_weights_identity(tmp_path) -> None:
    import types

    import torch

    from lmcache_p2p.backend.common import fingerprint_of

    folder = _model(tmp_path / "llama", _payload(SAMPLE_BYTES, seed=3))
    metadata = types.SimpleNamespace(model_name=str(folder), kv_shape=(2, 2, 256, 8, 64), kv_dtype=torch.bfloat16,
                                     use_mla=False, world_size=1, worker_id=0)
    fp = fingerprint_of(metadata)
    assert fp is not None and fp.weights == weights_identity(str(folder)) and fp.weights.startswith("files:")
