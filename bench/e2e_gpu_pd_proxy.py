"""LMCache's PD proxy (``../shared/anchor/pd_proxy.py``) with its per-request times kept for streamed
requests too, so LMCache PD's handover is measured like lmcache_p2p's.

    python3 bench/e2e_gpu_pd_proxy.py PD_PROXY.py [pd_proxy.py's own arguments]

The anchor's proxy stamps ``pd_timing`` (``time.time()``: t_prefill_done = the prefiller's answer
received, t_kv_ready = max(that, the sender's ProxyNotif), t_decode_first_byte = the decoder's first
SSE line) but returns it only in non-streamed answers, and a streamed request's decode leg is not
stamped at all. This wrapper runs the proxy unchanged and wraps two of its functions (looked up by
name at call time): ``prefill`` keeps each request's stamps by its prompt ids, ``decoder_chunks``
(the decode leg, streamed or not) fills them in and, once the decoder's stream ends, appends them
to a list served at:

  GET  /pd_stats        {"timings": [pd_timing, ...]} of every finished request since the last reset
  POST /pd_stats/reset  empties that list, answers {"reset": n}

handover = t_decode_first_byte - t_prefill_done: the prefill answer at the proxy -> the first
decoded byte at the proxy, as lmcache_p2p's proxy defines it (its ``/stats`` handover).
"""

from __future__ import annotations

import collections
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

PENDING_MAX = 8192  # prompts waiting for their decode leg (oldest dropped: a prefill whose decode never came)


class PdTimings:
    """Per-request stamps matched from the prefill leg to the decode leg by prompt ids."""

    def __init__(self, pending_max: int = PENDING_MAX) -> None:
        self._pending: collections.OrderedDict[tuple[int, ...], dict[str, float]] = collections.OrderedDict()
        self._pending_max = pending_max
        self.done: list[dict[str, float]] = []

    def prefilled(self, prompt_ids: list[int], stamps: dict[str, float]) -> None:
        self._pending[tuple(prompt_ids)] = stamps
        while len(self._pending) > self._pending_max:
            self._pending.popitem(last=False)

    def decoding(self, decode_prompt_ids: list[int], stamps: dict[str, float] | None) -> dict[str, float]:
        """The stamps of the request whose decode prompt (prompt ids + first token) this is."""
        pending = self._pending.pop(tuple(decode_prompt_ids[:-1]), None)
        if stamps is not None:
            return stamps
        return pending if pending is not None else {}

    def finished(self, stamps: dict[str, float]) -> None:
        stamps.setdefault("t_done", time.time())
        self.done.append(dict(stamps))

    def reset(self) -> int:
        n = len(self.done)
        self.done = []
        return n


def wrap(namespace: dict[str, Any], timings: PdTimings) -> None:
    """Replace the proxy's ``prefill`` and ``decoder_chunks`` in its module namespace."""
    prefill: Callable[..., Any] = namespace["prefill"]
    decoder_chunks: Callable[..., AsyncIterator[Any]] = namespace["decoder_chunks"]

    async def timed_prefill(rid: str, base: dict[str, Any], tok: list[int], stamps: dict[str, float]) -> Any:
        out = await prefill(rid, base, tok, stamps)
        timings.prefilled(tok, stamps)
        return out

    async def timed_decoder_chunks(body: dict[str, Any], stamps: dict[str, float] | None = None) -> AsyncIterator[Any]:
        own = timings.decoding(body.get("prompt") or [], stamps)
        async for chunk in decoder_chunks(body, own):
            yield chunk
        timings.finished(own)

    namespace["prefill"] = timed_prefill
    namespace["decoder_chunks"] = timed_decoder_chunks


def add_routes(app: Any, timings: PdTimings) -> None:
    async def pd_stats() -> dict[str, Any]:
        return {"timings": timings.done}

    async def pd_stats_reset() -> dict[str, Any]:
        return {"reset": timings.reset()}

    app.add_api_route("/pd_stats", pd_stats, methods=["GET"])
    app.add_api_route("/pd_stats/reset", pd_stats_reset, methods=["POST"])


def main() -> int:
    if len(sys.argv) < 2:
        print("usage: e2e_gpu_pd_proxy.py PD_PROXY.py [its arguments]", file=sys.stderr)
        return 2
    path = Path(sys.argv[1]).resolve()
    sys.argv = [str(path), *sys.argv[2:]]  # the proxy parses its own arguments at import
    namespace: dict[str, Any] = {"__name__": "pd_proxy", "__file__": str(path)}
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # noqa: S102 - LMCache's example proxy, as is
    timings = PdTimings()
    wrap(namespace, timings)
    add_routes(namespace["app"], timings)
    import uvicorn

    uvicorn.run(namespace["app"], host="127.0.0.1", port=namespace["args"].port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
