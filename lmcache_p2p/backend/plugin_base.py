"""What both plugin classes share as LMCache sees them: the parts of the interface neither uses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lmcache.utils import CacheEngineKey
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from lmcache_p2p import vllm_plugin
from lmcache_p2p.backend.full_graph_load import install as install_full_graph_load
from lmcache_p2p.errors import ClosedError


class P2PPlugin(StoragePluginInterface):
    """Owns a service (threads, sockets) and a transport; closes both, in that order, once. Both roles' LMCache
    loads KV: :meth:`_load_in_full_graphs` keeps those loads on vLLM's FULL CUDA graph steps."""

    _service: Any = None
    _transport: Any = None
    _unload: Callable[[], None] | None = None

    def _load_in_full_graphs(self) -> None:
        vllm_plugin.check_registered()  # where the backend is built inside vLLM, the plugin must be there too
        self._unload = install_full_graph_load()

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
        unload, self._unload = self._unload, None
        if unload is not None:
            unload()
