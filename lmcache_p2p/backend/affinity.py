"""Keep the sender's service thread off the cores the engine thread is pinned to.

vLLM-CPU pins its worker's thread to the instance's core(s) (``VLLM_CPU_OMP_THREADS_BIND``), and a
thread inherits the CPU set of the thread that starts it, so the sender's service thread (and the
ZMQ I/O thread its sockets start) would share the engine's one core. Its work for a request (the
Alloc round trip, starting the writes, polling them every millisecond) then runs in the middle of
the prefill's own critical path: after the store, on that core, while the engine samples the first
token and answers. Measured (issue 9, 1P1D on 2 cores, concurrency 1): the prefill round trip
p50 ~1.5-2 ms shorter with the service thread on the other core, the transfer no slower.

So the service thread moves itself to the cores the engine thread is NOT pinned to, when it is
pinned to a strict subset of the machine (GPU servers and unpinned instances are left alone).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def thread_cpus() -> frozenset[int]:
    """The calling thread's CPU set (Linux: ``sched_getaffinity(0)`` is per thread); empty elsewhere."""
    getter = getattr(os, "sched_getaffinity", None)
    return frozenset(getter(0)) if getter is not None else frozenset()


def machine_cpus() -> frozenset[int]:
    return frozenset(range(os.cpu_count() or 1))


def cpus_off(engine_cpus: frozenset[int], machine: frozenset[int]) -> frozenset[int] | None:
    """Where a helper thread of an engine pinned to ``engine_cpus`` should run: every other CPU of
    the machine; None (stay) when the engine is not pinned (it may use every CPU) or nothing is left."""
    if not engine_cpus or engine_cpus >= machine:
        return None
    rest = machine - engine_cpus
    return rest or None


def leave_engine_cpus(engine_cpus: frozenset[int], name: str) -> frozenset[int] | None:
    """Move the calling thread off ``engine_cpus`` (see the module doc); returns its new CPU set, or
    None when it stays where it is. A refusal by the OS (a cpuset without those CPUs) is logged."""
    target = cpus_off(engine_cpus, machine_cpus())
    setter = getattr(os, "sched_setaffinity", None)
    if target is None or setter is None:
        return None
    try:
        setter(0, target)
    except OSError as exc:
        logger.info("%s stays on CPUs %s with the engine (cannot move to %s: %s)", name, sorted(engine_cpus),
                    sorted(target), exc)
        return None
    moved = thread_cpus()
    logger.info("%s runs on CPUs %s, off the engine's %s", name, sorted(moved), sorted(engine_cpus))
    return moved
