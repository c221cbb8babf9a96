"""Fixtures shared across test folders."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_DIR = Path(__file__).resolve().parents[1]
TINY_MODEL_DIR = REPO_DIR / "models" / "tiny-llama"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny Llama of FACTS.md, built once into models/ (gitignored) and reused (same as the demo's)."""
    from lmcache_p2p.cli.tiny_model import build_tiny_model

    return build_tiny_model(TINY_MODEL_DIR, seed=0)
