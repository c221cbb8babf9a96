"""What runs inside each peer process of the transport contract suite.

The test process drives a peer through a pipe with ``(op, args)`` commands and gets back
``("ok", value)`` or ``("err", exception type name, message)``. A peer owns one transport, one
registered buffer (the receive buffer on a receiver, the source pool on a sender) and the write
handles it started. TransportInfo crosses the pipe as msgspec MessagePack bytes, never pickled.
A peer's buffer lives in pageable host memory, pinned host memory or on a GPU ("cpu", "pinned",
"cuda:N"); digests and checks are computed on host copies, so every case compares real bytes.

Nothing heavy is imported at module level: the UCX environment is set in :func:`serve` first.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import time
import traceback
from collections.abc import Mapping
from typing import Any

import msgspec

from lmcache_p2p.protocol import TransportInfo


def encode_info(info: TransportInfo) -> bytes:
    return msgspec.msgpack.encode(info)


def decode_info(data: bytes) -> TransportInfo:
    return msgspec.msgpack.decode(data, type=TransportInfo)


def build_transport(factory: str, name: str, kwargs: Mapping[str, Any]):
    """``factory`` is ``"module:callable"``; it is called as ``callable(name, **kwargs)`` (built, not started)."""
    module, _, attr = factory.partition(":")
    return getattr(importlib.import_module(module), attr)(name, **kwargs)


def place(tensor, memory: str):
    """``tensor`` (host) moved to ``memory``: "cpu", "pinned" or "cuda:N"."""
    if memory == "cpu":
        return tensor
    if memory == "pinned":
        return tensor.pin_memory()
    return tensor.to(memory)


def settle(tensor) -> None:
    """Wait until our fills and copies into ``tensor`` landed: a peer's GPU or UCX reads and writes
    this memory outside torch's streams. Only the current stream: a device-wide synchronize would
    also wait for NCCL ops stuck on a stopped peer."""
    if tensor.device.type == "cuda":
        import torch

        torch.cuda.current_stream(tensor.device).synchronize()


class PeerState:
    """The transport, buffer and handles of one peer process; one method per command."""

    def __init__(self, factory: str, name: str, kwargs: Mapping[str, Any], memory: str = "cpu") -> None:
        self.factory, self.name, self.kwargs, self.memory = factory, name, dict(kwargs), memory
        self.transport = build_transport(factory, name, kwargs).start()
        self.buffer = None
        self.handles: dict[int, Any] = {}

    # ---- setup ---------------------------------------------------------------------------------

    def setup(self, nbytes: int, fill: int) -> bytes:
        import torch

        self.buffer = place(torch.full((nbytes,), fill, dtype=torch.uint8), self.memory)
        settle(self.buffer)
        self.transport.register(self.buffer)
        return encode_info(self.transport.info())

    def accept(self, info: bytes) -> None:
        """A sender said Hello: two-sided transports pair here; one-sided ones need nothing."""
        from lmcache_p2p.transport import two_sided

        hooks = two_sided(self.transport)
        if hooks is not None:
            hooks.accept(decode_info(info))

    def connect(self, info: bytes, timeout_s: float) -> str:
        return self.transport.connect(decode_info(info), timeout_s)

    def disconnect(self, peer: str) -> None:
        self.transport.disconnect(peer)

    # ---- sender --------------------------------------------------------------------------------

    def write(self, peer: str, chunks: list[tuple[int, int]], dst_addrs: list[int], notif: bytes,
              registered: bool = True) -> tuple[int, list[str]]:
        """Fill each source chunk (offset, nbytes) with fresh random bytes and write it out.

        ``registered=False`` writes from fresh tensors outside every registered region (pageable
        host memory for host peers, fresh device memory for GPU peers).
        Returns the handle id and the sha256 of each chunk, read back from the source memory.
        """
        import torch

        gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        srcs = []
        for offset, nbytes in chunks:
            data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
            if registered:
                src = self.buffer[offset:offset + nbytes]
                src.copy_(data)
            else:
                src = data if self.memory in ("cpu", "pinned") else place(data, self.memory)
            srcs.append(src)
        digests = [hashlib.sha256(src.cpu().numpy()).hexdigest() for src in srcs]
        settle(srcs[0])
        handle = self.transport.write(peer, srcs, dst_addrs, notif)
        self.handles[id(handle)] = (handle, srcs)
        return id(handle), digests

    def wait(self, handle_id: int, timeout_s: float) -> float:
        """Wait for a write; returns the seconds waited."""
        handle, _ = self.handles.pop(handle_id)
        start = time.monotonic()
        try:
            self.transport.wait(handle, timeout_s)
        finally:
            elapsed = time.monotonic() - start
        return elapsed

    def abort(self, handle_id: int) -> None:
        handle, _ = self.handles[handle_id]
        self.transport.abort(handle)

    def poll_error(self, handle_id: int) -> str:
        """The type name of what ``poll`` raises for this write ("" if it does not raise)."""
        from lmcache_p2p.errors import P2PError

        handle, _ = self.handles[handle_id]
        try:
            self.transport.poll(handle)
        except P2PError as exc:
            return type(exc).__name__
        return ""

    def posted_within(self, handle_id: int, timeout_s: float) -> bool:
        """Until the write is on the wire (then True) or ``timeout_s`` passed (then False). NCCL posts it from its
        pair thread (the handle's ``PendingWrite.posted``); NIXL posts it inside ``write``."""
        handle, _ = self.handles[handle_id]
        write = handle.token[1] if isinstance(handle.token, tuple) and len(handle.token) == 2 else None
        if not hasattr(write, "posted"):
            return True
        deadline = time.monotonic() + timeout_s
        while not write.posted:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)
        return True

    def settle_within(self, handle_id: int, timeout_s: float) -> bool:
        """Poll ``settled`` until it is True (then True) or ``timeout_s`` passed (then False)."""
        handle, _ = self.handles[handle_id]
        deadline = time.monotonic() + timeout_s
        while not self.transport.settled(handle):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)
        return True

    def write_until_error(self, peer: str, nbytes: int, dst_addr: int, timeout_s: float, budget_s: float) -> str:
        """Write and wait repeatedly until the transport raises; return the error's type name."""
        from lmcache_p2p.errors import TransportError

        deadline = time.monotonic() + budget_s
        while time.monotonic() < deadline:
            try:
                handle = self.transport.write(peer, [self.buffer[:nbytes]], [dst_addr], b"after-death")
                self.transport.wait(handle, timeout_s)
            except TransportError as exc:
                return type(exc).__name__
        raise AssertionError(f"every write to dead peer {peer} succeeded for {budget_s}s")

    # ---- receiver ------------------------------------------------------------------------------

    def notifications(self, count: int, timeout_s: float) -> list[tuple[str, bytes]]:
        """Collect notifications until ``count`` arrived or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        got: list[tuple[str, bytes]] = []
        while len(got) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            got += [(n.peer, n.payload) for n in self.transport.wait_notifications(left)]
        return got

    def notifications_until(self, payload: bytes, timeout_s: float) -> list[tuple[str, bytes]]:
        """Collect notifications until one carries ``payload`` or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        got: list[tuple[str, bytes]] = []
        while not any(p == payload for _, p in got) and time.monotonic() < deadline:
            got += [(n.peer, n.payload) for n in self.transport.wait_notifications(deadline - time.monotonic())]
        return got

    def wait_notifications(self, timeout_s: float) -> tuple[list[tuple[str, bytes]], float]:
        start = time.monotonic()
        notifs = self.transport.wait_notifications(timeout_s)
        return [(n.peer, n.payload) for n in notifs], time.monotonic() - start

    def check(self, ranges: list[tuple[int, int]], fill: int) -> tuple[list[str], int]:
        """sha256 of each (offset, nbytes) range, and how many bytes outside them are not ``fill``.

        Resets the whole buffer to ``fill`` afterwards, ready for the next case.
        """
        host = self.buffer.cpu()  # a device buffer: its bytes as they landed (cpu() waits for the copy)
        digests = [hashlib.sha256(host[o:o + n].numpy()).hexdigest() for o, n in ranges]
        outside = host.clone()
        for offset, nbytes in ranges:
            outside[offset:offset + nbytes] = fill
        stray = int((outside != fill).sum())
        self.buffer.fill_(fill)
        settle(self.buffer)
        return digests, stray

    # ---- lifecycle -----------------------------------------------------------------------------

    def _contract_calls(self, transport, tensor) -> dict[str, Any]:
        """One call of each contract method on ``transport``, by name."""
        return {
            "register": lambda: transport.register(tensor),
            "info": transport.info,
            "connect": lambda: transport.connect(self.transport.info(), 1.0),
            "write": lambda: transport.write("nobody", [tensor], [0], b"x"),
            "get_notifications": transport.get_notifications,
            "disconnect": lambda: transport.disconnect("nobody"),
        }

    def close_check(self) -> list[str]:
        """Build a second transport, close it twice, then try each method; return what each raised."""
        import torch

        from lmcache_p2p.errors import ClosedError

        transport = build_transport(self.factory, self.name + "-closing", self.kwargs).start()
        tensor = torch.zeros(4096, dtype=torch.uint8)
        transport.register(tensor)
        transport.close()
        transport.close()
        calls = self._contract_calls(transport, tensor)
        raised = []
        for name, call in calls.items():
            try:
                call()
            except ClosedError:
                raised.append(name)
        transport.close()
        return raised

    def unstarted_check(self) -> dict[str, list[str]]:
        """Build a transport and use it before ``start()``, close it unstarted, then start it:
        return which calls raised ClosedError in each phase."""
        import torch

        from lmcache_p2p.errors import ClosedError

        transport = build_transport(self.factory, self.name + "-unstarted", self.kwargs)
        tensor = torch.zeros(4096, dtype=torch.uint8)
        calls = self._contract_calls(transport, tensor)
        phases: dict[str, list[str]] = {"built": [], "closed": []}
        for phase in phases:
            if phase == "closed":
                transport.close()
                transport.close()
                calls["start"] = transport.start
            for name, call in calls.items():
                try:
                    call()
                except ClosedError:
                    phases[phase].append(name)
        return phases

    def close(self) -> None:
        self.transport.close()
        self.transport.close()


def serve(conn, env: Mapping[str, str], factory: str, name: str, kwargs: Mapping[str, Any], memory: str = "cpu",
          device: str = "") -> None:
    """Entry point of a peer process: set the environment, pick its GPU, build the transport, run commands."""
    os.environ.update(env)
    try:
        if device:  # as a serving engine's worker does before LMCache builds its backends
            import torch

            torch.cuda.set_device(torch.device(device))
        state = PeerState(factory, name, kwargs, memory)
        conn.send(("ok", None))
    except BaseException as exc:  # report start-up failures to the test instead of dying silently
        conn.send(("err", type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))
        return
    while True:
        op, args = conn.recv()
        if op == "exit":
            state.close()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(state, op)(*args)))
        except BaseException as exc:
            conn.send(("err", type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))
