"""An early decode (``--early-decode``): the decode goes to the decoder when the prefill answered, before its
KV is ready, and the proxy's KV wait runs beside it. What the request's owner learns first decides:

    the KV is ready                         the decode goes on                               KV_READY
    the decode's first output, or it left   the decode goes on as one sent after the KV      DECODE_FIRST
      its decoder (refused, broke) first      (its handover is taken, or it moves on)
    the KV failed (KvFailed, decoder down,  the decode is given up (its stream closed: vLLM  KV_FAILED
      its probe, --kv-timeout-s) first        aborts it), --on-kv-failure applies as for a
                                              wait before the decode

The KV's outcome decides only when it is asked for (:meth:`EarlyRace.decided`, the ``settled`` step), so a
failure never gives up a decode that already output or left; and the decode's steps decide only while
nothing did (:meth:`EarlyRace.decode_first`), so a decode the KV's failure gave up is never also taken.

It owns the watch (the KV wait's task) and that one decision. It must not wait for the KV itself, send
requests or choose instances: the handover (``flow/handover.py``) hands it the wait, the flow
(``flow/flow.py``) takes the failure's path.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Coroutine
from typing import Any

from lmcache_p2p.proxy.handover.waiters import KvOutcome, KvStatus


class Early(str, enum.Enum):
    WATCHING = "watching"  # nothing decided yet
    KV_READY = "kv_ready"
    DECODE_FIRST = "decode_first"
    KV_FAILED = "kv_failed"


class EarlyRace:
    def __init__(self, wait: Coroutine[Any, Any, KvOutcome], on_decided: Callable[[Early], None], name: str) -> None:
        self.state = Early.WATCHING
        self.outcome: KvOutcome | None = None  # the KV wait's, once it ended (whatever was decided)
        self._on_decided = on_decided
        self._changed = asyncio.Event()  # the wait ended, or the decode decided
        self._task = asyncio.get_running_loop().create_task(self._watch(wait), name=name)

    async def _watch(self, wait: Coroutine[Any, Any, KvOutcome]) -> None:
        try:
            self.outcome = await wait
        finally:
            self._changed.set()

    def decode_first(self) -> bool:
        """The decode output first, or left its decoder, while nothing was decided: it goes on. False when the
        KV's failure gave it up already (the caller's step is then not the request's: ``decided`` answered)."""
        if self.state is Early.WATCHING:
            ready = self.outcome is not None and self.outcome.status is KvStatus.READY  # known, never asked for
            self._decide(Early.KV_READY if ready else Early.DECODE_FIRST)
        return self.state is not Early.KV_FAILED

    async def decided(self) -> KvOutcome | None:
        """Until the KV's outcome or the decode's (bounded by the KV wait's own deadline, ``--kv-timeout-s``);
        the KV's failure when it came first (to this one call), else None."""
        if self.state is Early.WATCHING:
            await self._changed.wait()
        outcome = self.outcome
        if self.state is not Early.WATCHING or outcome is None:
            return None  # decided by the decode, or the wait was stopped (the request closes)
        if outcome.status is KvStatus.READY:
            self._decide(Early.KV_READY)
            return None
        self._decide(Early.KV_FAILED)
        return outcome

    def stop(self) -> None:
        """Stop the wait (the request closes, or its decode left the decoder); never awaits."""
        self._task.cancel()
        self._changed.set()  # a task cancelled before its first step never reaches _watch's finally

    def _decide(self, state: Early) -> None:
        self.state = state
        self._changed.set()
        self._on_decided(state)
