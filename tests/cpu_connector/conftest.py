"""Fixtures shared by the cpu_connector tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parents[1]
REPO_DIR = TESTS_DIR.parent
TINY_MODEL_DIR = REPO_DIR / "models" / "tiny-llama-seed0"

# tests/vllm_server.py is shared by end-to-end tests in several folders; site-packages holds an
# unrelated `tests` package, so it is imported as a top-level module. (pyproject's pytest
# `pythonpath = ["tests"]` would make this unnecessary.)
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny Llama of FACTS.md, built once into models/ (gitignored) and reused."""
    from lmcache_p2p.cli.tiny_model import build_tiny_model

    return build_tiny_model(TINY_MODEL_DIR, seed=0)
