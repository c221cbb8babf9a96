"""Fixtures shared across test folders."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_DIR = Path(__file__).resolve().parents[1]
TINY_MODEL_DIR = REPO_DIR / "models" / "tiny-llama"


def pytest_configure(config: pytest.Config) -> None:
    # Registered here rather than in pyproject.toml, whose hash keys the venv's set-up stamp.
    config.addinivalue_line(
        "markers",
        "long: the full matrix of an expensive test (many vLLM starts); `make test-long` runs it, "
        "`make test` (CI) runs the short form beside it",
    )


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny Llama of FACTS.md, built once into models/ (gitignored) and reused (same as the demo's)."""
    from lmcache_p2p.cli.tiny_model import build_tiny_model

    return build_tiny_model(TINY_MODEL_DIR, seed=0)
