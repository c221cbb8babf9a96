"""The announcement a registered instance cannot make: its KV capacity and liveness, from its ``/metrics``.

An instance running vLLM's own NixlConnector (``Backend.VLLM_NIXL``) speaks no control protocol, so the
proxy polls its Prometheus text every ``--kv-metrics-interval-s`` (each poll bounded by
``--health-probe-timeout-s``) and reads two of vLLM's metrics:

* ``vllm:cache_config_info``: its labels ``num_gpu_blocks`` (the KV cache's blocks, CPU ones too) and
  ``block_size`` (tokens per block);
* ``vllm:kv_cache_usage_perc``: the share of those blocks in use (0..1; blocks held only by the prefix
  cache count as free, as vLLM's scheduler counts them).

Free blocks = floor((1 - usage) x blocks) become the decoder's credit (``Registry.observe_capacity``), in
blocks of ``block_size`` tokens, exactly as an announcing decoder's free receive slots: the admission
queue waits for them and the proxy's own promises count against them until a poll after the decode began
reflects them (``router/credit.py``). A poll whose connection is refused or broken counts as a failed
connection (``--max-connect-failures`` of them take the instance out of rotation until ``GET /health``
answers again); a slow one (past ``--health-probe-timeout-s``: a busy engine answers late, it is not dead)
or an error status leaves the last reading in place. An instance without those metrics has an unknown
capacity (always eligible).

Owns: the parse and the poll loop. Must not: choose instances, hold requests, or wait without a deadline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import re

from lmcache_p2p.proxy.errors import UpstreamError, UpstreamUnreachable
from lmcache_p2p.proxy.router.instances import Health, Instance
from lmcache_p2p.proxy.router.registry import Registry
from lmcache_p2p.proxy.upstream import Upstream

logger = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
USAGE_METRIC = "vllm:kv_cache_usage_perc"
CACHE_INFO_METRIC = "vllm:cache_config_info"
_CLOSE_TIMEOUT_S = 2.0
_ROUNDING = 1e-6  # vLLM's usage is free/total as a float: 1 - 0.9 of 10 blocks is 1 block, not 0.999...
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclasses.dataclass(frozen=True)
class KvCapacity:
    """One poll's reading of an instance's KV cache."""

    blocks: int
    free_blocks: int
    block_tokens: int


def parse_kv_capacity(text: str) -> KvCapacity | None:
    """The KV cache of a vLLM ``/metrics`` text; None when it lacks either metric (or they are malformed).
    Several engines (data parallel) sum their blocks and average their usage."""
    usages: list[float] = []
    blocks, block_tokens = 0, 0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        try:
            if name == USAGE_METRIC:
                usages.append(float(value))
            elif name == CACHE_INFO_METRIC:
                info = dict(_LABEL.findall(labels))
                blocks += int(info["num_gpu_blocks"])
                block_tokens = int(info["block_size"])
        except (KeyError, ValueError):
            return None
    if not usages or blocks <= 0 or block_tokens <= 0:
        return None
    usage = min(1.0, max(0.0, sum(usages) / len(usages)))
    return KvCapacity(blocks, math.floor((1.0 - usage) * blocks + _ROUNDING), block_tokens)


class KvMetricsPoller:
    """Polls every registered instance that does not announce itself; ``start()`` / ``close()``."""

    def __init__(self, registry: Registry, upstream: Upstream, interval_s: float, timeout_s: float) -> None:
        self._registry = registry
        self._upstream = upstream
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._task: asyncio.Task[None] | None = None
        self._unreadable: set[str] = set()  # instances logged once as having no KV metrics

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="proxy-kv-metrics")

    async def close(self) -> None:
        """Stop polling; idempotent."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task}, timeout=_CLOSE_TIMEOUT_S)

    async def poll_once(self) -> None:
        """One poll of every such instance that is up (a down one is the health probe's)."""
        polled = [i for i in self._registry.instances()
                  if not i.backend.announces and i.health is Health.UP]
        await asyncio.gather(*(self._poll(inst) for inst in polled))

    async def _loop(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:  # a bug must not end the polling of every instance
                logger.exception("KV metrics poll failed")
            await asyncio.sleep(self._interval_s)

    async def _poll(self, inst: Instance) -> None:
        try:
            text = await self._upstream.get_text(inst.http_url, METRICS_PATH, timeout_s=self._timeout_s)
        except UpstreamUnreachable as exc:  # refused, reset: a dead instance
            logger.info("%s %s: GET %s failed (%s)", inst.role_name, inst.instance_id, METRICS_PATH, exc)
            self._registry.note_connect_failure(inst)
            return
        except UpstreamError as exc:  # slow (a busy engine) or an error status: its last reading stands
            logger.debug("%s %s: GET %s: %s", inst.role_name, inst.instance_id, METRICS_PATH, exc)
            return
        self._registry.note_connected(inst)
        capacity = parse_kv_capacity(text)
        if capacity is None:
            if inst.instance_id not in self._unreadable:
                self._unreadable.add(inst.instance_id)
                logger.warning("%s %s: its %s has no %s / %s: its KV capacity is unknown, so admission never "
                               "waits for it", inst.role_name, inst.instance_id, METRICS_PATH, USAGE_METRIC,
                               CACHE_INFO_METRIC)
            return
        self._unreadable.discard(inst.instance_id)
        self._registry.observe_capacity(inst, capacity.blocks, capacity.free_blocks, capacity.block_tokens)
