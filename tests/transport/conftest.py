"""The transport registry of the contract suite, and the two-process harness that runs it.

To add a transport, add one entry to :data:`TRANSPORTS`: how a peer process builds it (a
``"module:callable"`` called as ``callable(name, **kwargs)``), the environment of its peer
processes, where each side's memory lives (host, pinned host or a GPU) and whether a stopped
receiver stalls its writes. Every test in test_contract.py then runs against it. Entries that
need GPUs are skipped where fewer are present (the CPU machines); they run on the GPU machine
(scripts/device_gpu_checks.sh), one process per GPU.

Each case runs between two real processes (spawned; the environment is set in them only):

    receiver: create, start, register its buffer, publish info ----> sender
    sender:   create, start, register its source pool, publish info ----> receiver
    receiver: accept(sender info)          (two-sided transports only: they start pairing here;
                                            must not block)
    sender:   connect(receiver info)       (then writes)
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

import transport_peer
from lmcache_p2p import errors
from lmcache_p2p.protocol import TransportInfo


@dataclasses.dataclass(frozen=True)
class Side:
    """One peer of a case: where its buffer lives and its own transport arguments."""

    memory: str = "cpu"  # "cpu" (pageable host), "pinned" (page-locked host) or "cuda:N"
    device: str = ""  # the GPU the process works on (torch.cuda.set_device), "" for none
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # over the case's kwargs


@dataclasses.dataclass(frozen=True)
class TransportCase:
    factory: str  # "module:callable", called in the peer process as callable(name, **kwargs)
    env: Mapping[str, str]  # set in the peer processes only
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # True when a receiver that makes no progress (SIGSTOPped) keeps writes to it from completing;
    # False for truly one-sided paths (UCX shared memory writes with CMA, done by the sender alone);
    # None where it depends on whether UCX finished wiring up before the stop (cuda_ipc is
    # one-sided, its wire-up is not): then only the deadlines are checked.
    stalls_without_receiver: bool | None = True
    rx: Side = Side()
    tx: Side = Side()
    gpus: int = 0  # CUDA devices the case needs

    def side(self, role: str) -> Side:
        return self.rx if role == "rx" else self.tx


NIXL = "lmcache_p2p.transport.nixl.transport:NixlTransport"
NCCL = "lmcache_p2p.transport.nccl.transport:NcclTransport"

# On the GPU machine: receiver on GPU 1, sender on GPU 0 (one process per GPU). NVLink multicast
# stays off (the machine's rule). A failed NCCL op fails its pair, not the process: the NCCL
# transport sets TORCH_NCCL_ASYNC_ERROR_HANDLING itself (group.nccl_env_for_pairs), so the cases
# leave it unset, as a user would.
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
UCX_GPU_ENV = {**GPU_ENV, "UCX_TLS": "cuda_ipc,cuda_copy,tcp,self"}
NCCL_GPU_ENV = dict(GPU_ENV)
RX_GPU = Side("cuda:1", "cuda:1")

TRANSPORTS: dict[str, TransportCase] = {
    "nixl-tcp": TransportCase(NIXL, {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}),
    "nixl-sm": TransportCase(NIXL, {"UCX_TLS": "sm,self"}, stalls_without_receiver=False),
    # The NCCL transport's code path on Gloo (CPU): one 2-rank group per pair, no world.
    "nccl-gloo": TransportCase(NCCL, {}, {"device": "cpu"}),
    # GPU 0 memory -> GPU 1 memory over UCX cuda_ipc (NVLink).
    "nixl-cuda_ipc": TransportCase(NIXL, UCX_GPU_ENV, stalls_without_receiver=None, gpus=2,
                                   rx=RX_GPU, tx=Side("cuda:0", "cuda:0")),
    # Pinned host memory -> GPU 1, staged through a ring on GPU 0 (the default for GPU senders).
    "nixl-cuda_ipc-staged": TransportCase(NIXL, UCX_GPU_ENV, stalls_without_receiver=None, gpus=2, rx=RX_GPU,
                                          tx=Side("pinned", "cuda:0", {"stage_device": "cuda:0"})),
    "nccl-cuda": TransportCase(NCCL, NCCL_GPU_ENV, gpus=2, rx=Side("cuda:1", "cuda:1", {"device": "cuda:1"}),
                               tx=Side("cuda:0", "cuda:0", {"device": "cuda:0"})),
    # Pinned host memory -> GPU 1 through the NCCL transport's pinned->device staging ring.
    "nccl-cuda-staged": TransportCase(NCCL, NCCL_GPU_ENV, gpus=2, rx=Side("cuda:1", "cuda:1", {"device": "cuda:1"}),
                                      tx=Side("pinned", "cuda:0", {"device": "cuda:0"})),
}


def gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0

FILL = 0xA5
SLOT_BYTES = 2 << 20
NUM_SLOTS = 8
COMMAND_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 20.0
STALL_BYTES = 64 << 20  # large enough that no socket buffer swallows a write whole


class PeerProcess:
    """A spawned process hosting one transport; ``call`` runs one command in it."""

    def __init__(self, case: TransportCase, name: str, role: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.name = name
        self._conn, child = ctx.Pipe()
        side = case.side(role)
        self.process = ctx.Process(
            target=transport_peer.serve,
            args=(child, dict(case.env), case.factory, name, {**case.kwargs, **side.kwargs}, side.memory, side.device),
            name=f"peer-{name}",
            daemon=True,
        )
        self.process.start()
        child.close()
        self._started = False

    def ready(self) -> None:
        """Wait for the transport to be built in the child (raises its start-up error)."""
        if not self._started:
            self._reply("start", COMMAND_TIMEOUT_S)
            self._started = True

    def call(self, op: str, *args: Any, timeout_s: float = COMMAND_TIMEOUT_S) -> Any:
        self.begin(op, *args)
        return self.finish(op, timeout_s)

    def begin(self, op: str, *args: Any) -> None:
        """Start a command without waiting: e.g. a receiver polling while its sender waits."""
        self.ready()
        self._conn.send((op, args))

    def finish(self, op: str, timeout_s: float = COMMAND_TIMEOUT_S) -> Any:
        """The reply to the command started by ``begin``."""
        return self._reply(op, timeout_s)

    def _reply(self, op: str, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"peer {self.name} did not answer {op!r} within {timeout_s}s")
        try:
            reply = self._conn.recv()
        except EOFError as exc:
            raise RuntimeError(f"peer {self.name} died during {op!r} (exit {self.process.exitcode})") from exc
        if reply[0] == "ok":
            return reply[1]
        _, type_name, message = reply
        exc_type = getattr(errors, type_name, None)
        if isinstance(exc_type, type) and issubclass(exc_type, errors.P2PError):
            raise exc_type(message)
        raise RuntimeError(f"peer {self.name}: {type_name}: {message}")

    def signal(self, signum: int) -> None:
        os.kill(self.process.pid, signum)

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)

    def stop(self) -> None:
        """Ask the peer to close its transport and exit; kill it if it does not."""
        if self.process.is_alive():
            try:
                self.call("exit", timeout_s=10)
            except (TimeoutError, RuntimeError, OSError, errors.P2PError):
                pass
            self.process.join(10)
        self.kill()
        self._conn.close()


@dataclasses.dataclass
class Pair:
    """A connected receiver and sender; ``peer`` is the receiver's name as the sender knows it."""

    case: TransportCase
    rx: PeerProcess
    tx: PeerProcess
    peer: str
    rx_info: TransportInfo
    rx_info_bytes: bytes  # as the receiver published it (msgspec MessagePack)
    slot_bytes: int
    num_slots: int
    src_bytes: int
    fill: int = FILL  # what an untouched receive-buffer byte holds
    tx_info_bytes: bytes = b""  # the sender's info, for a receiver's accept() on reconnect

    def slot_addr(self, slot: int) -> int:
        return self.rx_info.regions[0].addr + slot * self.slot_bytes

    def stop(self) -> None:
        for proc in (self.tx, self.rx):
            proc.stop()


def start_pair(case: TransportCase, slot_bytes: int = SLOT_BYTES, num_slots: int = NUM_SLOTS,
               src_bytes: int = 16 << 20) -> Pair:
    """Start both processes (in parallel) and run the handshake of the module docstring."""
    tag = uuid.uuid4().hex[:8]
    rx = PeerProcess(case, f"rx-{tag}", "rx")
    tx = PeerProcess(case, f"tx-{tag}", "tx")
    try:
        rx_info = rx.call("setup", slot_bytes * num_slots, FILL)
        tx_info = tx.call("setup", src_bytes, 0)
        rx.call("accept", tx_info)
        peer = tx.call("connect", rx_info, CONNECT_TIMEOUT_S)
    except BaseException:
        tx.stop()
        rx.stop()
        raise
    return Pair(case, rx, tx, peer, transport_peer.decode_info(rx_info), rx_info, slot_bytes, num_slots, src_bytes,
                tx_info_bytes=tx_info)


def _case_params() -> list[Any]:
    params = []
    for name in sorted(TRANSPORTS):
        gpus = TRANSPORTS[name].gpus
        marks = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() < gpus, reason=f"needs {gpus} CUDA devices")]
        params.append(pytest.param(name, id=name, marks=marks if gpus else []))
    return params


@pytest.fixture(scope="module", params=_case_params())
def case_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def pair(case_name: str) -> Iterator[Pair]:
    """One connected pair per transport, shared by the non-destructive tests of a module."""
    started = start_pair(TRANSPORTS[case_name])
    yield started
    started.stop()


@pytest.fixture
def fresh_receiver(pair: Pair) -> Iterator[Pair]:
    """A receiver of its own, for tests that stop or kill it, fed by the module's sender.

    Only one new process per test, and the sender now talks to two receivers at once.
    """
    rx = PeerProcess(pair.case, f"rx-{uuid.uuid4().hex[:8]}", "rx")
    num_slots = STALL_BYTES // pair.slot_bytes
    try:
        rx_info = rx.call("setup", pair.slot_bytes * num_slots, FILL)
        rx.call("accept", pair.tx_info_bytes)
        peer = pair.tx.call("connect", rx_info, CONNECT_TIMEOUT_S)
    except BaseException:
        rx.stop()
        raise
    yield dataclasses.replace(
        pair, rx=rx, peer=peer, rx_info=transport_peer.decode_info(rx_info), rx_info_bytes=rx_info,
        num_slots=num_slots,
    )
    if rx.process.is_alive():
        rx.signal(signal.SIGCONT)
    try:
        pair.tx.call("disconnect", peer)
    except (errors.P2PError, RuntimeError):
        pass
    rx.stop()


@pytest.fixture
def fresh_pair(case_name: str) -> Iterator[Pair]:
    """A pair of its own (two new processes), for tests that stop or kill either side."""
    started = start_pair(TRANSPORTS[case_name], num_slots=STALL_BYTES // SLOT_BYTES, src_bytes=STALL_BYTES)
    yield started
    for proc in (started.rx, started.tx):
        if proc.process.is_alive():
            try:
                proc.signal(signal.SIGCONT)
            except ProcessLookupError:
                pass
    started.stop()
