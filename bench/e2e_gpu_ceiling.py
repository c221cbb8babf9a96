"""The peer-copy ceiling for one request's KV: torch ``copy_`` of the same bytes, in the same chunks,
from GPU 0 into GPU 1 (device to device), on idle GPUs. ``bench/e2e_gpu.py`` runs it once per pass
(before any server starts) and sets each row's KV transfer time against it.

    python3 bench/e2e_gpu_ceiling.py --nbytes 134217728 --chunk-bytes 33554432 [--reps 30]

Prints one JSON object: ``{"nbytes", "chunk_bytes", "chunks", "reps", "peer_access", "chunked_ms_p50",
"chunked_ms_min", "chunked_gbps_p50", "contiguous_ms_p50", "contiguous_gbps_p50", "host_d2h_ms_p50",
"host_h2d_peer_ms_p50"}``; chunked = the chunks one after the other on one stream (as a sender writes
them), contiguous = one copy of all the bytes; host_* = the same chunks through a pinned host buffer,
as a prefiller's KV goes today (LMCache's store: GPU 0 -> host; the sender: host -> GPU 0 staging ->
GPU 1). A machine with fewer than two GPUs prints ``{"error": ...}`` and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

WARMUP = 5


def _time_ms(copy: Callable[[], None], sync: Callable[[], None], reps: int) -> list[float]:
    for _ in range(WARMUP):
        copy()
    sync()
    out = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        copy()
        sync()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def measure(nbytes: int, chunk_bytes: int, reps: int) -> dict[str, Any]:
    import torch

    if torch.cuda.device_count() < 2:
        return {"error": f"{torch.cuda.device_count()} GPU(s) visible; the peer-copy ceiling needs 2"}
    chunks = max(1, -(-nbytes // chunk_bytes))
    src = torch.empty(chunks * chunk_bytes, dtype=torch.uint8, device="cuda:0").fill_(7)
    dst = torch.empty(chunks * chunk_bytes, dtype=torch.uint8, device="cuda:1")
    src_parts, dst_parts = src.view(chunks, chunk_bytes), dst.view(chunks, chunk_bytes)

    def sync() -> None:
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")

    def chunked() -> None:
        for i in range(chunks):
            dst_parts[i].copy_(src_parts[i], non_blocking=True)

    def contiguous() -> None:
        dst.copy_(src, non_blocking=True)

    chunked_ms = _time_ms(chunked, sync, reps)
    contiguous_ms = _time_ms(contiguous, sync, reps)
    equal = bool(torch.equal(src.cpu(), dst.cpu()))
    total = chunks * chunk_bytes
    out = {"nbytes": total, "chunk_bytes": chunk_bytes, "chunks": chunks, "reps": reps,
           "peer_access": bool(torch.cuda.can_device_access_peer(0, 1)), "bytes_equal": equal,
           "chunked_ms_p50": round(_median(chunked_ms), 4), "chunked_ms_min": round(min(chunked_ms), 4),
           "chunked_gbps_p50": round(total / _median(chunked_ms) / 1e6, 1),
           "contiguous_ms_p50": round(_median(contiguous_ms), 4),
           "contiguous_gbps_p50": round(total / _median(contiguous_ms) / 1e6, 1)}
    try:
        out.update(_host_path(torch, src_parts, dst_parts, sync, reps))
    except Exception as exc:  # noqa: BLE001 - the peer ceiling above stands on its own
        out["host_path_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def _host_path(torch: Any, src_parts: Any, dst_parts: Any, sync: Callable[[], None], reps: int) -> dict[str, Any]:
    """The path a prefiller's chunk takes today: LMCache stores it from GPU 0 into its pinned host buffer
    (d2h, in the store), the sender stages it back onto GPU 0 and writes it into GPU 1 (h2d + peer, the
    "transfer" phase). Same chunks, one after the other on one stream."""
    chunks, chunk_bytes = src_parts.shape
    host = torch.empty((chunks, chunk_bytes), dtype=torch.uint8, pin_memory=True)
    stage = torch.empty(chunk_bytes, dtype=torch.uint8, device="cuda:0")

    def d2h() -> None:
        for i in range(chunks):
            host[i].copy_(src_parts[i], non_blocking=True)

    def h2d_peer() -> None:
        for i in range(chunks):
            stage.copy_(host[i], non_blocking=True)
            dst_parts[i].copy_(stage, non_blocking=True)

    d2h_ms, h2d_peer_ms = _time_ms(d2h, sync, reps), _time_ms(h2d_peer, sync, reps)
    return {"host_d2h_ms_p50": round(_median(d2h_ms), 4), "host_h2d_peer_ms_p50": round(_median(h2d_peer_ms), 4)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nbytes", type=int, required=True, help="one request's KV bytes")
    p.add_argument("--chunk-bytes", type=int, required=True, help="one LMCache chunk's KV bytes")
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args(argv)
    result = measure(a.nbytes, a.chunk_bytes, a.reps)
    print(json.dumps(result))
    return 2 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
