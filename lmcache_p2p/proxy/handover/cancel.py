"""Free KV the proxy will not use: ``Cancel`` to every TP rank of the decoder that may hold it.

When the proxy will not send the decode for a ``req_id`` whose KV may have landed on decoder D
(the first token ended the output, the KV failed or timed out, the request moved to another
decoder, the client left), D should free those receive slots now rather than at lease expiry. The
proxy sends ``protocol.Cancel`` to each rank's receiver control endpoint (the one senders use);
the receiver frees the request's slots, answers ``Ack`` and reports ``KvFailed``, which the
waiters ignore at DEBUG (nobody waits for that ``req_id`` any more). Under a shared secret the Cancel
is signed with the name the decoder addresses the proxy by: the one signer it takes a Cancel from.

One zmq.asyncio DEALER per decoder rank, created at first use, LINGER 0, closed when the registry
forgets the decoder. Nothing here waits: sends are NOBLOCK, and a Cancel that cannot be queued is
dropped and counted (the receiver's lease expiry frees the slots anyway); replies are read, without
waiting, before each send (an ``ErrorReply`` is logged at WARNING once per socket: usually a
shared-secret mismatch).

A decoder the registry forgot (its heartbeats stopped: a cut link, a partition) may come back with
the KV of requests the proxy gave up on while it was away, and the Cancels sent to it meanwhile
are gone: queued on the socket that ``forget`` closed, or in the kernel buffer of a connection
that died. So each decoder's Cancels of the last ``REPLAY_WINDOW_S`` are kept, and when a rank of
a forgotten decoder announces itself again they are sent to it once more (a Cancel is idempotent on
the receiver; one for KV already loaded frees nothing). Cancels meant for a forgotten decoder are
only kept, for that replay.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from lmcache_p2p.config import ZMQ_HEARTBEAT_IVL_MS, ZMQ_HEARTBEAT_TIMEOUT_MS, Role
from lmcache_p2p.errors import ProtocolError
from lmcache_p2p.protocol import MAX_MESSAGE_BYTES, Cancel, Codec, ErrorReply, rejection_of
from lmcache_p2p.proxy.observe.metrics import ProxyMetrics
from lmcache_p2p.proxy.router.registry import Instance

logger = logging.getLogger(__name__)

_SEND_HWM = 1000  # Cancels queued per rank while its receiver is unreachable; more are dropped
REPLAY_WINDOW_S = 300.0  # longer than a receiver's default leases (ready_lease_s 120 s, reserve_lease_s 60 s)
_REPLAY_MAX = 4096  # Cancels kept per decoder for the replay


@dataclasses.dataclass(eq=False)
class _RankSocket:
    endpoint: str
    sock: zmq.asyncio.Socket
    address: str  # host:port, the name the receiver answers to
    refusals: int = 0


@dataclasses.dataclass(frozen=True)
class _Sent:
    at_s: float
    req_id: str
    reason: str


class KvCanceller:
    def __init__(self, codec: Codec, metrics: ProxyMetrics, clock: Callable[[], float] = time.monotonic, *,
                 signer_for: Callable[[str], str | None] | None = None) -> None:
        self._codec = codec
        # The name a decoder knows the proxy by (what it addresses its frames to): a receiver accepts a
        # Cancel from no other signer. None: the codec's identity (tests without a control socket).
        self._signer_for = signer_for
        self._metrics = metrics
        self._clock = clock
        self._ctx: zmq.asyncio.Context | None = None
        self._sockets: dict[Instance, dict[int, _RankSocket]] = {}
        self._seq = itertools.count(1)
        self._closed = False
        # instance_id -> its latest Cancels; instance_id -> (the forgotten Instance, its ranks not heard since)
        self._recent: dict[str, collections.deque[_Sent]] = {}
        self._away: dict[str, tuple[Instance, set[int]]] = {}

    @property
    def open_sockets(self) -> int:
        return sum(len(per_rank) for per_rank in self._sockets.values())

    def cancel(self, decoder: Instance, req_id: str, reason: str) -> None:
        """Ask every TP rank of ``decoder`` to drop ``req_id``'s KV; never waits (safe in a cancelled task)."""
        if self._closed:
            self._metrics.kv_cancels.labels("dropped").inc(decoder.tp_size)
            return
        recent = self._recent.setdefault(decoder.instance_id, collections.deque(maxlen=_REPLAY_MAX))
        recent.append(_Sent(self._clock(), req_id, reason))
        away = self._away.get(decoder.instance_id)
        if away is not None and away[0] is decoder:  # forgotten: kept for when it is back
            self._metrics.kv_cancels.labels("deferred").inc(decoder.tp_size)
            return
        for rank in range(decoder.tp_size):
            self._count(self._send(decoder, rank, Cancel(seq=next(self._seq), req_id=req_id, reason=reason)))
        logger.debug("cancelled KV of %s on decoder %s (%d rank(s)): %s", req_id, decoder.instance_id,
                     decoder.tp_size, reason)

    def forget(self, decoder: Instance) -> None:
        """The registry dropped ``decoder``: close its sockets; its Cancels of the window are owed to it."""
        for rs in self._sockets.pop(decoder, {}).values():
            rs.sock.close(linger=0)
        if decoder.role is Role.RECEIVER:
            self._prune(self._clock() - REPLAY_WINDOW_S)
            self._away[decoder.instance_id] = (decoder, set(range(decoder.tp_size)))

    def heard(self, decoder: Instance, rank: int) -> None:
        """A rank of ``decoder`` announced itself: after an absence, send it the Cancels of the window again."""
        away = self._away.get(decoder.instance_id)
        if away is None or away[0] is decoder or rank not in away[1]:
            return
        away[1].discard(rank)
        if not away[1]:
            del self._away[decoder.instance_id]
        horizon = self._clock() - REPLAY_WINDOW_S
        replay = [e for e in self._recent.get(decoder.instance_id, ()) if e.at_s >= horizon]
        for e in replay:
            self._count(self._send(decoder, rank, Cancel(seq=next(self._seq), req_id=e.req_id, reason=e.reason)),
                        replayed=True)
        if replay:
            logger.info("decoder %s rank %d is back: %d Cancel(s) of KV given up while it was away sent again",
                        decoder.instance_id, rank, len(replay))

    def _prune(self, horizon: float) -> None:
        """Forget decoders not sent a Cancel within the window: nothing of theirs would be replayed."""
        for instance_id in [i for i, recent in self._recent.items() if not recent or recent[-1].at_s < horizon]:
            del self._recent[instance_id]
        for instance_id in [i for i in self._away if i not in self._recent]:
            del self._away[instance_id]

    def _count(self, sent: bool, replayed: bool = False) -> None:
        self._metrics.kv_cancels.labels(("replayed" if replayed else "sent") if sent else "dropped").inc()

    def close(self) -> None:
        """Close every socket and the context; idempotent. Later cancels are dropped."""
        if self._closed:
            return
        self._closed = True
        for decoder in list(self._sockets):
            self.forget(decoder)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _send(self, decoder: Instance, rank: int, msg: Cancel) -> bool:
        if self._closed:
            return False
        try:
            rs = self._socket(decoder, rank)
            if rs is None:
                logger.debug("decoder %s rank %d has no control endpoint: Cancel of %s dropped",
                             decoder.instance_id, rank, msg.req_id)
                return False
            self._read_replies(decoder, rank, rs)
            # Addressed to the rank's control address: a receiver refuses a Cancel meant for another.
            signer = self._signer_for(decoder.instance_id) if self._signer_for is not None else None
            _resolved(rs.sock.send_multipart(self._codec.pack(msg, rs.address, signer=signer), flags=zmq.NOBLOCK))
        except zmq.ZMQError as exc:
            logger.debug("Cancel of %s to decoder %s rank %d dropped: %s", msg.req_id, decoder.instance_id, rank,
                         exc)
            return False
        return True

    def _socket(self, decoder: Instance, rank: int) -> _RankSocket | None:
        info = decoder.ranks.get(rank)
        if info is None or info.control_port <= 0 or not decoder.control_host:
            return None
        endpoint = _endpoint(decoder.control_host, info.control_port)
        per_rank = self._sockets.setdefault(decoder, {})
        rs = per_rank.get(rank)
        if rs is not None and rs.endpoint == endpoint:
            return rs
        if rs is not None:  # the rank restarted on another port
            rs.sock.close(linger=0)
            del per_rank[rank]
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, _SEND_HWM)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.HEARTBEAT_IVL, ZMQ_HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMQ_HEARTBEAT_TIMEOUT_MS)
        if ":" in decoder.control_host:
            sock.setsockopt(zmq.IPV6, 1)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        rs = per_rank[rank] = _RankSocket(endpoint, sock, f"{decoder.control_host}:{info.control_port}")
        return rs

    def _read_replies(self, decoder: Instance, rank: int, rs: _RankSocket) -> None:
        """Take every reply already queued (Acks are dropped; refusals counted and logged)."""
        while True:
            try:
                frames = _resolved(rs.sock.recv_multipart(flags=zmq.NOBLOCK))
            except zmq.Again:
                return
            try:
                reply = self._codec.unpack(frames)
            except ProtocolError as exc:
                self._metrics.control_rejected.labels(rejection_of(exc).value).inc()
                problem = str(exc)
            else:
                if not isinstance(reply, ErrorReply):
                    continue
                problem = reply.message
            self._metrics.kv_cancels.labels("refused").inc()
            rs.refusals += 1
            logger.log(logging.WARNING if rs.refusals == 1 else logging.DEBUG,
                       "decoder %s rank %d (%s) refused a Cancel (%d so far): %s", decoder.instance_id, rank,
                       rs.endpoint, rs.refusals, problem)


def _resolved(fut: asyncio.Future[Any]) -> Any:
    """The outcome of a NOBLOCK zmq.asyncio call, which pyzmq resolves at once; raises what it raised."""
    if not fut.done():  # not expected; never wait on it
        fut.cancel()
        raise zmq.Again()
    return fut.result()


def _endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
