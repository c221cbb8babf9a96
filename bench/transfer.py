"""Sender -> receiver throughput through our transports, beside a ceiling measured in the same run.

Two processes on one machine (spawned; each path's environment is set in them only): a receiver
with one registered buffer of slots, a sender with one pool of chunks. Each row moves
``--total-bytes`` as chunks of one size into SCATTERED slots (a random permutation per pass),
``--write-bytes`` of chunks per write (NIXL: one descriptor per chunk), ``--inflight`` writes in
flight. Time runs from the sender's first post to the receiver's last notification (one clock,
CLOCK_MONOTONIC, for both processes). Each figure is the best of ``--repeats`` (the machine may
be shared); the ceiling is measured between repetitions, on the same chunks and scattered slots:

  memcpy     (cpu)  the sender copies the chunks into a local host buffer with torch copy_
                    (best of 1 thread and torch's default threads); host buffers use huge pages
                    unless --no-hugepages
  peer_copy  (cuda) torch copy_ of each chunk from GPU 0 into a buffer on GPU 1 (device->device)
  h2d        (cuda) torch copy_ of each chunk from pinned host memory into a buffer on GPU 0,
                    the sender's own GPU (host->device paths: the PCIe limit)
  nccl_raw   (cuda) plain torch ProcessGroupNCCL send/recv of each chunk between the same two
                    processes (the NCCL transport's device->device path)

After the timed repetitions the receiver's slots are checked against the sender's chunks (two
64-bit checksums per slot, sum and position-weighted sum of 32-bit words): ``bytes_equal``.

    python bench/transfer.py                       # cpu: nixl-sm and nixl-tcp, host -> host
    python bench/transfer.py --device cuda         # 2 GPUs: nixl and nccl, vram->vram and host->vram

Writes ``bench/results/transfer_<cpu|gpu>.json`` (with ``--paths`` naming a path outside the
device's default set: ``transfer_<cpu|gpu>_alternatives.json``; a subset of the default set:
``transfer_<cpu|gpu>_subset.json``): ``{"meta": bench/meta.py's block, "rows": [...]}``, one row per
(path, chunk size) with ``path``, ``chunk_bytes``, ``gbps``, ``ceiling_name``, ``ceiling_gbps``,
``ratio``, ``bytes_equal`` and the settings used; ``"failed_paths"`` lists paths that raised.
GB/s = 1e9 bytes/s. Exit status 1 when a path failed or a row's bytes were not equal.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import random
import socket
import sys
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lmcache_p2p.buffer.memory import Memory

try:
    from bench.meta import collect
except ImportError:  # run as bench/transfer.py: its folder is sys.path[0]
    from meta import collect

NIXL = "lmcache_p2p.transport.nixl.transport:NixlTransport"
NCCL = "lmcache_p2p.transport.nccl.transport:NcclTransport"
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
           "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
UCX_GPU = {**GPU_ENV, "UCX_TLS": "cuda_ipc,cuda_copy,tcp,self"}


@dataclasses.dataclass(frozen=True)
class Side:
    memory: str  # "cpu" (huge-page host), "pinned" (page-locked host) or "cuda:N"
    device: str = ""  # the GPU the process works on ("" for none)
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # transport arguments


@dataclasses.dataclass(frozen=True)
class PathSpec:
    factory: str
    env: Mapping[str, str]
    tx: Side
    rx: Side
    ceiling: str  # memcpy | peer_copy | h2d | nccl_raw
    default: bool = True  # run without --paths


_RX_GPU = Side("cuda:1", "cuda:1")
_STAGE = {"stage_device": "cuda:0"}
PATHS: dict[str, dict[str, PathSpec]] = {
    "cpu": {
        "nixl-sm host->host": PathSpec(NIXL, {"UCX_TLS": "sm,self"}, Side("cpu"), Side("cpu"), "memcpy"),
        "nixl-tcp host->host": PathSpec(NIXL, {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}, Side("cpu"),
                                        Side("cpu"), "memcpy"),
    },
    "cuda": {
        "nixl vram->vram": PathSpec(NIXL, UCX_GPU, Side("cuda:0", "cuda:0"), _RX_GPU, "peer_copy"),
        # The default for a GPU sender: host chunks staged through a ring on GPU 0, then cuda_ipc.
        "nixl host->vram": PathSpec(NIXL, UCX_GPU, Side("pinned", "cuda:0", _STAGE), _RX_GPU, "h2d"),
        "nccl vram->vram": PathSpec(NCCL, GPU_ENV, Side("cuda:0", "cuda:0", {"device": "cuda:0"}),
                                    Side("cuda:1", "cuda:1", {"device": "cuda:1"}), "nccl_raw"),
        "nccl host->vram": PathSpec(NCCL, GPU_ENV, Side("pinned", "cuda:0", {"device": "cuda:0"}),
                                    Side("cuda:1", "cuda:1", {"device": "cuda:1"}), "h2d"),
        # Alternatives to the staging ring, for the record (--paths): UCX alone, with its rendezvous
        # fragments in GPU memory, with shared memory for its host-side lanes.
        "nixl host->vram unstaged": PathSpec(NIXL, UCX_GPU, Side("pinned", "cuda:0"), _RX_GPU, "h2d", False),
        "nixl host->vram unstaged frag=cuda": PathSpec(
            NIXL, {**UCX_GPU, "UCX_RNDV_FRAG_MEM_TYPE": "cuda"}, Side("pinned", "cuda:0"), _RX_GPU, "h2d", False),
        "nixl host->vram unstaged +sm frag=cuda": PathSpec(
            NIXL, {**UCX_GPU, "UCX_TLS": "cuda_ipc,cuda_copy,sm,self", "UCX_RNDV_FRAG_MEM_TYPE": "cuda"},
            Side("pinned", "cuda:0"), _RX_GPU, "h2d", False),
    },
}
TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class Row:
    path: str
    chunk_bytes: int
    gbps: float
    ceiling_name: str
    ceiling_gbps: float
    ratio: float
    bytes_equal: bool
    total_bytes: int
    write_bytes: int
    inflight: int
    repeats: int
    all_gbps: list[float]
    all_ceiling_gbps: list[float]
    torch_threads: int
    hugepages: bool


# ---- inside the peer processes ------------------------------------------------------------------


def _build(factory: str, name: str, kwargs: Mapping[str, Any]) -> Any:
    import importlib

    module, _, attr = factory.partition(":")
    return getattr(importlib.import_module(module), attr)(name, **kwargs).start()


def _sync(*devices: Any) -> None:
    import torch

    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def _checksums(buffer: Any, chunk: int) -> list[list[int]]:
    """[sum, position-weighted sum] of the 32-bit words of each ``chunk``-sized slot (wrapping int64)."""
    import torch

    words = buffer[: buffer.numel() // chunk * chunk].view(torch.int32).view(-1, chunk // 4)
    weights = torch.arange(chunk // 4, device=words.device, dtype=torch.int64) % 127 + 1
    out = []
    for row in words:  # one slot at a time keeps the temporaries small
        wide = row.to(torch.int64)
        out.append([int(wide.sum()), int((wide * weights).sum())])
    return out


class Peer:
    """One side of the benchmark: a transport, one registered buffer, and the ceilings."""

    def __init__(self, name: str, role: str, spec: PathSpec, hugepages: bool) -> None:
        import torch

        self.role = role
        self.side = spec.tx if role == "sender" else spec.rx
        self.hugepages = hugepages
        self.gpu = torch.device(self.side.device) if self.side.device else None
        if self.gpu is not None:
            torch.cuda.set_device(self.gpu)  # as a serving worker does
            torch.zeros(1, device=self.gpu)  # a CUDA context before the transport exists
        self.transport = _build(spec.factory, name, self.side.kwargs)
        self.buffer: Any = None
        self.srcs: list = []
        self.local: dict[str, Any] = {}
        self.mappings: list[Memory] = []  # keep huge-page mappings alive
        self.raw: Any = None  # the raw NCCL group of the nccl_raw ceiling
        self.raw_store: Any = None

    def _alloc(self, nbytes: int, memory: str) -> Any:
        import torch

        if memory == "cpu":
            mapping = Memory(nbytes, "cpu", hugepages=self.hugepages)
            self.mappings.append(mapping)
            return mapping.tensor
        if memory == "pinned":
            return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
        return torch.zeros(nbytes, dtype=torch.uint8, device=memory)

    def setup(self, nbytes: int) -> bytes:
        import msgspec
        import torch

        self.buffer = self._alloc(nbytes, self.side.memory)
        if self.role == "sender":
            maker = self.gpu or torch.device("cpu")
            self.buffer.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=maker))
            _sync(maker, self.buffer.device)
        self.transport.register(self.buffer)
        return msgspec.msgpack.encode(self.transport.info())

    def link(self, info: bytes) -> str:
        import msgspec

        from lmcache_p2p.protocol import TransportInfo
        from lmcache_p2p.transport import two_sided

        peer = msgspec.msgpack.decode(info, type=TransportInfo)
        if self.role == "receiver":
            hooks = two_sided(self.transport)
            if hooks is not None:  # one-sided transports need no pairing
                hooks.accept(peer)
            return peer.name
        return self.transport.connect(peer, TIMEOUT_S)

    def collect(self, count: int) -> float:
        """Receiver: wait for ``count`` notifications; return the monotonic time of the last."""
        deadline = time.monotonic() + TIMEOUT_S
        got = 0
        while got < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{got} of {count} notifications after {TIMEOUT_S}s")
            got += len(self.transport.wait_notifications(1.0))
        return time.monotonic()

    def prepare(self, plan: list[list[tuple[int, int, int]]]) -> None:
        """Sender: slice the source chunks of ``plan`` (writes of (src_off, dst_off, nbytes))."""
        self.srcs = [[self.buffer[s:s + n] for s, _, n in write] for write in plan]

    def send(self, peer: str, base_addr: int, plan: list[list[tuple[int, int, int]]], inflight: int) -> float:
        """Sender: post every write of ``plan``, at most ``inflight`` at once; return the start time."""
        dsts = [[base_addr + d for _, d, _ in write] for write in plan]
        pending: deque = deque()
        start = time.monotonic()
        for i, (srcs, addrs) in enumerate(zip(self.srcs, dsts)):
            if len(pending) >= inflight:
                self.transport.wait(pending.popleft(), TIMEOUT_S)
            pending.append(self.transport.write(peer, srcs, addrs, b"%d" % i))
        for handle in pending:
            self.transport.wait(handle, TIMEOUT_S)
        return start

    def checksums(self, chunk: int) -> list[list[int]]:
        """Checksums of every ``chunk``-sized slot of our buffer (on our GPU when we have one)."""
        buf = self.buffer if self.gpu is None or self.buffer.device.type == "cuda" else self.buffer.to(self.gpu)
        return _checksums(buf, chunk)

    # ---- ceilings (sender side) ----------------------------------------------------------------

    def copy_ceiling(self, kind: str, plan: list[list[tuple[int, int, int]]], dst_bytes: int, threads: int,
                     rx_memory: str) -> float:
        """Seconds to copy the chunks of ``plan`` into scattered slots of a local buffer: host
        (memcpy, with ``threads`` torch threads), the receiver's GPU (peer_copy) or our GPU (h2d)."""
        import torch

        where = {"memcpy": "cpu", "peer_copy": rx_memory, "h2d": str(self.gpu)}[kind]
        local = self.local.get(where)
        if local is None or local.numel() != dst_bytes:
            local = self.local[where] = self._alloc(dst_bytes, where)
        outs = [[local[d:d + n] for _, d, n in write] for write in plan]
        default_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            _sync(self.buffer.device, local.device)
            start = time.perf_counter()
            for srcs, dsts in zip(self.srcs, outs):
                for src, out in zip(srcs, dsts):
                    out.copy_(src, non_blocking=True)
            _sync(self.buffer.device, local.device)
            return time.perf_counter() - start
        finally:
            torch.set_num_threads(default_threads)

    def raw_setup(self, port: int) -> None:
        """A plain 2-rank ProcessGroupNCCL (receiver rank 0 hosts the store), warmed up."""
        import datetime

        import torch
        import torch.distributed as dist

        rank = 0 if self.role == "receiver" else 1
        timeout = datetime.timedelta(seconds=TIMEOUT_S)
        self.raw_store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout)
        self.raw = dist.ProcessGroupNCCL(dist.PrefixStore("raw/", self.raw_store), rank, 2)
        probe = torch.ones(1024, device=self.gpu)
        work = self.raw.send([probe], 0, 0) if rank == 1 else self.raw.recv([probe], 1, 0)
        work.wait()
        _sync(self.gpu)

    def raw_run(self, plan: list[list[tuple[int, int, int]]]) -> float:
        """Sender: send every chunk of ``plan``; receiver: receive each into its scattered slot.
        Returns the sender's start time / the receiver's end time (monotonic)."""
        if self.role == "sender":
            start = time.monotonic()
            works = [self.raw.send([src], 0, 0) for srcs in self.srcs for src in srcs]
            works[-1].wait()
            _sync(self.gpu)
            return start
        works = [self.raw.recv([self.buffer[d:d + n]], 1, 0) for write in plan for _, d, n in write]
        works[-1].wait()
        _sync(self.gpu)
        return time.monotonic()

    def threads(self) -> int:
        import torch

        return torch.get_num_threads()

    def close(self) -> None:
        self.transport.close()
        if self.raw is not None:
            self.raw.abort()
            self.raw = self.raw_store = None


def _serve(conn, env: dict[str, str], name: str, role: str, spec: PathSpec, hugepages: bool) -> None:
    os.environ.update(env)
    try:
        peer = Peer(name, role, spec, hugepages)
    except BaseException as exc:
        conn.send(("err", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ok", None))
    while True:
        op, args = conn.recv()
        try:
            result = getattr(peer, op)(*args)
        except BaseException as exc:
            conn.send(("err", f"{type(exc).__name__}: {exc}"))
            continue
        conn.send(("ok", result))
        if op == "close":
            return


# ---- in the driving process ---------------------------------------------------------------------


class Proc:
    def __init__(self, spec: PathSpec, name: str, role: str, args: argparse.Namespace) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_serve, args=(child, dict(spec.env), name, role, spec, args.hugepages), daemon=True
        )
        self.process.start()
        child.close()
        self.finish("start")

    def begin(self, op: str, *args: Any) -> None:
        self.conn.send((op, args))

    def finish(self, op: str) -> Any:
        if not self.conn.poll(TIMEOUT_S):
            raise TimeoutError(f"no answer to {op} within {TIMEOUT_S}s")
        try:
            status, value = self.conn.recv()
        except EOFError as exc:
            raise RuntimeError(f"the peer process died during {op} (exit {self.process.exitcode})") from exc
        if status != "ok":
            raise RuntimeError(f"{op} failed in the peer: {value}")
        return value

    def call(self, op: str, *args: Any) -> Any:
        self.begin(op, *args)
        return self.finish(op)

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.call("close")
            except (RuntimeError, TimeoutError, OSError):
                pass
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()


def make_plan(total: int, chunk: int, buffer_bytes: int, write_bytes: int, rng: random.Random):
    """Writes of (src_off, dst_off, nbytes): chunk i comes from source slot i and lands in a
    scattered receiver slot (a fresh random permutation per pass over the buffer)."""
    slots = buffer_bytes // chunk
    count = total // chunk
    per_write = max(1, write_bytes // chunk)
    order: list[int] = []
    while len(order) < count:
        perm = list(range(slots))
        rng.shuffle(perm)
        order += perm
    chunks = [((i % slots) * chunk, order[i] * chunk, chunk) for i in range(count)]
    return [chunks[i:i + per_write] for i in range(0, count, per_write)]


def final_sources(plan: list[list[tuple[int, int, int]]], chunk: int) -> dict[int, int]:
    """Receiver slot -> the sender slot whose chunk landed there last."""
    final = {}
    for write in plan:
        for src, dst, _ in write:
            final[dst // chunk] = src // chunk
    return final


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_path(name: str, spec: PathSpec, args: argparse.Namespace) -> list[Row]:
    import msgspec

    from lmcache_p2p.protocol import TransportInfo

    tag = f"{os.getpid()}-{abs(hash(name)) % 10**6}"
    procs: list[Proc] = []
    try:
        rx = Proc(spec, f"bench-rx-{tag}", "receiver", args)
        procs.append(rx)
        tx = Proc(spec, f"bench-tx-{tag}", "sender", args)
        procs.append(tx)
        rx_info = rx.call("setup", args.buffer_bytes)
        tx_info = tx.call("setup", args.buffer_bytes)
        rx.call("link", tx_info)
        peer = tx.call("link", rx_info)
        base = msgspec.msgpack.decode(rx_info, type=TransportInfo).regions[0].addr
        if spec.ceiling == "nccl_raw":
            port = free_port()
            rx.begin("raw_setup", port)
            tx.call("raw_setup", port)
            rx.finish("raw_setup")
        threads = tx.call("threads")
        rows = []
        for chunk in args.chunk_sizes:
            rows.append(_row(name, spec, chunk, rx, tx, peer, base, threads, args))
            print(_line(rows[-1]), flush=True)
        return rows
    finally:
        for proc in reversed(procs):
            proc.stop()


def _ceiling_gbps(spec: PathSpec, plan: list, nbytes: int, rx: Proc, tx: Proc, threads: int,
                  args: argparse.Namespace) -> float:
    if spec.ceiling == "nccl_raw":
        rx.begin("raw_run", plan)
        start = tx.call("raw_run", plan)
        return nbytes / (rx.finish("raw_run") - start) / 1e9
    counts = {1, threads} if spec.ceiling == "memcpy" else {threads}
    return max(nbytes / tx.call("copy_ceiling", spec.ceiling, plan, args.buffer_bytes, n, spec.rx.memory) / 1e9
               for n in counts)


def _row(name: str, spec: PathSpec, chunk: int, rx: Proc, tx: Proc, peer: str, base: int, threads: int,
         args: argparse.Namespace) -> Row:
    rng = random.Random(chunk)
    plan = make_plan(args.total_bytes, chunk, args.buffer_bytes, args.write_bytes, rng)
    tx.call("prepare", plan)
    nbytes = sum(n for write in plan for _, _, n in write)
    gbps, ceiling = [], []
    for _ in range(args.repeats):
        rx.begin("collect", len(plan))
        start = tx.call("send", peer, base, plan, args.inflight)
        end = rx.finish("collect")
        gbps.append(nbytes / (end - start) / 1e9)
        ceiling.append(_ceiling_gbps(spec, plan, nbytes, rx, tx, threads, args))
    # The raw NCCL ceiling wrote into the receiver's slots too: send the plan once more, then compare.
    if spec.ceiling == "nccl_raw":
        rx.begin("collect", len(plan))
        tx.call("send", peer, base, plan, args.inflight)
        rx.finish("collect")
    landed = rx.call("checksums", chunk)
    sent = tx.call("checksums", chunk)
    equal = all(landed[dst] == sent[src] for dst, src in final_sources(plan, chunk).items())
    best, best_ceiling = max(gbps), max(ceiling)
    return Row(
        path=name, chunk_bytes=chunk, gbps=round(best, 3), ceiling_name=spec.ceiling,
        ceiling_gbps=round(best_ceiling, 3), ratio=round(best / best_ceiling, 3), bytes_equal=equal,
        total_bytes=nbytes, write_bytes=args.write_bytes, inflight=args.inflight, repeats=args.repeats,
        all_gbps=[round(g, 3) for g in gbps], all_ceiling_gbps=[round(c, 3) for c in ceiling],
        torch_threads=threads, hugepages=args.hugepages and "cpu" in (spec.tx.memory, spec.rx.memory),
    )


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


DEFAULTS = {  # per device: chunk sizes, total, buffer, bytes per write, writes in flight
    "cpu": ("256K,2M,32M", "1G", "256M", "32M", 4),
    "cuda": ("2M,8M,32M,128M", "4G", "1G", "128M", 4),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=sorted(PATHS), default="cpu")
    parser.add_argument("--paths", default="", help="comma-separated subset of the device's paths (see PATHS)")
    parser.add_argument("--chunk-sizes", default=None)
    parser.add_argument("--total-bytes", default=None)
    parser.add_argument("--buffer-bytes", default=None, help="receiver buffer and sender pool")
    parser.add_argument("--write-bytes", default=None, help="chunk bytes per write")
    parser.add_argument("--inflight", default=None, type=int, help="writes in flight")
    parser.add_argument("--repeats", default=3, type=int)
    parser.add_argument("--hugepages", action=argparse.BooleanOptionalAction, default=True,
                        help="back host buffers with transparent huge pages (madvise)")
    parser.add_argument("--out", default="", help="JSON output (default bench/results/transfer_<cpu|gpu>.json; "
                        "_alternatives.json / _subset.json with --paths, see the module docstring)")
    args = parser.parse_args(argv)
    chunks, total, buffer, write, inflight = DEFAULTS[args.device]
    args.chunk_sizes = [parse_size(x) for x in (args.chunk_sizes or chunks).split(",")]
    args.total_bytes = parse_size(args.total_bytes or total)
    args.buffer_bytes = parse_size(args.buffer_bytes or buffer)
    args.write_bytes = parse_size(args.write_bytes or write)
    args.inflight = args.inflight or inflight
    return args


def _line(row: Row) -> str:
    chunk = f"{row.chunk_bytes >> 20}M" if row.chunk_bytes >= 1 << 20 else f"{row.chunk_bytes >> 10}K"
    return (f"{row.path:<38} {chunk:>6} {row.gbps:>8.2f} {row.ceiling_name:>10} {row.ceiling_gbps:>8.2f} "
            f"{row.ratio:>6.2f} {'yes' if row.bytes_equal else 'NO':>5}  {row.all_gbps}")


def print_table(rows: list[Row]) -> None:
    print(f"{'path':<38} {'chunk':>6} {'GB/s':>8} {'ceiling':>10} {'GB/s':>8} {'ratio':>6} {'equal':>5}  all GB/s")
    for row in rows:
        print(_line(row))


def default_out(device: str, chosen: list[str]) -> Path:
    """Where a run writes without ``--out``: the default path set has the device's file; any other
    set its own file, so that a partial run never overwrites the full one."""
    label = "gpu" if device == "cuda" else device
    defaults = [n for n, s in PATHS[device].items() if s.default]
    suffix = "" if chosen == defaults else "_subset" if set(chosen) <= set(defaults) else "_alternatives"
    return Path(__file__).parent / "results" / f"transfer_{label}{suffix}.json"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    meta = collect(["bench/transfer.py", *(sys.argv[1:] if argv is None else argv)])
    paths = PATHS[args.device]
    chosen = [p.strip() for p in args.paths.split(",") if p.strip()] or [n for n, s in paths.items() if s.default]
    unknown = [n for n in chosen if n not in paths]
    if unknown:
        raise SystemExit(f"--paths: unknown {unknown} for --device {args.device}; known: {', '.join(paths)}")
    rows: list[Row] = []
    failed: list[str] = []
    for name in chosen:
        print(f"[transfer] {name}", flush=True)
        try:
            rows += run_path(name, paths[name], args)
        except (RuntimeError, TimeoutError) as exc:  # one broken path must not lose the others' rows
            print(f"[transfer] {name} FAILED: {exc}", flush=True)
            failed.append(name)
    print_table(rows)
    out = Path(args.out) if args.out else default_out(args.device, chosen)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"meta": meta, "failed_paths": failed, "rows": [dataclasses.asdict(r) for r in rows]}
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    unequal = [f"{r.path} {r.chunk_bytes}" for r in rows if not r.bytes_equal]
    if failed or unequal:
        print(f"[transfer] FAILED paths: {failed or 'none'}; rows with bytes not equal: {unequal or 'none'}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
