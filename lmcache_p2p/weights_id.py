"""Which weights a model holds, cheaply enough to compute at start-up: part of the KV fingerprint.

A chunk key names tokens and the model's name (its path as served), not its weights: two fine-tunes
at the same path (another node, a model replaced in place during a rolling upgrade) would otherwise
exchange KV and serve each other's answers. The identity is:

- a local folder: a hash of its ``config.json`` and, for each weights file at its top level
  (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``), its name, its size and 16 samples of
  64 KiB spread over it (the first holds a safetensors header: tensor names, shapes, offsets). Copies
  of the same files agree on every machine; a fine-tune differs in every sample that lands on a
  tensor it changed. Not a full hash (a 405B model is hundreds of GB): two models whose files differ
  only outside the sampled ranges (e.g. a few layers changed) are not told apart, so give each
  fine-tune its own path.
- a Hugging Face id: the commit of the cached snapshot holding its ``config.json``.
- "" when neither can be read (unknown: not compared).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLES_PER_FILE = 16
SAMPLE_BYTES = 64 << 10


@functools.lru_cache(maxsize=8)
def weights_identity(model: str) -> str:
    """``files:<hash>`` / ``config:<hash>`` for a local folder, ``hub:<commit>`` for a cached
    Hugging Face id, "" when unknown (see the module docstring)."""
    if not model:
        return ""
    try:
        path = Path(model).expanduser()
        if path.is_dir():
            return _folder_identity(path)
    except OSError as exc:
        logger.warning("model folder %s unreadable (%s): its weights are not part of the KV fingerprint", model, exc)
        return ""
    return _hub_identity(model)


def _folder_identity(path: Path) -> str:
    files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    config = path / "config.json"
    if not files and not config.is_file():
        return ""
    digest = hashlib.blake2b(digest_size=16)
    if config.is_file():
        digest.update(b"config.json\0" + config.read_bytes())
    for file in files:
        size = file.stat().st_size
        digest.update(f"\0{file.name}\0{size}\0".encode())
        with file.open("rb") as fh:
            for offset in sample_offsets(size):
                fh.seek(offset)
                digest.update(fh.read(SAMPLE_BYTES))
    return f"{'files' if files else 'config'}:{digest.hexdigest()}"


def sample_offsets(size: int) -> list[int]:
    """Where the samples of a file of ``size`` bytes start: the first at 0, the last ending at its end."""
    if size <= SAMPLE_BYTES:
        return [0]
    last = size - SAMPLE_BYTES
    return sorted({last * i // (SAMPLES_PER_FILE - 1) for i in range(SAMPLES_PER_FILE)})


def _hub_identity(model: str) -> str:
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, "config.json")
    except Exception:  # not a valid hub id, or no huggingface_hub: unknown
        return ""
    return f"hub:{Path(found).parent.name}" if isinstance(found, str) else ""
