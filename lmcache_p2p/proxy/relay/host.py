"""The requests the coordinator holds for its relay workers (``--workers N``), each under its worker's
handle, and the steps on them as they arrive from the wire: ``open`` (prefill), ``plan`` (the KV wait,
where the decode goes), ``settled`` (an early decode's KV outcome), ``unreachable`` / ``broken`` (where it
goes instead), ``started``, ``closed`` (with the answer's counts). One per coordinator.

Each step is a call of the request's ``RequestFlow`` (``flow/steps.py``), as one process's own
requests make them; ``relay/coordinator.py`` is its HTTP side. It owns the table of open flows, the
once-only handling of a "closed" sent again and the close of a dead worker's requests. It must not
speak HTTP or stream decodes.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from lmcache_p2p.proxy.errors import ClientDisconnected, ProxyError, UpstreamConnectError, UpstreamUnreachable
from lmcache_p2p.proxy.flow.flow import Orchestrator, RequestFlow
from lmcache_p2p.proxy.flow.steps import Answer, Count, Opened, Target
from lmcache_p2p.proxy.http.shaping import ClientRequest
from lmcache_p2p.proxy.relay.messages import Planned, Step

logger = logging.getLogger(__name__)

T = TypeVar("T")

_CLOSED_REMEMBERED = 4096  # handles closed here lately: an open still running, a "closed" sent again


@dataclasses.dataclass(eq=False)
class _Open:
    flow: RequestFlow
    worker: int
    planning: asyncio.Task[Any] | None = None  # the KV wait and choice of decoder (plan, settled)


class FlowHost:
    def __init__(self, orchestrator: Orchestrator) -> None:
        self._o = orchestrator
        self._flows: dict[str, _Open] = {}
        self._closed: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.opened_by_worker: collections.Counter[int] = collections.Counter()  # requests each worker opened

    def __len__(self) -> int:
        """Requests open."""
        return len(self._flows)

    def open_on(self, worker: int) -> int:
        return sum(held.worker == worker for held in self._flows.values())

    def flow(self, handle: str) -> RequestFlow:
        held = self._flows.get(handle)
        if held is None:
            raise ProxyError(f"request {handle} is not open on the coordinator (closed, or its worker was declared "
                             "dead)")
        return held.flow

    # ---- the steps -------------------------------------------------------------------------------

    async def open(self, handle: str, worker: int, req: ClientRequest, headers: Mapping[str, str],
                   received_s: float) -> Opened:
        """Prefill; the request is then held under ``handle`` until closed. Raises ClientDisconnected when
        the client side closed it meanwhile (its flow is closed here)."""
        flow = self._o.open(req, headers, received_s)
        kept = False
        try:
            opened = await flow.prefill()
            if handle in self._closed:
                raise ClientDisconnected()
            self._flows[handle] = _Open(flow, worker)
            self.opened_by_worker[worker] += 1
            kept = True
            return opened
        finally:
            if not kept:
                flow.close()

    async def plan(self, handle: str) -> Target | None:
        """Where the first decode goes, once the KV is ready; None when the request was closed meanwhile."""
        ran, target = await self._waiting_step(handle, lambda flow: flow.plan(), "flow-plan")
        return target if ran else None

    async def settled(self, handle: str) -> Planned | None:
        """An early decode's KV outcome (``RequestFlow.settled``); None when the request was closed meanwhile."""
        ran, moved = await self._waiting_step(handle, lambda flow: flow.settled(), "flow-settled")
        return Planned(moved) if ran else None

    async def _waiting_step(self, handle: str, step: Callable[[RequestFlow], Awaitable[T]],
                            name: str) -> tuple[bool, T | None]:
        """A step that waits (the KV), as the request's ``planning`` task that its close cancels; (False, None)
        when the request was closed, before or meanwhile."""
        held = self._flows.get(handle)
        if held is None:
            return False, None
        task = held.planning = asyncio.get_running_loop().create_task(step(held.flow), name=name)
        try:
            await asyncio.wait({task})
        finally:
            if not task.done():
                task.cancel()
        return (False, None) if task.cancelled() else (True, task.result())

    async def unreachable(self, step: Step) -> Planned:
        return Planned(await self.flow(step.handle).unreachable(UpstreamConnectError(step.message)))

    async def broken(self, step: Step) -> Planned:
        exc = UpstreamConnectError(step.message) if step.connect_failed else UpstreamUnreachable(step.message)
        return Planned(await self.flow(step.handle).broken(step.output_ids, step.finished, step.rewound, exc))

    def started(self, step: Step) -> None:
        held = self._flows.get(step.handle)
        if held is not None:
            held.flow.started(step.decode_sent_s, step.first_decoded_s, step.decode_accepted_s, step.kv_pending)

    def closed(self, step: Step) -> None:
        """The request is over: its counts, then close it. A "closed" sent again (its first answer was
        lost) for a handle closed here already is ignored, so its counts are not applied twice."""
        if step.handle in self._closed:
            return
        answer = Answer(step.output_ids, step.counts, step.first_byte_s)
        if step.handle not in self._flows:  # its open still runs (and closes its flow): the counts count now
            for count in answer.counts:
                self._o.count(count)
        self._close(step.handle, answer)

    def count(self, count: Count) -> None:
        self._o.count(count)

    def forget_worker(self, worker: int) -> None:
        """Worker ``worker`` is gone: close every request it held (its clients' connections went with it)."""
        gone = [handle for handle, held in self._flows.items() if held.worker == worker]
        for handle in gone:
            self._close(handle, None)
        if gone:
            logger.warning("relay worker %d died holding %d request(s): closed", worker, len(gone))

    def close_all(self) -> None:
        for handle in list(self._flows):
            self._close(handle, None)

    def _close(self, handle: str, answer: Answer | None) -> None:
        self._closed[handle] = None  # an open still running closes its flow; a "closed" again is ignored
        while len(self._closed) > _CLOSED_REMEMBERED:
            self._closed.popitem(last=False)
        held = self._flows.pop(handle, None)
        if held is None:
            return
        if held.planning is not None and not held.planning.done():
            held.planning.cancel()  # its KV wait: the request is over
        held.flow.close(answer)  # with an answer, as one process: it remembers the output so far
