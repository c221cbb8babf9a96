"""Sender -> receiver throughput through NixlTransport, beside an in-process memcpy ceiling.

Two processes on one machine (spawned; the UCX environment is set in them only): a receiver
with one registered buffer of slots, a sender with one registered pool of chunks. Each row moves
``--total-bytes`` (1 GiB) as chunks of one size into SCATTERED slots (a random permutation),
``--write-bytes`` of chunks per write (one NIXL descriptor per chunk), ``--inflight`` writes in
flight. Time runs from the sender's first post to the receiver's last notification (one clock,
CLOCK_MONOTONIC, for both processes). The ceiling is measured in the same run, between
repetitions: the sender process copies the same chunks into scattered slots of a local buffer
with ``torch`` ``copy_`` (best of 1 thread and torch's default threads). Host buffers are backed by
transparent huge pages unless ``--no-hugepages``. Each figure is the best of ``--repeats``
repetitions (the machine is shared). GB/s = 1e9 bytes/s.

    python bench/transfer.py                       # cpu: nixl-sm and nixl-tcp, host -> host
    python bench/transfer.py --device cuda         # GPU buffers over cuda_ipc (not run on CPU machines)

Writes ``bench/results/transfer_<device>.json``: one row per (path, chunk size) with ``path``,
``chunk_bytes``, ``gbps``, ``ceiling_gbps``, ``ratio`` and the settings used.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import random
import time
from collections import deque
from pathlib import Path
from typing import Any

from lmcache_p2p.buffer.memory import Memory

# UCX environment per path, set in the two peer processes only.
PATHS: dict[str, dict[str, dict[str, str]]] = {
    "cpu": {
        "nixl-sm": {"UCX_TLS": "sm,self"},
        "nixl-tcp": {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"},
    },
    # Untested here (no GPU on the CPU machines): receiver on the last GPU, sender on GPU 0.
    "cuda": {
        "nixl-cuda_ipc": {"UCX_TLS": "cuda_ipc,cuda_copy,sm,self"},
    },
}
MEMORY_LABEL = {"cpu": "host->host", "cuda": "device->device"}
TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class Row:
    path: str
    chunk_bytes: int
    gbps: float
    ceiling_gbps: float
    ratio: float
    total_bytes: int
    write_bytes: int
    inflight: int
    repeats: int
    all_gbps: list[float]
    all_ceiling_gbps: list[float]
    torch_threads: int
    hugepages: bool


# ---- inside the peer processes ------------------------------------------------------------------


def _device(kind: str, role: str) -> Any:
    import torch

    if kind == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if count == 0:
        raise RuntimeError("--device cuda needs a CUDA device")
    index = count - 1 if role == "receiver" else 0
    torch.cuda.set_device(index)
    torch.zeros(1, device=f"cuda:{index}")  # a CUDA context before the NIXL agent exists
    return torch.device("cuda", index)


def _ceiling_device(device: Any) -> Any:
    """Where the ceiling copy lands: host memory, or the receiver's GPU (a peer copy)."""
    import torch

    return device if device.type == "cpu" else torch.device("cuda", torch.cuda.device_count() - 1)


def _buffer(nbytes: int, device: Any, hugepages: bool) -> tuple[Any, Memory]:
    """A zeroed uint8 buffer, allocated as the receiver allocates its buffer (huge pages on the host)."""
    memory = Memory(nbytes, str(device), hugepages=hugepages)
    return memory.tensor, memory


def _sync(*devices: Any) -> None:
    import torch

    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


class Peer:
    """One side of the benchmark: a NixlTransport and one registered buffer."""

    def __init__(self, name: str, role: str, device_kind: str, hugepages: bool) -> None:
        from lmcache_p2p.transport.nixl import NixlTransport

        self.role = role
        self.device = _device(device_kind, role)
        self.hugepages = hugepages
        self.transport = NixlTransport(name)
        self.buffer = None
        self.srcs: list = []
        self.local = None
        self.mappings: list[Any] = []  # keep huge-page mappings alive

    def setup(self, nbytes: int) -> bytes:
        import msgspec
        import torch

        self.buffer = self._alloc(nbytes)
        if self.role == "sender":
            self.buffer.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=self.device))
        self.transport.register(self.buffer)
        return msgspec.msgpack.encode(self.transport.info())

    def link(self, info: bytes) -> str:
        import msgspec

        from lmcache_p2p.protocol import TransportInfo

        peer = msgspec.msgpack.decode(info, type=TransportInfo)
        if self.role == "receiver":
            self.transport.accept(peer)
            return peer.name
        return self.transport.connect(peer, TIMEOUT_S)

    def _alloc(self, nbytes: int, device: Any = None) -> Any:
        tensor, mapping = _buffer(nbytes, device or self.device, self.hugepages)
        self.mappings.append(mapping)
        return tensor

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

    def memcpy(self, plan: list[list[tuple[int, int, int]]], dst_bytes: int, threads: int) -> float:
        """Sender: copy the same chunks into scattered slots of a local buffer with ``threads``
        torch threads; return seconds."""
        import torch

        default_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return self._memcpy(plan, dst_bytes)
        finally:
            torch.set_num_threads(default_threads)

    def _memcpy(self, plan: list[list[tuple[int, int, int]]], dst_bytes: int) -> float:
        if self.local is None or self.local.numel() != dst_bytes:
            self.local = self._alloc(dst_bytes, _ceiling_device(self.device))
        dsts = [[self.local[d:d + n] for _, d, n in write] for write in plan]
        _sync(self.device, self.local.device)
        start = time.perf_counter()
        for srcs, outs in zip(self.srcs, dsts):
            for src, out in zip(srcs, outs):
                out.copy_(src, non_blocking=True)
        _sync(self.device, self.local.device)
        return time.perf_counter() - start

    def threads(self) -> int:
        import torch

        return torch.get_num_threads()

    def close(self) -> None:
        self.transport.close()


def _serve(conn, env: dict[str, str], name: str, role: str, device_kind: str, hugepages: bool) -> None:
    os.environ.update(env)
    try:
        peer = Peer(name, role, device_kind, hugepages)
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
    def __init__(self, env: dict[str, str], name: str, role: str, args: argparse.Namespace) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_serve, args=(child, env, name, role, args.device, args.hugepages), daemon=True
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


def run_path(name: str, env: dict[str, str], args: argparse.Namespace) -> list[Row]:
    import msgspec

    from lmcache_p2p.protocol import TransportInfo

    tag = f"{os.getpid()}-{name}"
    procs: list[Proc] = []
    try:
        rx = Proc(env, f"bench-rx-{tag}", "receiver", args)
        procs.append(rx)
        tx = Proc(env, f"bench-tx-{tag}", "sender", args)
        procs.append(tx)
        rx_info = rx.call("setup", args.buffer_bytes)
        tx_info = tx.call("setup", args.buffer_bytes)
        rx.call("link", tx_info)
        peer = tx.call("link", rx_info)
        base = msgspec.msgpack.decode(rx_info, type=TransportInfo).regions[0].addr
        threads = tx.call("threads")
        return [_row(name, chunk, rx, tx, peer, base, threads, args) for chunk in args.chunk_sizes]
    finally:
        for proc in reversed(procs):
            proc.stop()


def _row(name: str, chunk: int, rx: Proc, tx: Proc, peer: str, base: int, threads: int,
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
        # The ceiling is the best copy the machine gives, single-threaded or with torch's threads
        # (with a core taken by someone else, torch's 2-thread copy can be the slower one).
        ceiling.append(max(nbytes / tx.call("memcpy", plan, args.buffer_bytes, n) / 1e9 for n in {1, threads}))
    best, best_ceiling = max(gbps), max(ceiling)
    return Row(
        path=f"{name} {MEMORY_LABEL[args.device]}", chunk_bytes=chunk, gbps=round(best, 3),
        ceiling_gbps=round(best_ceiling, 3), ratio=round(best / best_ceiling, 3), total_bytes=nbytes,
        write_bytes=args.write_bytes, inflight=args.inflight, repeats=args.repeats,
        all_gbps=[round(g, 3) for g in gbps], all_ceiling_gbps=[round(c, 3) for c in ceiling],
        torch_threads=threads, hugepages=args.hugepages and args.device == "cpu",
    )


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=sorted(PATHS), default="cpu")
    parser.add_argument("--paths", default="", help="comma-separated subset of the device's paths")
    parser.add_argument("--chunk-sizes", default="256K,2M,32M", type=lambda s: [parse_size(x) for x in s.split(",")])
    parser.add_argument("--total-bytes", default="1G", type=parse_size)
    parser.add_argument("--buffer-bytes", default="256M", type=parse_size, help="receiver buffer and sender pool")
    parser.add_argument("--write-bytes", default="32M", type=parse_size, help="chunk bytes per write")
    parser.add_argument("--inflight", default=4, type=int, help="writes in flight")
    parser.add_argument("--repeats", default=3, type=int)
    parser.add_argument("--hugepages", action=argparse.BooleanOptionalAction, default=True,
                        help="back host buffers with transparent huge pages (madvise)")
    parser.add_argument("--out", default="", help="JSON output (default bench/results/transfer_<device>.json)")
    return parser.parse_args(argv)


def print_table(rows: list[Row]) -> None:
    print(f"{'path':<28} {'chunk':>8} {'GB/s':>7} {'memcpy GB/s':>12} {'ratio':>6}  all GB/s")
    for row in rows:
        chunk = f"{row.chunk_bytes >> 20}M" if row.chunk_bytes >= 1 << 20 else f"{row.chunk_bytes >> 10}K"
        print(f"{row.path:<28} {chunk:>8} {row.gbps:>7.2f} {row.ceiling_gbps:>12.2f} {row.ratio:>6.2f}  {row.all_gbps}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    paths = PATHS[args.device]
    chosen = [p for p in args.paths.split(",") if p] or list(paths)
    rows: list[Row] = []
    for name in chosen:
        rows += run_path(name, paths[name], args)
    print_table(rows)
    out = Path(args.out or Path(__file__).parent / "results" / f"transfer_{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
