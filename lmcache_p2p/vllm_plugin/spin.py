"""Cap how long vLLM's idle workers busy-loop (``LMCACHE_P2P_VLLM_SPIN_S``).

vLLM's shared-memory message queue (``vllm.distributed.device_communicators.shm_broadcast``) lets
a reader spin with ``sched_yield`` for ``busy_loop_s`` (1 s, not configurable) after every read
before it waits on a socket the writer pings on every write. With one instance per core that is
free; with prefillers, decoders, their API servers and engine cores and the proxy sharing a few
cores, each instance keeps its core busy for a second after every step, and the proxy's event loop
and the other processes wait for CPU (a time-to-first-token tail).
Capping the spin to a few milliseconds keeps it during a running batch (steps follow each other
well within it) and sleeps otherwise; a wake-up then costs one socket ping.

vLLM's ping can be lost (a PUB socket with a send high-water mark of 1 drops a ping while the
previous one is still queued); an idle reader then finds the data only at its next recheck,
``SHM_READER_RECHECK_INTERVAL_MS``. With vLLM's long spin a reader is rarely idle while work
arrives; with a short spin it often is, and a lost ping stalls every request on that instance for
the whole recheck interval. So the recheck interval is capped to the spin too (at least 1 ms): a
lost ping then costs at most that, and an idle reader polls its socket every few milliseconds.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

ENV = "LMCACHE_P2P_VLLM_SPIN_S"
_PATCHED_ATTR = "_lmcache_p2p_spin_capped"


def spin_from_env(environ: os._Environ[str] | dict[str, str] = os.environ) -> float | None:
    """The cap in seconds from ``LMCACHE_P2P_VLLM_SPIN_S``, None when unset or empty."""
    raw = environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV}={raw!r}: expected seconds as a number >= 0 (e.g. 0.005)") from None
    if not value >= 0:
        raise ValueError(f"{ENV}={raw!r}: expected seconds as a number >= 0 (e.g. 0.005)")
    return value


def cap_busy_loop(seconds: float) -> bool:
    """Make vLLM's ``SpinCondition`` readers spin at most ``seconds`` (when vLLM passes no value).

    Returns False, logging why, where this vLLM has no such class (nothing is changed then).
    """
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError as exc:
        logger.warning("%s ignored: vLLM's shm_broadcast is not importable (%s)", ENV, exc)
        return False
    cls = getattr(shm_broadcast, "SpinCondition", None)
    if cls is None:
        logger.warning("%s ignored: this vLLM has no shm_broadcast.SpinCondition", ENV)
        return False
    original = cls.__init__
    if getattr(original, _PATCHED_ATTR, None) is not None:
        original = original.__wrapped__

    @functools.wraps(original)
    def init(self: Any, *args: Any, busy_loop_s: float | None = None, **kwargs: Any) -> None:
        original(self, *args, busy_loop_s=seconds if busy_loop_s is None else busy_loop_s, **kwargs)

    setattr(init, _PATCHED_ATTR, seconds)
    cls.__init__ = init
    recheck_ms = max(1, round(seconds * 1000))
    if hasattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS"):
        shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = min(shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS, recheck_ms)
    else:
        logger.warning("this vLLM has no SHM_READER_RECHECK_INTERVAL_MS: a lost wake-up ping may stall a reader")
    logger.info("vLLM's shared-memory queue readers spin at most %.3f s after a read and recheck every %d ms (%s)",
                seconds, shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS, ENV)
    return True
