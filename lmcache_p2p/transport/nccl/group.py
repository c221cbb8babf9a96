"""The torch.distributed edge of the NCCL transport: stores, 2-rank groups, waits on Work.

Everything that calls torch.distributed directly lives here, and every exception it raises is
mapped to :mod:`lmcache_p2p.errors` here. No global world is ever initialised: each pair is a
``ProcessGroupGloo`` (device "cpu") or ``ProcessGroupNCCL`` (device "cuda[:N]") built on a
``PrefixStore`` of the receiver's ``TCPStore``. torch is imported lazily.

Facts this code relies on (seen with torch 2.13 Gloo on the CPU machines, 2026-11-30):
  * a Gloo op that passes its timeout CLOSES the pair ("Application timeout caused pair
    closure"): a timed-out group is dead, never waited on again;
  * ``abort()`` does not interrupt a Gloo wait; deleting the group closes its sockets, but only
    once no Work of it is alive: a posted send still waiting for its receiver reads its source
    whenever the receiver posts, after abort() and with the group deleted, until its Work is
    destroyed (destroying the Work cancels it);
  * Gloo ``Work.is_completed()`` stays False until someone calls ``wait``;
  * a plain master TCPStore listens on every interface: we bind the socket ourselves (to the
    configured host) and hand it over with ``master_listen_fd``.
For NCCL (torch's ProcessGroupNCCL): ``Work.wait()`` without a timeout only makes
the current CUDA stream wait; with a timeout it blocks the CPU, sleeping between checks (too coarse
for a pipeline of sub-millisecond writes), and on expiry torch's watchdog may end the whole
process. So NCCL ops are waited for by polling ``is_completed()`` (it reads the op's CUDA event)
against our own deadline; a late op fails its pair, which is then aborted (``drop_group``).

Keeping an NCCL failure inside its pair (torch's ProcessGroupNCCL, read when each group is
constructed): ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` 0 = no handling (a failed communicator is
never aborted; its kernels may spin), 1 = abort and end the process, 2 = abort the communicator
only ("CleanUpOnly"), 3 = end the process without aborting (torch's default). The watchdog's
heartbeat monitor (``TORCH_NCCL_ENABLE_MONITORING``, default on) ends the process when a
watchdog stops beating (e.g. hung aborting a dead peer's communicator). :func:`nccl_env_for_pairs`
sets 2 and (unless the operator chose) monitoring off, right before our first NCCL group: never
at import, and groups built earlier (vLLM's own) keep what they read.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from lmcache_p2p.config import is_loopback
from lmcache_p2p.errors import PeerUnreachable, TransportError, TransportTimeout
from lmcache_p2p.transport.nccl import wire

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_MIN_WAIT_S = 0.001
_ENV_LOCK = threading.Lock()
# TORCH_NCCL_ASYNC_ERROR_HANDLING values that never end the process (0: none, 2: CleanUpOnly).
_SURVIVING_MODES = ("0", "2")
POLL_S = 0.00002  # how often an NCCL op's completion is checked while a thread waits for it


def timedelta_s(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, _MIN_WAIT_S))


def remaining_s(deadline: float) -> float:
    return deadline - time.monotonic()


def dist_errors() -> tuple[type[BaseException], ...]:
    """What torch.distributed raises: DistError and its kin all derive from RuntimeError."""
    return (RuntimeError, ValueError)


def is_store_timeout(exc: BaseException) -> bool:
    import torch.distributed as dist

    return isinstance(exc, dist.DistStoreError) and "timeout" in str(exc).lower()


# ---- stores ------------------------------------------------------------------------------------


def host_store(host: str, port: int, timeout_s: float) -> Any:
    """A master TCPStore listening on (host, port) only; port 0 picks a free port."""
    from torch.distributed import TCPStore

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        bound_port = sock.getsockname()[1]
    except OSError as exc:
        sock.close()
        raise TransportError(f"cannot listen on {host}:{port} for the NCCL store (p2p.transport_ports): {exc}") from exc
    fd = sock.detach()  # the store owns (and closes) the socket from here on
    try:
        return TCPStore(
            host, bound_port, None, True, timedelta_s(timeout_s), wait_for_workers=False, master_listen_fd=fd
        )
    except dist_errors() as exc:
        socket.close(fd)
        raise TransportError(f"cannot start the NCCL store on {host}:{bound_port}: {exc}") from exc


def store_client(host: str, port: int, timeout_s: float) -> Any:
    """A client of a TCPStore; its default op timeout is ``timeout_s``. PeerUnreachable on failure."""
    from torch.distributed import TCPStore

    try:
        return TCPStore(host, port, None, False, timedelta_s(timeout_s), wait_for_workers=False)
    except dist_errors() as exc:
        raise PeerUnreachable(f"cannot reach the NCCL store at {host}:{port} within {timeout_s:.1f}s: {exc}") from exc


def local_address_towards(host: str, peer_host: str) -> str:
    """Where our side of a pair with ``peer_host`` listens (Gloo): ``host``, unless it is loopback and the
    peer is not: then the address this machine sends from towards the peer (its route's source)."""
    if not is_loopback(host) or is_loopback(peer_host):
        return host
    family = socket.AF_INET6 if ":" in peer_host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((peer_host, 9))  # a UDP connect sends nothing: it only looks the route up
            return str(probe.getsockname()[0])
    except OSError:
        return host  # no route: the pairing fails with the peer's own error


# ---- groups ------------------------------------------------------------------------------------


def new_group(
    store: Any, pair_id: str, rank: int, device: torch.device, host: str, join_timeout_s: float, watchdog_s: float
) -> Any:
    """A 2-rank group on ``PrefixStore(pair/{id}/, store)``.

    Gloo joins here (within ``join_timeout_s``, its option timeout; every op of ours passes its
    own timeout). NCCL joins lazily, at the handshake; its option timeout is the watchdog's,
    ``watchdog_s``, which must stay past every deadline of ours so that our waits fail first.
    """
    import torch.distributed as dist

    prefix_store = dist.PrefixStore(wire.group_prefix(pair_id), store)
    if device.type == "cpu":
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        opts._timeout = timedelta_s(join_timeout_s)
        opts._threads = 1  # send/recv never use the collective worker threads
        return dist.ProcessGroupGloo(prefix_store, rank, 2, opts)
    if not dist.is_nccl_available():
        raise TransportError("this torch build has no NCCL: use device 'cpu' (Gloo) or a CUDA build of torch")
    nccl_env_for_pairs()
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta_s(watchdog_s)
    opts.is_high_priority_stream = False
    opts.group_name = wire.group_prefix(pair_id)  # names the pair in NCCL's and the watchdog's logs
    return dist.ProcessGroupNCCL(prefix_store, rank, 2, opts)


def nccl_env_for_pairs(environ: Any = None) -> dict[str, str]:
    """Make the next ProcessGroupNCCL fail alone instead of ending the process; returns what changed.

    ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` becomes 2 unless it is 0 or 2 already (an operator's 1 or
    3 would end vLLM on a decoder's death: overridden, with a warning). ``TORCH_NCCL_ENABLE_MONITORING``
    becomes 0 only when unset. Idempotent; called right before each NCCL group is built.
    """
    env = os.environ if environ is None else environ
    changed: dict[str, str] = {}
    with _ENV_LOCK:
        mode = env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        if mode not in _SURVIVING_MODES:
            if mode is not None:
                logger.warning("TORCH_NCCL_ASYNC_ERROR_HANDLING=%s would end this process when one KV pair fails; "
                               "setting 2 (abort that communicator only) for the NCCL groups created from now on",
                               mode)
            env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = changed["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
        if "TORCH_NCCL_ENABLE_MONITORING" not in env:
            env["TORCH_NCCL_ENABLE_MONITORING"] = changed["TORCH_NCCL_ENABLE_MONITORING"] = "0"
    if changed:
        logger.info("NCCL pair groups: set %s so that a dead peer fails its pair, not this process",
                    ", ".join(f"{k}={v}" for k, v in changed.items()))
    return changed


def handshake(group: Any, rank: int, device: torch.device, deadline: float) -> None:
    """Rank 1 sends [MAGIC, WIRE_VERSION]; rank 0 checks it. Also creates NCCL's communicator."""
    import torch

    msg = torch.tensor([wire.HANDSHAKE_MAGIC, wire.WIRE_VERSION], dtype=torch.int64, device=device)
    cuda = device.type == "cuda"
    if rank == 1:
        wait_work(group.send([msg], 0, 0), deadline, "pair handshake (send)", cuda)
        return
    got = torch.zeros_like(msg)
    wait_work(group.recv([got], 1, 0), deadline, "pair handshake (recv)", cuda)
    magic, version = (int(v) for v in got.cpu())
    if magic != wire.HANDSHAKE_MAGIC or version != wire.WIRE_VERSION:
        raise TransportError(
            f"pair handshake got magic 0x{magic:x} version {version}, expected version {wire.WIRE_VERSION}"
        )


def warm_up(group: Any, rank: int, device: torch.device, deadline: float) -> int:
    """Rank 1 sends ``wire.WARMUP_BYTES`` from its device; rank 0 receives them on its own.

    Pairing pays here, not at the first write, for what NCCL sets up at a pair's first message
    of real size (its p2p connection buffers, the kernels' first launch); Gloo: the same path,
    for the tests. Returns the bytes moved."""
    import torch

    cuda = device.type == "cuda"
    piece = (torch.zeros if rank == 1 else torch.empty)(wire.WARMUP_BYTES, dtype=torch.uint8, device=device)
    if rank == 1:
        wait_work(group.send([piece], 0, 0), deadline, "pair warm-up (send)", cuda)
    else:
        wait_work(group.recv([piece], 1, 0), deadline, "pair warm-up (recv)", cuda)
    return piece.numel()


def ready(group: Any, rank: int, device: torch.device, deadline: float) -> None:
    """Rank 0 says it serves the pair (it registered it); rank 1 waits for that before it writes.

    So a sender's ``connect`` returns only once the receiver's side of the pair is up, and its
    first write never waits on the receiver's pairing."""
    import torch

    cuda = device.type == "cuda"
    if rank == 0:
        msg = torch.tensor([wire.HANDSHAKE_MAGIC, wire.WIRE_VERSION], dtype=torch.int64, device=device)
        wait_work(group.send([msg], 1, 0), deadline, "pair ready (send)", cuda)
        return
    got = torch.zeros(2, dtype=torch.int64, device=device)
    wait_work(group.recv([got], 0, 0), deadline, "pair ready (recv)", cuda)
    magic, version = (int(v) for v in got.cpu())
    if magic != wire.HANDSHAKE_MAGIC or version != wire.WIRE_VERSION:
        raise TransportError(f"pair ready message got magic 0x{magic:x} version {version}, expected "
                             f"version {wire.WIRE_VERSION}")


def is_done(work: Any, cuda: bool) -> bool:
    """True once an NCCL op completed (no wait). Gloo's is_completed() stays False until someone
    waits, so for Gloo this always says "wait for it now"."""
    return not cuda or work.is_completed()


def wait_work(work: Any, deadline: float, what: str, cuda: bool = False) -> None:
    """Block until ``work`` completes; TransportTimeout past ``deadline``, TransportError on failure.

    Either way the group is unusable afterwards (a Gloo timeout closes the pair; a late NCCL op
    leaves the pair to be aborted). NCCL ops (``cuda``) are polled: see the module docstring.
    """
    if cuda:
        while not work.is_completed():
            if time.monotonic() >= deadline:
                raise TransportTimeout(f"{what}: not complete at its deadline (p2p.transfer_timeout_s)")
            time.sleep(POLL_S)
    try:
        if cuda:
            work.wait()  # complete: only surfaces an error NCCL recorded for it
        else:
            work.wait(timedelta_s(remaining_s(deadline)))
    except dist_errors() as exc:
        if remaining_s(deadline) <= _MIN_WAIT_S or "timed out" in str(exc).lower():
            raise TransportTimeout(f"{what}: not complete at its deadline (p2p.transfer_timeout_s): {exc}") from exc
        raise TransportError(f"{what} failed: {exc}") from exc


def drop_group(group: Any) -> None:
    """Abort a group, never a collective shutdown (the peer may be dead): NCCL aborts its
    communicators (``ncclCommAbort``: kernels stop, nothing waits for the peer); Gloo: no-op,
    dropping the group closes its sockets. Never raises."""
    if group is None:
        return
    abort = getattr(group, "abort", None) or getattr(group, "_abort", None)
    if abort is None:
        logger.warning("%s has no abort(): its pair is left to the destructor", type(group).__name__)
        return
    try:
        abort()
    except Exception:  # teardown must not fail; the cause was logged already
        logger.debug("abort of a pair group failed", exc_info=True)
