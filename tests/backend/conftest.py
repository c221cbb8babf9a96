"""Two real LMCache engines in two processes, with the plugin loaded from YAML files.

Harness rules: a helper that fails to start its process kills it (and whatever it started
before); every wait has a generous, named deadline (a busy 2-core machine runs the engines at
a fraction of their speed); the module-shared ``pair`` is checked clean before each test and
rebuilt when a previous test left it dirty, so tests never depend on their order.
"""

from __future__ import annotations

import pytest
from engines import Pair

_SHARED_PAIR_OPTS = dict(buffer_size="64MB", alloc_timeout_s=5.0)


@pytest.fixture(scope="module")
def _shared_pair(tmp_path_factory):
    holder: dict[str, Pair] = {}
    yield holder, tmp_path_factory
    if "pair" in holder:
        holder["pair"].close()


@pytest.fixture
def pair(_shared_pair):
    """A pair shared by the tests of a module (engines take ~20 s each to start on 2 cores).

    Before each test the pair must be clean (every slot free, nothing pending); a pair that a
    previous test left dirty or dead is replaced, so no test depends on what ran before it.
    """
    holder, factory = _shared_pair
    current = holder.get("pair")
    if current is None or not current.is_clean():
        if current is not None:
            current.close()
        holder.pop("pair", None)
        holder["pair"] = Pair(factory.mktemp("pair"), **_SHARED_PAIR_OPTS)
    return holder["pair"]


@pytest.fixture
def make_pair(tmp_path):
    """A pair of the test's own, for tests that change settings or kill processes."""
    made: list[Pair] = []

    def make(buffer_size: str = "64MB", alloc_timeout_s: float = 5.0, **receiver_opts) -> Pair:
        sub = tmp_path / f"pair{len(made)}"
        sub.mkdir()
        made.append(Pair(sub, buffer_size, alloc_timeout_s, **receiver_opts))
        return made[-1]

    yield make
    for p in made:
        p.close()
