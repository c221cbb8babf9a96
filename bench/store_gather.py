"""LMCache's store gather on one GPU, alone: its per-chunk ``batched_from_gpu`` against lmcache_p2p's pass.

One chunked-prefill step's store, as the prefiller makes it: ``--tokens`` tokens (default 8192) of an
8B-shaped KV cache (32 layers, 8 KV heads x 128, bf16, vLLM's paged layout [2, blocks, 16, heads, dim]
per layer, the request's blocks scattered), gathered into chunk pages of a lmcache_p2p ``SendArena`` in
VRAM by LMCache 0.5.3's ``VLLMPagedMemGPUConnectorV2`` (with the intermediate GPU buffer it makes
whenever ``enable_pd`` is false, as on our prefiller):

  lmcache      its own ``batched_from_gpu`` (one ``from_gpu`` per chunk)
  p2p          ``lmcache_p2p.backend.send_gather`` installed (the view derived once, the kernel straight
               into each page)
  copy         a plain device-to-device copy of the same bytes (the GPU's copy speed, for scale)

Per (path, chunk size): the engine thread's wall time for the call, the CPU time it spent, and the span
on the store stream (CUDA events), p50 over ``--repeats``; the bytes of both paths compared.

    python3 bench/store_gather.py --out bench/results/store_gather.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LAYERS, HEADS, HEAD, BLOCK = 32, 8, 128, 16


def make_cache(tokens: int, blocks: int, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    caches = [torch.randn(2, blocks, BLOCK, HEADS, HEAD, dtype=torch.bfloat16, device="cuda", generator=gen)
              for _ in range(LAYERS)]
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed))[:(tokens + BLOCK - 1) // BLOCK]
    slots = (order[:, None] * BLOCK + torch.arange(BLOCK)[None, :]).reshape(-1)[:tokens]
    return caches, slots.to(torch.int64).cuda()


def run_path(connector, arena, caches, slots, chunk: int, tokens: int, repeats: int) -> tuple[dict, list]:
    from lmcache.v1.memory_management import MemoryFormat

    starts = list(range(0, tokens, chunk))
    ends = [min(s + chunk, tokens) for s in starts]
    objs = [arena.allocate([torch.Size([2, LAYERS, e - s, HEADS * HEAD])], [torch.bfloat16], MemoryFormat.KV_2LTD)
            for s, e in zip(starts, ends)]
    assert all(o is not None for o in objs), "arena too small"
    stream = connector.store_stream
    walls, cpus, spans = [], [], []
    for i in range(repeats + 2):
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record(stream)
        t0, c0 = time.perf_counter(), time.thread_time()
        connector.batched_from_gpu(objs, starts, ends, kvcaches=caches, slot_mapping=slots)
        t1, c1 = time.perf_counter(), time.thread_time()
        end.record(stream)
        stream.synchronize()
        if i >= 2:  # two warm-up rounds
            walls.append((t1 - t0) * 1e3)
            cpus.append((c1 - c0) * 1e3)
            spans.append(begin.elapsed_time(end))
    snapshot = [o.tensor.clone() for o in objs]
    for o in objs:
        o.ref_count_down()
    return {"calls_wall_ms_p50": round(statistics.median(walls), 3), "cpu_ms_p50": round(statistics.median(cpus), 3),
            "store_stream_ms_p50": round(statistics.median(spans), 3), "chunks": len(objs)}, snapshot


def copy_ceiling(nbytes: int, repeats: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for i in range(repeats + 2):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(begin.elapsed_time(end))
    return round(statistics.median(times), 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--chunk-sizes", default="256,1024")
    ap.add_argument("--blocks", type=int, default=8192, help="vLLM blocks per layer (16 tokens each)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    from lmcache.v1.gpu_connector.gpu_connectors import VLLMPagedMemGPUConnectorV2

    from lmcache_p2p.backend import send_gather
    from lmcache_p2p.backend.send_buffer import SendArena

    caches, slots = make_cache(a.tokens, a.blocks, seed=5)
    nbytes = 2 * LAYERS * a.tokens * HEADS * HEAD * 2
    rows = []
    for chunk in (int(c) for c in a.chunk_sizes.split(",")):
        shape = [torch.Size([2, LAYERS, chunk, HEADS * HEAD])]
        arena = SendArena(nbytes + 2 * LAYERS * chunk * HEADS * HEAD * 2, "cuda", shape, [torch.bfloat16])
        connector = VLLMPagedMemGPUConnectorV2(HEADS * HEAD, LAYERS, use_gpu=True, chunk_size=chunk,
                                               dtype=torch.bfloat16, device="cuda")
        base, base_bytes = run_path(connector, arena, caches, slots, chunk, a.tokens, a.repeats)
        undo = send_gather.install()
        try:
            ours, our_bytes = run_path(connector, arena, caches, slots, chunk, a.tokens, a.repeats)
        finally:
            undo()
        equal = all(torch.equal(x, y) for x, y in zip(base_bytes, our_bytes))
        rows += [{"path": "lmcache", "chunk_tokens": chunk, **base},
                 {"path": "p2p", "chunk_tokens": chunk, **ours, "bytes_equal_lmcache": equal}]
        del arena, connector, base_bytes, our_bytes
        torch.cuda.empty_cache()
    rows.append({"path": "copy", "chunk_tokens": None, "store_stream_ms_p50": copy_ceiling(nbytes, a.repeats)})
    for row in rows:
        ms = row.get("store_stream_ms_p50")
        row["gb_s"] = round(nbytes / ms / 1e6, 1) if ms else None
    result = {"tokens": a.tokens, "nbytes": nbytes, "layers": LAYERS, "rows": rows,
              "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    print(f"{'path':8} {'chunk':>6} {'chunks':>6} {'wall ms':>8} {'cpu ms':>7} {'stream ms':>9} {'GB/s':>7} equal")
    for r in rows:
        print(f"{r['path']:8} {r['chunk_tokens'] or '-':>6} {r.get('chunks', '-'):>6} {r.get('calls_wall_ms_p50', '-'):>8} "
              f"{r.get('cpu_ms_p50', '-'):>7} {r['store_stream_ms_p50']:>9} {r['gb_s']:>7} {r.get('bytes_equal_lmcache', '')}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(r.get("bytes_equal_lmcache", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
