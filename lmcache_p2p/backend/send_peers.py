"""The sender's peer sessions: one DEALER socket per receiver, its handshake and its transport pair.

    GREETING (Hello sent) --Welcome--> CONNECTING (transport.connect on a helper thread) --> READY

Owned by the send service's thread, except the pairing threads, which hand their result back
through ``handoff`` (the service queues it and wakes its loop). Under a shared secret a
receiver's frames must be addressed to our ``sender_id`` (the codec checks) and signed by the
``receiver_id`` its Welcome gave (checked here): a Grant another receiver made never counts.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
import uuid
from collections.abc import Callable

import zmq

from lmcache_p2p import kv_layout, protocol
from lmcache_p2p.backend.send_types import Target
from lmcache_p2p.config import ZMQ_HEARTBEAT_IVL_MS, ZMQ_HEARTBEAT_TIMEOUT_MS, P2PConfig
from lmcache_p2p.errors import P2PError, ProtocolError
from lmcache_p2p.rejection_log import RejectionLog
from lmcache_p2p.transport import Transport

logger = logging.getLogger(__name__)

CONNECT_GRACE_S = 1.0  # past the transport's own connect timeout, before a pairing is given up


class PeerState(enum.Enum):
    GREETING = "greeting"  # Hello sent, waiting for Welcome
    CONNECTING = "connecting"  # Welcome received, transport.connect running on a helper thread
    READY = "ready"


@dataclasses.dataclass
class Peer:
    target: Target
    sock: zmq.Socket
    state: PeerState
    deadline: float
    name: str = ""  # transport peer name, after Welcome
    receiver_id: str = ""  # the receiver's id, after Welcome: we address it by this, and it signs with it
    buffer_addr: int = 0  # the receiver's slot 0, after Welcome
    slot_bytes: int = 0
    num_slots: int = 0
    # How long after its Alloc left a write may still be in flight: our p2p.transfer_timeout_s, or the
    # receiver's when smaller (Welcome): past the receiver's, a slot it gave up may be granted again.
    write_timeout_s: float = 0.0
    last_heard: float = 0.0  # monotonic time of the last valid message from this receiver
    waiting: list[str] = dataclasses.field(default_factory=list)  # req ids waiting for the handshake


@dataclasses.dataclass(frozen=True)
class Connected:
    """What a pairing thread hands back to the service thread."""

    peer: Peer
    name: str
    error: Exception | None


class PeerSessions:
    """The receivers this sender talks to, by target."""

    def __init__(self, cfg: P2PConfig, *, codec: protocol.Codec, sender_id: str, tp_rank: int,
                 transport: Transport, fingerprint: protocol.Fingerprint | None,
                 handoff: Callable[[Connected], None]) -> None:
        self._cfg = cfg
        self._codec = codec
        self._sender_id = sender_id
        self._tp_rank = tp_rank
        self._transport = transport
        self._fingerprint = fingerprint
        self._handoff = handoff
        self._rejections = RejectionLog(logger, "sender control socket")
        self._ctx: zmq.Context | None = None
        self.poller: zmq.Poller | None = None
        self.peers: dict[Target, Peer] = {}

    def open(self, ctx: zmq.Context, poller: zmq.Poller) -> None:
        self._ctx, self.poller = ctx, poller

    def get(self, target: Target) -> Peer | None:
        return self.peers.get(target)

    def greet(self, target: Target) -> Peer:
        """The session with ``target``; a new one says Hello (addressed to its control address)."""
        peer = self.peers.get(target)
        if peer is None:
            assert self._ctx is not None and self.poller is not None
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
            sock.setsockopt(zmq.HEARTBEAT_IVL, ZMQ_HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMQ_HEARTBEAT_TIMEOUT_MS)
            sock.setsockopt(zmq.IDENTITY, f"{self._sender_id}@{uuid.uuid4().hex[:6]}".encode())
            sock.connect(target.endpoint)
            self.poller.register(sock, zmq.POLLIN)
            peer = Peer(target, sock, PeerState.GREETING, time.monotonic() + self._cfg.connect_timeout_s)
            self.peers[target] = peer
            self.send(peer, protocol.Hello(protocol.PROTOCOL_VERSION, self._sender_id, self._tp_rank,
                                           self._transport.info(), self._fingerprint))
        return peer

    def drop(self, peer: Peer) -> None:
        if self.peers.get(peer.target) is peer:
            del self.peers[peer.target]
        assert self.poller is not None
        self.poller.unregister(peer.sock)
        peer.sock.close()
        if peer.name:
            self.disconnect(peer.name)

    def disconnect(self, name: str) -> None:
        """Forget a transport peer; the transport must return at once (teardown runs on its side)."""
        try:
            self._transport.disconnect(name)
        except P2PError as exc:
            logger.warning("disconnecting transport peer %s failed: %s", name, exc)

    def send(self, peer: Peer, msg: protocol.Message) -> None:
        try:
            peer.sock.send_multipart(self._codec.pack(msg, peer.receiver_id or peer.target.address),
                                     flags=zmq.DONTWAIT)
        except zmq.Again:
            logger.debug("control queue to %s full; message dropped", peer.target.endpoint)

    def drain(self, peer: Peer, on_message: Callable[[Peer, protocol.Message], None],
              on_restarted: Callable[[Peer, str], None]) -> None:
        """Read every queued frame of ``peer``; each accepted message goes to ``on_message``; a frame from a
        new incarnation of its receiver (it restarted at the same address) goes to ``on_restarted`` instead."""
        while self.peers.get(peer.target) is peer:
            try:
                frames = peer.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                env = self._codec.open(frames)
            except ProtocolError as exc:  # counted by the codec (stats().rejected_frames)
                self._rejections.log(protocol.rejection_of(exc), f"from {peer.target.endpoint}: {exc}")
                continue
            restarted = self._restarted(peer, env)
            if restarted:
                on_restarted(peer, restarted)
                return
            spoofed = self._signer_refusal(peer, env)
            if spoofed:
                self._codec.count_rejected(protocol.Rejection.SPOOFED)
                self._rejections.log(protocol.Rejection.SPOOFED, f"from {peer.target.endpoint}: {spoofed}")
                continue
            peer.last_heard = time.monotonic()
            on_message(peer, env.msg)

    def _restarted(self, peer: Peer, env: protocol.Envelope) -> str:
        """Why ``env`` says the receiver of ``peer`` restarted: authentic, from the same instance and rank but
        another incarnation (``instance/rN/<random>``) than the one that welcomed us; "" otherwise. Our Allocs
        reach a process that never met this sender, whose answers the signer check would drop until the
        alloc timeout; instead the new one is greeted at once, as after its "say Hello first" refusal."""
        old = peer.receiver_id
        if not self._codec.authenticated or not old or env.sender == old:
            return ""
        same_rank = env.sender.rpartition("/")[0] == old.rpartition("/")[0] != ""
        if not same_rank:
            return ""
        return f"receiver {peer.target.endpoint} restarted (it was {old!r}, it is {env.sender!r} now)"

    def _signer_refusal(self, peer: Peer, env: protocol.Envelope) -> str:
        """Under a shared secret, a receiver's frames are signed by the id its Welcome gave (a Grant
        another receiver made for us never counts here); "" when acceptable."""
        if not self._codec.authenticated:
            return ""
        expected = peer.receiver_id or (env.msg.receiver_id if isinstance(env.msg, protocol.Welcome) else env.sender)
        if env.sender == expected:
            return ""
        return f"{type(env.msg).__name__} signed by {env.sender!r}, but this receiver is {expected!r}"

    # ---- the handshake -------------------------------------------------------------------------

    def on_welcome(self, peer: Peer, msg: protocol.Welcome) -> str:
        """Start pairing with a receiver that welcomed us; the reason to give it up ("" if none)."""
        if peer.state is not PeerState.GREETING:
            return ""
        if msg.num_slots <= 0 or msg.slot_bytes <= 0:
            return (f"receiver {peer.target.endpoint} offers {msg.num_slots} slots of "
                    f"{msg.slot_bytes} bytes: nothing can be granted")
        if msg.fingerprint is not None and self._fingerprint is not None:
            problem = kv_layout.kv_mismatch(self._fingerprint, msg.fingerprint)
            if problem:
                return f"receiver {peer.target.endpoint}: {problem}"
        peer.state = PeerState.CONNECTING
        peer.receiver_id = msg.receiver_id
        peer.buffer_addr, peer.slot_bytes, peer.num_slots = msg.buffer_addr, msg.slot_bytes, msg.num_slots
        theirs = msg.transfer_timeout_s
        peer.write_timeout_s = min(self._cfg.transfer_timeout_s, theirs) if theirs > 0 else self._cfg.transfer_timeout_s
        peer.deadline = time.monotonic() + self._cfg.connect_timeout_s + CONNECT_GRACE_S
        logger.debug("receiver %s at %s welcomed us; pairing its transport", msg.receiver_id, peer.target.endpoint)
        threading.Thread(target=self._pair, args=(peer, msg.transport), daemon=True,
                         name=f"p2p-sender-{self._tp_rank}-pair").start()
        return ""

    def _pair(self, peer: Peer, info: protocol.TransportInfo) -> None:
        """On a helper thread: the transport's connect (NCCL pairing can block for seconds)."""
        try:
            result = Connected(peer, self._transport.connect(info, self._cfg.connect_timeout_s), None)
        except Exception as exc:  # handed to the service thread, which fails the peer
            result = Connected(peer, "", exc)
        self._handoff(result)

    def on_connected(self, result: Connected) -> tuple[Peer | None, str]:
        """A pairing ended: (the peer now READY, "") or (the peer to fail, why); (None, "") if moot."""
        peer = result.peer
        if self.peers.get(peer.target) is not peer or peer.state is not PeerState.CONNECTING:
            # Given up meanwhile: undo a pairing nobody uses, unless a newer peer shares it.
            if result.name and not any(p.name == result.name or p.state is PeerState.CONNECTING
                                       for p in self.peers.values() if p.target == peer.target):
                self.disconnect(result.name)
            return None, ""
        if result.error is not None:
            return peer, f"transport connect to {peer.target.endpoint} failed: {result.error}"
        peer.name, peer.state = result.name, PeerState.READY
        logger.info("connected to receiver at %s (%d slots of %d bytes)",
                    peer.target.endpoint, peer.num_slots, peer.slot_bytes)
        return peer, ""

    def overdue(self, now: float) -> list[tuple[Peer, str]]:
        """Handshakes past their deadline, with the reason to give each up."""
        out = []
        for peer in list(self.peers.values()):
            if peer.state is PeerState.GREETING and now > peer.deadline:
                out.append((peer, f"receiver {peer.target.endpoint} did not answer Hello within "
                                  f"{self._cfg.connect_timeout_s:.1f}s (p2p.connect_timeout_s)"))
            elif peer.state is PeerState.CONNECTING and now > peer.deadline:
                out.append((peer, f"transport pairing with {peer.target.endpoint} did not finish within "
                                  f"{self._cfg.connect_timeout_s:.1f}s (p2p.connect_timeout_s)"))
        return out
