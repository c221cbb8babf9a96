"""What both plugin classes share as LMCache sees them: the parts of the interface neither uses."""

from __future__ import annotations

import logging
import sys
from typing import Any

from lmcache.utils import CacheEngineKey
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from lmcache_p2p.errors import ClosedError

logger = logging.getLogger(__name__)


def apply_switch_interval(interval_s: float | None) -> None:
    """``p2p.gil_switch_interval_s``: Python's thread switch interval for this whole process (None: leave it)."""
    if interval_s is None or sys.getswitchinterval() == interval_s:
        return
    logger.info("lmcache_p2p: Python thread switch interval %.4f s -> %.4f s (p2p.gil_switch_interval_s)",
                sys.getswitchinterval(), interval_s)
    sys.setswitchinterval(interval_s)


class P2PPlugin(StoragePluginInterface):
    """Owns a service (threads, sockets) and a transport; closes both, in that order, once."""

    _service: Any = None
    _transport: Any = None

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        return False

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        return False  # chunks leave when they are loaded, cancelled or their lease ends

    def touch_cache(self) -> None:
        return None

    def get_allocator_backend(self) -> Any:
        return self.local_cpu_backend

    def _svc(self) -> Any:
        if self._service is None:
            raise ClosedError(f"{self} is closed")
        return self._service

    def close(self) -> None:
        service, self._service = self._service, None
        if service is not None:
            service.close()
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.close()
