"""The receiver's control port: its ZMQ ROUTER socket, the senders that said Hello, and their frames.

Owned by the receive service's thread (ZMQ sockets are not thread-safe). A frame is checked by
the codec (tag, window, replay, recipient), then, under a shared secret, its signer against the
peer it speaks for (see :meth:`ControlPort.envelope_refusal`); a Hello is checked against our
protocol version, transport and KV :class:`~lmcache_p2p.protocol.Fingerprint` before the sender
is registered. Every request gets a reply, refusals included.

Who may cancel: a sender, on the connection it said Hello on, its own requests; the proxy this
receiver reports to (``p2p.proxy_url``), which never says Hello, any request and its shares.

A sender that says Goodbye, is replaced, or stays silent for ``p2p.sender_idle_timeout_s`` is
forgotten: its unfinished requests fail and its transport pair is torn down (off this thread:
NCCL joins pair threads).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import zmq

from lmcache_p2p import kv_layout, protocol
from lmcache_p2p.backend.grant_table import GrantTable
from lmcache_p2p.backend.receiver_counters import Counters, WarnOnce
from lmcache_p2p.errors import ClosedError, P2PError, ProtocolError, VersionError
from lmcache_p2p.rejection_log import RejectionLog
from lmcache_p2p.transport import Transport, two_sided

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Sender:
    """A sender after its Hello: who it is, the transport peer its writes come from, when last heard."""

    sender_id: str
    writer: str  # its TransportInfo.name: the peer of its transport notifications and pair
    last_seen: float
    # What it feeds this rank when its TP split differs from ours (None: the same split, rank r -> r;
    # ``()``: nothing, another of its ranks feeds us); see kv_layout.
    pieces: tuple[kv_layout.Piece, ...] | None = None


@dataclasses.dataclass(frozen=True)
class _Foreign:
    """A reply refusing a frame about a request its sender does not own (counted as ``foreign``)."""

    reply: protocol.ErrorReply


def _claimed_name(identity: bytes) -> str:
    """The sender id a peer's ZMQ identity claims (``sender_id@suffix``): whom to answer a frame we
    could not authenticate (unverified: the reply carries nothing but the refusal)."""
    return identity.split(b"@", 1)[0].decode("utf-8", errors="replace")


class ControlPort:
    """Hello / Alloc / Cancel / Goodbye from senders (and Cancel from the proxy), answered in turn."""

    def __init__(self, *, codec: protocol.Codec, control_addresses: frozenset[str], receiver_id: str,
                 transport: Transport, grants: GrantTable, counters: Counters, warn_once: WarnOnce,
                 fingerprint: protocol.Fingerprint | None, welcome: Callable[[], protocol.Welcome],
                 closing: threading.Event, tp_rank: int, proxy_name: str = "") -> None:
        self._codec = codec
        self._proxy_name = proxy_name  # how our proxy signs its Cancels: its address as we dial it ("": none)
        self.control_addresses = control_addresses
        self._receiver_id = receiver_id
        self._transport = transport
        self._two_sided = two_sided(transport)  # pairs with each sender at Hello (NCCL); None: one-sided
        self._grants = grants
        self._counters = counters
        self._warn_once = warn_once
        self._fingerprint = fingerprint  # None: accept any sender (tests that move raw bytes)
        self._welcome = welcome
        self._closing = closing
        self._tp_rank = tp_rank
        self._rejections = RejectionLog(logger, "receiver control port")
        self._sock: zmq.Socket | None = None
        self.senders: dict[bytes, _Sender] = {}  # ZMQ identity -> sender (after Hello)
        self._teardowns: list[threading.Thread] = []

    def bind(self, ctx: zmq.Context, endpoint: str) -> zmq.Socket:
        """Listen on ``endpoint``; ProtocolError names it and the keys that set it."""
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted sender with the same identity takes over
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close()
            raise ProtocolError(f"cannot listen on {endpoint} (p2p.host / p2p.control_ports): {exc}") from exc
        self._sock = sock
        return sock

    def close(self) -> None:
        """Close the socket (from the service thread, or after a failed start); idempotent."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def join_teardowns(self, deadline: float) -> None:
        for thread in list(self._teardowns):  # pair teardowns in flight (each bounded by the transport)
            thread.join(max(0.0, deadline - time.monotonic()))

    # ---- frames -------------------------------------------------------------------------------

    def drain(self) -> None:
        assert self._sock is not None
        while True:
            try:
                frames = self._sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, body = frames[0], frames[1:]
            sender = self.senders.get(identity)
            try:
                env = self._codec.open(body)
            except ProtocolError as exc:  # counted by the codec (rejected_frames)
                self._rejections.log(protocol.rejection_of(exc), f"from {identity!r}: {exc}")
                to = sender.sender_id if sender is not None else _claimed_name(identity)
                self._reply(identity, protocol.ErrorReply(seq=-1, message=str(exc)), to)
                continue
            refusal = self.envelope_refusal(env, sender)
            if refusal is not None:
                reason, why = refusal
                self._codec.count_rejected(reason)
                self._rejections.log(reason, f"from {identity!r}: {why}")
                self._reply(identity, protocol.ErrorReply(seq=getattr(env.msg, "seq", -1), message=why), env.sender)
                continue
            if sender is not None:
                sender.last_seen = time.monotonic()
            reply = self.handle(identity, env.msg)
            if isinstance(reply, _Foreign):
                self._codec.count_rejected(protocol.Rejection.FOREIGN)
                self._rejections.log(protocol.Rejection.FOREIGN, f"from {identity!r}: {reply.reply.message}")
                reply = reply.reply
            if reply is not None:
                self._reply(identity, reply, env.sender)

    def envelope_refusal(self, env: protocol.Envelope, sender: _Sender | None) -> tuple[protocol.Rejection, str] | None:
        """Under a shared secret: is the frame's signer the sender it speaks for, and was it addressed
        to us in this conversation? A Hello names our control address (the sender has no id of ours
        yet) and its signer must be its ``sender_id``; a registered sender's later frames name our
        ``receiver_id`` (a frame captured for another receiver, or an earlier incarnation of us, never
        does) and are signed by the sender that said Hello on this connection. A Cancel on a connection
        that never said Hello is the proxy's: signed by the proxy we report to, as we dial it."""
        if not self._codec.authenticated:
            return None
        msg = env.msg
        if sender is None and isinstance(msg, protocol.Cancel) and env.sender != self._proxy_name:
            proxy = (f"this receiver's proxy {self._proxy_name!r} (p2p.proxy_url)" if self._proxy_name
                     else "this receiver's proxy, and it reports to none (p2p.proxy_url)")
            return protocol.Rejection.SPOOFED, (
                f"Cancel of {msg.req_id} from a connection that never said Hello is signed by {env.sender!r}: only "
                f"{proxy} cancels so; a sender cancels its own requests on the connection it said Hello on")
        if isinstance(msg, protocol.Hello):
            if env.sender != msg.sender_id:
                return protocol.Rejection.SPOOFED, (f"Hello speaks for sender {msg.sender_id!r} but is signed by "
                                                    f"{env.sender!r}: a peer may say Hello only as itself")
            if env.recipient not in self.control_addresses:
                return protocol.Rejection.MISADDRESSED, (
                    f"Hello is addressed to {env.recipient!r}, not to this receiver's control address "
                    f"({', '.join(sorted(self.control_addresses))}): replayed from another receiver, or the sender "
                    "dials an address this receiver does not advertise (p2p.advertise_host)")
            return None
        if sender is not None:
            if env.sender != sender.sender_id:
                return protocol.Rejection.SPOOFED, (f"{type(msg).__name__} on the connection of sender "
                                                    f"{sender.sender_id!r} is signed by {env.sender!r}")
            if env.recipient != self._receiver_id:
                return protocol.Rejection.MISADDRESSED, (
                    f"{type(msg).__name__} is addressed to {env.recipient!r}, not to this receiver "
                    f"({self._receiver_id!r}): replayed from another receiver or an earlier incarnation")
        return None

    def _reply(self, identity: bytes, msg: protocol.Message, to: str) -> None:
        assert self._sock is not None
        try:
            self._sock.send_multipart([identity, *self._codec.pack(msg, to)], flags=zmq.DONTWAIT)
        except zmq.Again:
            logger.warning("could not reply to %r (peer gone?)", identity)

    def handle(self, identity: bytes, msg: protocol.Message) -> protocol.Message | _Foreign | None:
        if isinstance(msg, protocol.Hello):
            return self._on_hello(identity, msg)
        if isinstance(msg, protocol.Alloc):
            return self._on_alloc(identity, msg)
        if isinstance(msg, protocol.Cancel):
            return self._on_cancel(identity, msg)
        if isinstance(msg, protocol.Goodbye):
            self.sender_gone(identity, "sender said goodbye")
            return None
        return protocol.ErrorReply(seq=getattr(msg, "seq", -1), message=f"unexpected message {type(msg).__name__}")

    def _on_cancel(self, identity: bytes, msg: protocol.Cancel) -> protocol.Message | _Foreign:
        """A sender's Cancel drops only a request of its own; the proxy's, the request and its shares."""
        sender = self.senders.get(identity)
        if sender is None:
            self._grants.cancel(msg.req_id, msg.reason)
            for share in self._shares_of(msg.req_id):
                self._grants.cancel(share, msg.reason)
            return protocol.Ack(msg.seq)
        owner = self._grants.cancel(msg.req_id, msg.reason, owner=sender.sender_id)
        if owner != sender.sender_id:
            return _Foreign(protocol.ErrorReply(msg.seq, (
                f"Cancel of {msg.req_id} refused: the request belongs to another sender, and a sender cancels "
                "only its own requests")))
        return protocol.Ack(msg.seq)

    def _on_alloc(self, identity: bytes, msg: protocol.Alloc) -> protocol.Message:
        sender = self.senders.get(identity)
        if sender is None:
            return self._grants.refuse(msg, protocol.RefusalCode.UNKNOWN_PEER, "say Hello first (receiver restarted?)")
        if self._closing.is_set():
            return self._grants.refuse(msg, protocol.RefusalCode.CLOSED, "receiver is shutting down")
        refusal = self._piece_refusal(sender, msg)
        if refusal:
            return protocol.ErrorReply(msg.seq, refusal)
        if sender.pieces and kv_layout.parse_sub_request(msg.req_id)[0] in self._grants.cancelled:
            return self._grants.refuse(msg, protocol.RefusalCode.FINISHED, "request was cancelled or failed here")
        return self._grants.alloc(sender.sender_id, sender.writer, msg)

    # ---- senders ------------------------------------------------------------------------------

    def _on_hello(self, identity: bytes, msg: protocol.Hello) -> protocol.Message:
        if msg.version != protocol.PROTOCOL_VERSION:
            err = VersionError(f"sender speaks protocol {msg.version}, this receiver {protocol.PROTOCOL_VERSION}")
            logger.error("refused sender %s: %s", msg.sender_id, err)
            return protocol.ErrorReply(seq=-1, message=str(err))
        if msg.transport.kind != self._transport.kind:
            return protocol.ErrorReply(seq=-1, message=(
                f"sender uses transport {msg.transport.kind}, this receiver {self._transport.kind} (p2p.transport)"))
        mismatch = self._fingerprint_mismatch(msg.fingerprint)
        if mismatch:
            self._counters.hello_refused_fingerprint += 1
            self._warn_once("fingerprint", msg.sender_id, "refused sender %s (rank %d): %s",
                            msg.sender_id, msg.tp_rank, mismatch)
            return protocol.ErrorReply(seq=-1, message=mismatch)
        self._register(identity, _Sender(msg.sender_id, msg.transport.name, time.monotonic(),
                                         self._pieces_from(msg.fingerprint)))
        if self._two_sided is not None:
            self._two_sided.accept(msg.transport)
        logger.info("sender %s connected (rank %d)", msg.sender_id, msg.tp_rank)
        return self._welcome()

    def _fingerprint_mismatch(self, theirs: protocol.Fingerprint | None) -> str:
        """Why a sender's KV cannot be loaded here ("" when it can): see ``kv_layout.kv_mismatch``."""
        ours = self._fingerprint
        if ours is None:
            return ""
        if theirs is None:
            return (f"KV fingerprint mismatch: the sender sent none, this decoder serves {ours}; "
                    "a decoder loads KV only from a prefiller of the same model and layout")
        return kv_layout.kv_mismatch(theirs, ours)

    def _pieces_from(self, theirs: protocol.Fingerprint | None) -> tuple[kv_layout.Piece, ...] | None:
        """The pieces a sender of another TP split feeds this rank (None for the same split)."""
        ours = self._fingerprint
        if ours is None or theirs is None or theirs.tp_size == ours.tp_size:
            return None
        sender = kv_layout.layout_of(theirs)
        return tuple(p for p in kv_layout.pieces_for(kv_layout.layout_of(ours), sender) if p.src_rank == theirs.tp_rank)

    def _shares_of(self, req_id: str) -> set[str]:
        """The wire ids under which the senders we know may send us shares of ``req_id``."""
        return {kv_layout.sub_request_id(req_id, p) for s in self.senders.values() for p in s.pieces or ()
                if p.count > 1}

    def _piece_refusal(self, sender: _Sender, msg: protocol.Alloc) -> str:
        """Why this Alloc is not the share this sender owes this rank ("" when it is)."""
        try:
            _, index, count = kv_layout.parse_sub_request(msg.req_id)
        except ValueError as exc:
            return str(exc)
        if sender.pieces is None:
            return "" if count == 1 else f"request {msg.req_id} is a share of a request, but the TP splits are equal"
        mine = [p for p in sender.pieces if (p.index, p.count) == (index, count)]
        if not mine:
            return (f"sender {sender.sender_id} feeds this decoder rank {list(sender.pieces) or 'nothing'}, not "
                    f"share {index} of {count} (request {msg.req_id})")
        width = mine[0].heads * self._fingerprint.head_size if self._fingerprint is not None else 0
        for shape in msg.shapes:
            if self._fingerprint is not None and self._fingerprint.kv_format != kv_layout.MLA_FORMAT \
                    and shape.shape[-1:] != [width]:
                return f"chunk of shape {shape.shape} is not {mine[0].heads} KV heads of {width // mine[0].heads}"
        return ""

    def _register(self, identity: bytes, sender: _Sender) -> None:
        """Record a Hello. An older incarnation on this identity is gone (its requests fail); another
        identity of the same sender (it reconnected its socket) is simply forgotten."""
        previous = self.senders.get(identity)
        if previous is not None and previous.sender_id != sender.sender_id:
            self.sender_gone(identity, "replaced by a new sender incarnation", keep_writer=sender.writer)
        for other, known in list(self.senders.items()):
            if other != identity and known.sender_id == sender.sender_id:
                del self.senders[other]
        self.senders[identity] = sender

    def heard_from_writer(self, writer: str, now: float) -> None:
        """A transport notification came from ``writer``: its senders are alive."""
        for sender in self.senders.values():
            if sender.writer == writer:
                sender.last_seen = now

    def sender_gone(self, identity: bytes, why: str, *, keep_writer: str = "") -> None:
        """Forget a sender: fail its unfinished requests and tear its transport pair down
        (unless ``keep_writer``, the transport peer of its replacement, is the same)."""
        sender = self.senders.pop(identity, None)
        if sender is None:
            return
        self._grants.fail_sender(sender.sender_id, why)
        still_used = sender.writer == keep_writer or any(s.writer == sender.writer for s in self.senders.values())
        if not still_used:
            self._tear_down(sender.writer, why)

    def forget_idle(self, now: float, limit_s: float) -> None:
        for identity, sender in list(self.senders.items()):
            if now - sender.last_seen > limit_s:
                self.sender_gone(identity, f"silent for more than {limit_s:.0f}s (p2p.sender_idle_timeout_s)")

    def _tear_down(self, writer: str, why: str) -> None:
        """Disconnect ``writer``'s transport pair in a thread: NCCL joins pair threads (blocking)."""
        self._counters.senders_torn_down += 1
        logger.info("tearing down the transport pair of %s (%s)", writer, why)
        self._teardowns = [t for t in self._teardowns if t.is_alive()]
        thread = threading.Thread(target=self._disconnect, args=(writer,), name=f"p2p-teardown-{self._tp_rank}",
                                  daemon=True)
        self._teardowns.append(thread)
        thread.start()

    def _disconnect(self, writer: str) -> None:
        try:
            self._transport.disconnect(writer)
        except ClosedError:
            pass
        except P2PError as exc:
            logger.warning("could not tear down the transport pair of %s: %s", writer, exc)
