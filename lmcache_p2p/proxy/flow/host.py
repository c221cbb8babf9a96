"""The requests open in this proxy, each under its client side's handle, and the steps on them:
``open`` (prefill), ``plan`` (the KV wait, where the decode goes), ``unreachable`` / ``broken``
(where it goes instead), ``started``, ``closed`` (with the answer's counts). One per proxy.

The client side of a request (``flow/client.py``) drives these steps through a link: in one process
directly (``LocalLink`` below), with ``--workers N`` over the coordinator's Unix socket
(``relay/coordinator.py`` serves them, ``relay/link.py`` calls them). It owns the table of open flows and
the once-only handling of a "closed" sent again. It must not speak HTTP or stream decodes.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any

import msgspec

from lmcache_p2p.proxy.errors import ClientDisconnected, ProxyError, UpstreamConnectError, UpstreamUnreachable
from lmcache_p2p.proxy.flow.flow import Orchestrator, RequestFlow
from lmcache_p2p.proxy.relay.messages import Count, Opened, Planned, Step, Target
from lmcache_p2p.proxy.http.shaping import ClientRequest, Endpoint
from lmcache_p2p.proxy.http.tokenizer import ProxyTokenizer

logger = logging.getLogger(__name__)

_CLOSED_REMEMBERED = 4096  # handles closed here lately: an open still running, a "closed" sent again
LOCAL_WORKER = -1  # the worker index of requests this process serves itself


@dataclasses.dataclass(eq=False)
class _Open:
    flow: RequestFlow
    worker: int
    planning: asyncio.Task[Target] | None = None  # the KV wait and choice of decoder after the open


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

    def is_open(self, handle: str) -> bool:
        return handle in self._flows

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
            first = await flow.prefill()
            if handle in self._closed:
                raise ClientDisconnected()
            self._flows[handle] = _Open(flow, worker)
            self.opened_by_worker[worker] += 1
            kept = True
            first = dataclasses.replace(first, prompt_ids=None)  # they go once, as Opened.prompt_ids
            return Opened(flow.response_id, first, flow.prompt_ids, flow.needs_decode, flow.decoder_regenerates_first,
                          flow.colocated is not None, flow.proxy_text, flow.tokenizer_source,
                          self._o.settings.decode_idle_timeout_s)
        finally:
            if not kept:
                flow.close()

    async def plan(self, handle: str) -> Target | None:
        """Where the first decode goes, once the KV is ready; None when the request was closed meanwhile."""
        held = self._flows.get(handle)
        if held is None:
            return None
        task = held.planning = asyncio.get_running_loop().create_task(held.flow.plan_decode(), name="flow-plan")
        try:
            await asyncio.wait({task})
        finally:
            if not task.done():
                task.cancel()
        return None if task.cancelled() else task.result()

    def unreachable(self, step: Step) -> Planned:
        return Planned(self.flow(step.handle).decode_unreachable(UpstreamConnectError(step.message)))

    def broken(self, step: Step) -> Planned:
        exc = UpstreamConnectError(step.message) if step.connect_failed else UpstreamUnreachable(step.message)
        return Planned(self.flow(step.handle).decode_broken(step.output_ids, step.finished, exc, step.rewound))

    def started(self, step: Step) -> None:
        held = self._flows.get(step.handle)
        if held is not None:
            held.flow.decode_started(step.decode_sent_s, step.first_decoded_s)

    def closed(self, step: Step) -> None:
        """The request is over: its counts, then close it. A "closed" sent again (its first answer was
        lost) for a handle closed here already is ignored, so its counts are not applied twice."""
        if step.handle in self._closed:
            return
        held = self._flows.get(step.handle)
        if held is not None and step.first_byte_s is not None and held.flow.timeline.first_byte_s is None:
            held.flow.timeline.first_byte_s = step.first_byte_s
        for count in step.counts:
            self.count(count)
        self._close(step.handle, step.output_ids)

    def count(self, count: Count) -> None:
        endpoint, metrics = Endpoint(count.endpoint), self._o.metrics
        if count.status is not None:
            metrics.requests.labels(endpoint.value, str(count.status)).inc()
        if count.error is not None:
            metrics.errors.labels(endpoint.value, count.error).inc()

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

    def _close(self, handle: str, output_ids: list[int] | None) -> None:
        self._closed[handle] = None  # an open still running closes its flow; a "closed" again is ignored
        while len(self._closed) > _CLOSED_REMEMBERED:
            self._closed.popitem(last=False)
        held = self._flows.pop(handle, None)
        if held is None:
            return
        if held.planning is not None and not held.planning.done():
            held.planning.cancel()  # its KV wait: the request is over
        if output_ids is not None:
            held.flow.decode_ended(output_ids)  # as one process: close() remembers the output so far
        held.flow.close()


class LocalLink:
    """The client side's link to the flows of this very process: each step is a call (nothing to wait for)."""

    worker = LOCAL_WORKER

    def __init__(self, host: FlowHost) -> None:
        self._host = host

    async def open(self, handle: str, req: ClientRequest, headers: Mapping[str, str],
                   received_s: float) -> tuple[Opened, LocalPlan]:
        return await self._host.open(handle, self.worker, req, headers, received_s), LocalPlan(self._host, handle)

    async def call(self, step: str, msg: Step) -> Planned:
        if step == "unreachable":
            return self._host.unreachable(msg)
        if step == "broken":
            return self._host.broken(msg)
        raise ValueError(f"no step {step!r} answers a target")

    async def tell(self, step: str, msg: Any, attempts: int = 1) -> None:
        self._apply(step, msg)

    def tell_later(self, step: str, msg: Any, after: Collection[asyncio.Future[Any]] = (),
                   answer: LocalPlan | None = None, attempts: int = 1) -> asyncio.Future[Any]:
        """Now: the steps before it (``after``) were calls too, so they are done."""
        self._apply(step, msg if isinstance(msg, msgspec.Struct) else msg())
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    async def tokenizer(self, source: str, handle: str) -> ProxyTokenizer:
        tokenizer = self._host.flow(handle).tokenizer
        if tokenizer is None:
            raise ProxyError(f"request {handle}: no tokenizer loaded from {source}")
        return tokenizer

    def _apply(self, step: str, msg: Any) -> None:
        steps: dict[str, Callable[[Any], None]] = {"started": self._host.started, "closed": self._host.closed,
                                                   "count": self._host.count}
        steps[step](msg)


class LocalPlan:
    """``open``'s second half in one process: the plan, asked for when the decode starts."""

    def __init__(self, host: FlowHost, handle: str) -> None:
        self._host = host
        self._handle = handle

    async def plan(self) -> Target:
        target = await self._host.plan(self._handle)
        if target is None:
            raise ClientDisconnected()
        return target

    async def aclose(self) -> None:
        """Nothing to release: closing the request stops its plan (``FlowHost.closed``)."""
