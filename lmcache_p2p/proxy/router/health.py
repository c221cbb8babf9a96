"""Health gating: an instance takes traffic only once its ``GET {http_url}/health`` answered 200.

The plugin announces an instance when vLLM's LMCache engine starts, well before vLLM's HTTP server
listens. So the registry hands every instance that is not known healthy (new, static, restarted,
moved, or taken out after ``--max-connect-failures`` failed connections) to :meth:`HealthProber.watch`:
one task per such instance probes it every ``--health-probe-interval-s``, each attempt bounded by
``--health-probe-timeout-s`` (the connect and the answer each), until a 200 marks it up or the registry forgets it
(:meth:`HealthProber.forget` cancels the task). Up instances are not probed: failed connections
of real traffic take them down.

Must not: block the event loop; leave a task behind (``close()`` cancels every one).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable

from lmcache_p2p.proxy.errors import UpstreamError
from lmcache_p2p.proxy.router.registry import Health, Instance, Registry
from lmcache_p2p.proxy.upstream import Upstream

logger = logging.getLogger(__name__)

HEALTH_PATH = "/health"
_CLOSE_TIMEOUT_S = 2.0


class HealthProber:
    def __init__(self, registry: Registry, upstream: Upstream, interval_s: float, timeout_s: float,
                 on_up: Callable[[Instance], Awaitable[None]] | None = None) -> None:
        """``on_up``: awaited once an instance is up (routable meanwhile), in its probe's task."""
        self._registry = registry
        self._on_up = on_up
        self._upstream = upstream
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._tasks: dict[Instance, asyncio.Task[None]] = {}
        self._started = False
        self._closed = False

    def start(self) -> None:
        """Probe every instance registered so far that is not up (static ones); later ones via ``watch``."""
        self._started = True
        for inst in self._registry.instances():
            if inst.health is not Health.UP:
                self.watch(inst)

    def watch(self, inst: Instance) -> None:
        """Probe ``inst`` until it is healthy (no-op when a probe already runs, or before ``start``)."""
        if not self._started or self._closed:
            return
        task = self._tasks.get(inst)
        if task is not None and not task.done():
            return
        task = asyncio.get_running_loop().create_task(self._probe_until_up(inst),
                                                      name=f"proxy-health-{inst.instance_id}")
        self._tasks[inst] = task
        task.add_done_callback(functools.partial(self._task_done, inst))

    def forget(self, inst: Instance) -> None:
        """The registry dropped ``inst``: stop probing it."""
        task = self._tasks.pop(inst, None)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        """Cancel every probe; idempotent."""
        self._closed = True
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=_CLOSE_TIMEOUT_S)

    async def _probe_until_up(self, inst: Instance) -> None:
        start_s = time.monotonic()
        attempts = 0
        while True:
            attempts += 1
            problem = await self._probe(inst)
            if problem is None:
                break
            first_wait = attempts == 1 and inst.health is Health.PENDING
            logger.log(logging.INFO if first_wait else logging.DEBUG,
                       "%s %s gets no traffic until GET %s answers 200 (probe %d: %s)", inst.role_name,
                       inst.instance_id, HEALTH_PATH, attempts, problem)
            await asyncio.sleep(self._interval_s)
        was = inst.health
        self._registry.mark_up(inst)
        logger.info("%s %s at %s is %s: GET %s answered 200 after %d probe(s), %.1f s", inst.role_name,
                    inst.instance_id, inst.http_url, "up" if was is Health.PENDING else "up again", HEALTH_PATH,
                    attempts, time.monotonic() - start_s)
        if self._on_up is not None:
            await self._on_up(inst)

    async def _probe(self, inst: Instance) -> str | None:
        """None when healthy, else what was observed."""
        try:
            status = await self._upstream.get_status(inst.http_url, HEALTH_PATH, timeout_s=self._timeout_s)
        except UpstreamError as exc:
            return str(exc)
        return None if status == 200 else f"GET {inst.http_url}{HEALTH_PATH} answered {status}"

    def _task_done(self, inst: Instance, task: asyncio.Task[None]) -> None:
        if self._tasks.get(inst) is task:
            del self._tasks[inst]
        if not task.cancelled() and task.exception() is not None:
            logger.error("health probe of %s died", inst.instance_id, exc_info=task.exception())
