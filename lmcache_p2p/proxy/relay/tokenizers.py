"""The tokenizer a relay worker makes the client's text with: the coordinator's, loaded once in this
process, off the event loop (``--tokenizer``: a folder at start, ``auto``: the one the coordinator
names once an instance told it).

It owns the loads. It must not choose the tokenizer (the coordinator does) or wait without a deadline.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from typing import Any

from lmcache_p2p.proxy.errors import ProxyError
from lmcache_p2p.proxy.http.tokenizer import ProxyTokenizer, import_library, load_tokenizer, wait_imported

logger = logging.getLogger(__name__)


class Tokenizers:
    """The tokenizer the coordinator names, loaded once in this process (off the event loop)."""

    def __init__(self, load_timeout_s: float) -> None:
        self._load_timeout_s = load_timeout_s  # a request's wait for the load (the proxy's --tokenizer-load-timeout-s)
        self._loading: dict[str, asyncio.Task[ProxyTokenizer | None]] = {}
        self._import: asyncio.Task[Any] | None = None

    def prefetch(self) -> None:
        """Import the tokenizer library in a thread now (seconds): the first request then waits for the folder alone."""
        if self._import is None:
            self._import = asyncio.get_running_loop().create_task(
                asyncio.to_thread(import_library), name="relay-tokenizer-import")

    async def import_before_serving(self) -> None:
        """Import the tokenizer library before this worker serves (``http/tokenizer.wait_imported``)."""
        self.prefetch()
        assert self._import is not None
        await wait_imported(self._import, self._load_timeout_s)

    def preload(self, source: str) -> None:
        """Start loading ``source`` now (the proxy's --tokenizer folder), before the first request needs it."""
        if source not in self._loading:
            self._loading[source] = asyncio.get_running_loop().create_task(self._load(source), name="relay-tokenizer")

    async def get(self, source: str) -> ProxyTokenizer:
        """The tokenizer from ``source``; raises ProxyError (503) when it does not load within the timeout (the
        load carries on: a later request may find it loaded) or cannot load."""
        self.preload(source)
        try:
            tokenizer = await asyncio.wait_for(asyncio.shield(self._loading[source]), self._load_timeout_s)
        except TimeoutError:
            raise ProxyError(f"this relay worker did not load the coordinator's tokenizer {source} within "
                             f"{self._load_timeout_s:g} s: raise --tokenizer-load-timeout-s", status_code=503) from None
        if tokenizer is None:
            raise ProxyError(f"this relay worker cannot load the coordinator's tokenizer {source}")
        return tokenizer

    async def _load(self, source: str) -> ProxyTokenizer | None:
        if self._import is not None:  # a second importing thread would see it half-initialized (http/tokenizer.py)
            await asyncio.wait({self._import})
        try:
            tokenizer = await asyncio.to_thread(load_tokenizer, source)
        except Exception as exc:
            logger.error("relay worker: cannot load the tokenizer from %s (%s: %s)", source, type(exc).__name__, exc)
            return None
        gc.freeze()  # as the coordinator does (http/tokenizer.py): full collections must not walk transformers' objects
        return tokenizer
