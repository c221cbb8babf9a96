"""The sender's service thread leaves the cores its engine thread is pinned to (backend/affinity.py)."""

from __future__ import annotations

import os
import threading

import pytest

from lmcache_p2p.backend.affinity import cpus_off, leave_engine_cpus, thread_cpus


def test_cpus_off_is_the_rest_of_the_machine_when_the_engine_is_pinned() -> None:
    assert cpus_off(frozenset({0}), frozenset({0, 1})) == {1}
    assert cpus_off(frozenset({1, 2}), frozenset({0, 1, 2, 3})) == {0, 3}


@pytest.mark.parametrize("engine", [frozenset({0, 1}), frozenset(), frozenset({0, 1, 2})])
def test_an_unpinned_engine_keeps_its_helpers_where_they_are(engine: frozenset[int]) -> None:
    assert cpus_off(engine, frozenset({0, 1})) is None


def _on_pinned_thread(cpus: set[int], body) -> list:
    """Run ``body`` on a fresh thread pinned to ``cpus`` (as vLLM-CPU pins its worker thread)."""
    out: list = []

    def run() -> None:
        os.sched_setaffinity(0, cpus)
        out.append(body())

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    return out


needs_two_cpus = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                    reason="needs Linux and at least 2 usable CPUs")


@needs_two_cpus
def test_leave_engine_cpus_moves_the_calling_thread_off_them() -> None:
    first = min(os.sched_getaffinity(0))
    [(moved, now)] = _on_pinned_thread({first}, lambda: (leave_engine_cpus(thread_cpus(), "t"), thread_cpus()))
    assert moved == now
    assert first not in now and now
