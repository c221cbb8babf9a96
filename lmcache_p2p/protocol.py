"""Every control-plane message of lmcache_p2p, and how it crosses the wire.

Messages are msgspec structs in one tagged union, encoded as MessagePack. A frame on the wire is
two ZMQ parts: ``[auth, payload]``: ``auth`` is empty without a shared secret, else a signed
envelope that :class:`Codec` checks (see its docstring). Every frame is bounded by
``MAX_MESSAGE_BYTES``. Nothing from a peer is ever unpickled: decoding accepts only the structs
below and raises :class:`ProtocolError` for anything else.

Conversations:
  sender -> receiver (ZMQ DEALER -> ROUTER, the receiver's control port):
      Hello -> Welcome | ErrorReply
      Alloc -> Grant | Refused | ErrorReply     (one per store batch, never per chunk)
      Cancel -> Ack
      Goodbye                                    (no reply)
  sender -> receiver (transport notification, after the bytes landed):
      Written
  instance -> proxy (ZMQ PUSH -> PULL, the proxy's control address):
      Announce (start and every heartbeat), Goodbye, KvReady, KvFailed, and from a sender, once a
      request's last chunk was written, KvSent (its store / submit / transfer times)
  proxy -> receiver (ZMQ DEALER -> ROUTER, the receiver's control port, no Hello):
      Cancel -> Ack | ErrorReply                 (KV the proxy will not decode there)

Version history:
  1  first version.
  2  Hello and Announce carry the KV :class:`Fingerprint`; a receiver refuses a sender whose
     fingerprint differs and the proxy never pairs such instances. Additive, same version: KvSent
     (a proxy that predates it drops it as malformed, counted; nothing else depends on it).
  (2, additive) KvReady carries chunks_held / bytes_held / bytes_received (defaults 0: an older
     peer's KvReady decodes unchanged); a Grant's -1 also means "kept in the receiver's cache".
  3  Under a shared secret the envelope names the frame's recipient, and the signer must be the
     peer the message speaks for: a Hello is addressed to the receiver's control address
     (``host:port`` as dialled) and signed by its ``sender_id``; later frames name the Welcome's
     ``receiver_id``, replies the ``sender_id``; the proxy's Cancel names the control address.
     Refused: ``misaddressed`` (replayed from another conversation) and ``spoofed``. A peer of
     version 2 is refused at Hello, and under a secret at its first frame (``auth``).
  (3, additive) Fingerprint.kv_heads_total and the TP split: a receiver accepts a sender of another
     TP size when the splits reconcile (``kv_layout``); Welcome carries the receiver's fingerprint;
     a decoder rank fed by several sender ranks gets each one's share as ``req_id~index/count``;
     KvSent carries the sender's tp_size.
  4  Instance -> proxy frames name the proxy as dialled (:func:`dialled_name` of ``p2p.proxy_url``),
     not anyone; the proxy signs its Cancel with that name and refuses frames stamped before its
     start. A Cancel off a Hello connection must be signed by the receiver's proxy; a sender's
     Cancel drops only its own requests (``foreign``).
  (4, additive) KvFailed carries a :class:`KvFailCause` (default ``unknown``: an older peer's KvFailed
     decodes unchanged), so that the proxy fails over by what is known to be down.
Framing under a shared secret (versioned with the protocol since 3): before 2, ``auth`` was the
  bare HMAC of the payload; 2 signed identity, nonce and timestamp too; 3 adds the recipient.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import hmac
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence

import msgspec

from lmcache_p2p.errors import (AuthError, MisaddressedError, OversizedError, ProtocolError, ReplayError,
                                StaleFrameError, VersionError)
from lmcache_p2p.replay_cache import ReplayCache

PROTOCOL_VERSION = 4


class RefusalCode(str, enum.Enum):
    FULL = "full"  # no free slots now; may succeed later
    TOO_LARGE = "too_large"  # can never fit: a chunk exceeds a slot or the request exceeds the buffer
    UNKNOWN_PEER = "unknown_peer"  # the sender must say Hello first (e.g. after a receiver restart)
    CLOSED = "closed"  # the receiver is shutting down
    FINISHED = "finished"  # the request already completed or failed here; start a new one


class KvFailCause(str, enum.Enum):
    """Why a request's KV will not reach its decoder, as far as the reporter knows (KvFailed)."""

    UNKNOWN = "unknown"  # nothing more is known (an older peer, an internal error)
    UNREACHABLE = "unreachable"  # the sender could not reach the decoder: no answer to Hello or Alloc, a failed write
    REFUSED = "refused"  # the decoder refused the grant: its buffer stayed full, the KV is too large, it is closing
    LOST = "lost"  # the decoder no longer holds the request's slots: it restarted, their lease expired, cancelled
    SENDER = "sender"  # the prefiller's own store or send failed; the decoder is not known to be at fault


# ---- data carried inside messages ---------------------------------------------------------------


class Region(msgspec.Struct, frozen=True):
    """A registered memory region of a peer, described as plain numbers."""

    addr: int
    length: int
    device_id: int = 0
    device: str = "cpu"  # "cpu" or "cuda"


class TransportInfo(msgspec.Struct, frozen=True):
    """What a peer needs to reach our transport: its kind, its endpoint and its regions."""

    kind: str  # "nixl" | "nccl" | "loopback"
    name: str  # agent / endpoint name, unique per process and rank
    metadata: bytes = b""  # NIXL agent metadata (parsed by NIXL itself, never pickle)
    host: str = ""
    port: int = 0
    regions: list[Region] = []


class ChunkShape(msgspec.Struct, frozen=True, array_like=True):
    """Shape and dtype of one chunk as LMCache holds it (KV_2LTD: [2, layers, tokens, hidden])."""

    shape: list[int]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    nbytes: int
    fmt: int = 1  # LMCache MemoryFormat value (1 = KV_2LTD)


class Fingerprint(msgspec.Struct, frozen=True):
    """What a chunk's bytes mean. Two peers exchange KV only when every field but the TP split
    agrees and the two splits are reconcilable (``kv_layout.kv_mismatch``): a chunk hash names
    tokens, not the model, chunk size, dtype or layout that turned them into KV."""

    model: str  # the model name as LMCache sees it (metadata.model_name)
    num_layers: int
    kv_heads: int  # KV heads held by this TP rank
    head_size: int
    dtype: str  # torch dtype name without the "torch." prefix
    chunk_tokens: int
    tp_size: int
    tp_rank: int
    kv_format: str  # LMCache's KV layout, e.g. "KV_2LTD" (MLA models differ)
    # Which weights (lmcache_p2p.weights_id): two fine-tunes served under the same path differ here.
    # "" = unknown (an older peer, an unreadable model): not compared.
    weights: str = ""
    kv_heads_total: int = 0  # the model's KV heads over all ranks (0: an older peer, kv_heads * tp_size)

    def differing_fields(self, other: Fingerprint, *, ignore: tuple[str, ...] = ()) -> list[str]:
        """The names of the fields that differ (empty: compatible); an unknown ``weights`` matches any."""
        out = []
        for name in self.__struct_fields__:
            if name in ignore or (name == "weights" and not (self.weights and other.weights)):
                continue
            if getattr(self, name) != getattr(other, name):
                out.append(name)
        return out


# ---- sender <-> receiver -----------------------------------------------------------------------


class Hello(msgspec.Struct, tag="hello", frozen=True):
    version: int
    sender_id: str
    tp_rank: int
    transport: TransportInfo
    fingerprint: Fingerprint | None = None  # None only from test peers that move raw bytes


class Welcome(msgspec.Struct, tag="welcome", frozen=True):
    version: int
    receiver_id: str
    buffer_addr: int  # address of slot 0 in the receiver's registered buffer
    slot_bytes: int
    num_slots: int
    transport: TransportInfo
    # The receiver's p2p.transfer_timeout_s (0: unknown): a slot it gives up stays quarantined this long (plus
    # a margin) after the grant, so a sender times each write from its Alloc with the smaller of this and its own.
    transfer_timeout_s: float = 0.0
    fingerprint: Fingerprint | None = None  # the receiver rank's KV layout: the sender checks its plan


class Alloc(msgspec.Struct, tag="alloc", frozen=True):
    """Reserve one slot per chunk of one store batch of one request."""

    seq: int
    req_id: str
    keys: list[str]
    shapes: list[ChunkShape]
    last: bool  # this is the request's last store (LMCache's is_last_prefill)


class Grant(msgspec.Struct, tag="grant", frozen=True):
    seq: int
    req_id: str
    slots: list[int]  # one per key of the Alloc, same order; -1: already held (sent earlier in this
    # request, or kept in the receiver's buffer cache from an earlier one): do not write
    free_slots: int


class Refused(msgspec.Struct, tag="refused", frozen=True):
    seq: int
    req_id: str
    code: RefusalCode
    reason: str
    needed_slots: int = 0
    free_slots: int = 0
    capacity_slots: int = 0


class Written(msgspec.Struct, tag="written", frozen=True):
    """Sent as the transport notification: these slots of this request now hold their chunks."""

    sender_id: str
    req_id: str
    slots: list[int]


class Cancel(msgspec.Struct, tag="cancel", frozen=True):
    seq: int
    req_id: str
    reason: str


class Ack(msgspec.Struct, tag="ack", frozen=True):
    seq: int


class ErrorReply(msgspec.Struct, tag="error", frozen=True):
    seq: int
    message: str


# ---- instance -> proxy -------------------------------------------------------------------------


class Announce(msgspec.Struct, tag="announce", frozen=True):
    version: int
    instance_id: str
    role: str  # "sender" (prefiller) | "receiver" (decoder)
    http_url: str
    tp_rank: int
    tp_size: int
    control_host: str = ""
    control_port: int = 0
    transport_port: int = 0
    capacity_slots: int = 0
    free_slots: int = 0
    slot_bytes: int = 0
    chunk_tokens: int = 0
    fingerprint: Fingerprint | None = None  # the proxy pairs only instances whose fingerprints agree


class Goodbye(msgspec.Struct, tag="goodbye", frozen=True):
    instance_id: str
    tp_rank: int = 0


class KvReady(msgspec.Struct, tag="kv_ready", frozen=True):
    req_id: str
    instance_id: str
    tp_rank: int
    chunks: int  # chunks written for this request (moved)
    nbytes: int  # their bytes
    chunks_held: int = 0  # chunks the decoder already held (its buffer cache): not moved again
    bytes_held: int = 0
    bytes_received: int = 0  # bytes moved for this request (= nbytes; named for the proxy's metric)


class KvFailed(msgspec.Struct, tag="kv_failed", frozen=True):
    req_id: str
    instance_id: str
    tp_rank: int
    reason: str
    cause: KvFailCause = KvFailCause.UNKNOWN


class KvSent(msgspec.Struct, tag="kv_sent", frozen=True):
    """A sender's times for one request whose KV it wrote in full (durations in seconds)."""

    req_id: str
    instance_id: str
    tp_rank: int
    store_s: float = 0.0  # first store call's start -> last store call's end, as the plugin sees it
    submit_s: float = 0.0  # time spent in batched_submit_put_task for this request (engine thread)
    transfer_s: float = 0.0  # first chunk submitted -> last chunk written
    chunks: int = 0
    nbytes: int = 0
    # where transfer_s went (0 when unknown, e.g. from an older sender):
    pickup_s: float = 0.0  # first chunk submitted -> writable (the sender's thread took it, its GPU work done)
    grant_s: float = 0.0  # first Alloc sent -> its Grant back (the receiver's round trip; may overlap pickup)
    write_s: float = 0.0  # first write posted -> last write seen complete
    tp_size: int = 0  # the sender's TP size: the proxy's timeline waits for one KvSent per rank (0: unknown)


Message = (Hello | Welcome | Alloc | Grant | Refused | Written | Cancel | Ack | ErrorReply
           | Announce | Goodbye | KvReady | KvFailed | KvSent)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(payload: bytes) -> Message:
    try:
        return _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed or unknown control message ({len(payload)} bytes): {exc}") from exc


# ---- framing -----------------------------------------------------------------------------------

MAX_MESSAGE_BYTES = 4 << 20  # the largest control frame any socket accepts (also its zmq.MAXMSGSIZE)
AUTH_WINDOW_S = 30.0  # default of p2p.auth_window_s / --auth-window-s
REPLAY_CACHE_ENTRIES = 1 << 17  # nonces remembered per Codec; older ones raise the timestamp floor
MAX_IDENTITY_BYTES = 256  # the signer's identity and the recipient's name, each
_NONCE_BYTES = 16
_TAG_BYTES = 32
_STAMP = struct.Struct(">Q")  # milliseconds since the epoch
_NAME_LEN = struct.Struct(">H")  # length of the signer's identity; the recipient's name is the rest
_HEADER_MIN_BYTES = _TAG_BYTES + _NONCE_BYTES + _STAMP.size + _NAME_LEN.size
_HEADER_MAX_BYTES = _HEADER_MIN_BYTES + 2 * MAX_IDENTITY_BYTES
_DOMAIN = b"lmcache_p2p/frame/3\x00"  # a tag made for anything else (or an older framing) never verifies here
ANYONE = ""  # the recipient name of a frame for whoever listens (only without a shared secret, and in tests)


class Rejection(str, enum.Enum):
    """Why a control frame was dropped (the label of every rejected-frame counter)."""

    AUTH = "auth"  # missing or wrong shared-secret tag
    REPLAY = "replay"  # an authentic frame seen before
    STALE = "stale"  # an authentic frame stamped outside the window
    OVERSIZED = "oversized"  # larger than MAX_MESSAGE_BYTES
    MALFORMED = "malformed"  # wrong number of parts, bad header, undecodable or unknown message
    VERSION = "version"  # a message of another protocol version (counted by the receiving service)
    MISADDRESSED = "misaddressed"  # an authentic frame addressed to another peer (replayed from elsewhere)
    SPOOFED = "spoofed"  # an authentic frame whose signer is not the peer the message speaks for
    FOREIGN = "foreign"  # a Written or Cancel for a request another sender owns, or a Written from a non-sender


def rejection_of(exc: ProtocolError) -> Rejection:
    """The counter label of a rejected frame's error."""
    for cls, reason in ((ReplayError, Rejection.REPLAY), (StaleFrameError, Rejection.STALE),
                        (MisaddressedError, Rejection.MISADDRESSED), (AuthError, Rejection.AUTH),
                        (OversizedError, Rejection.OVERSIZED), (VersionError, Rejection.VERSION)):
        if isinstance(exc, cls):
            return reason
    return Rejection.MALFORMED


@dataclasses.dataclass(frozen=True)
class Envelope:
    """An accepted frame: the message, and who sent it (authenticated only under a shared secret)."""

    msg: Message
    sender: str  # the peer's identity as its Codec stamped it; "" without a shared secret
    sent_at_s: float  # the peer's wall clock when it packed the frame; 0.0 without a shared secret
    recipient: str = ANYONE  # the name the peer addressed it to (one of ours); "" without a shared secret


class Codec:
    """Frames messages as ``[auth, payload]``, checks them, and counts what it rejects.

    Without a shared secret ``auth`` is empty. With one, ``auth`` is ``tag(32) | nonce(16) |
    stamp_ms(8) | len(identity)(2) | identity | recipient`` and ``tag = HMAC-SHA256(secret, domain |
    len(rest) | rest | payload)``. ``open`` refuses a frame over ``max_message_bytes`` (first), a
    wrong tag, a stamp more than ``window_s`` from this clock, a frame addressed to a name not in
    ``names`` (default: our identity), a nonce it already accepted and a frame stamped before
    :meth:`refuse_stamped_before`. Whether the signer may speak for the peer a message names is
    the service's check. Thread-safe.
    """

    def __init__(self, shared_secret: str | None = None, *, identity: str = "", window_s: float = AUTH_WINDOW_S,
                 max_message_bytes: int = MAX_MESSAGE_BYTES, replay_cache_entries: int = REPLAY_CACHE_ENTRIES,
                 names: Sequence[str] | None = None, clock: Callable[[], float] = time.time) -> None:
        self._key = shared_secret.encode() if shared_secret else None
        self._identity = _name_bytes(identity)
        self.names = frozenset(names if names is not None else (self._identity.decode(),))
        self._window_ms = int(window_s * 1000)
        self.max_message_bytes = max_message_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._replay = ReplayCache(replay_cache_entries)
        self._start_ms = 0
        self._rejected: collections.Counter[Rejection] = collections.Counter()

    def refuse_stamped_before(self, at_s: float) -> None:
        """Refuse every frame stamped before ``at_s`` (the owner's start: none was meant for it)."""
        self._start_ms = int(at_s * 1000)

    @property
    def authenticated(self) -> bool:
        return self._key is not None

    def _tag(self, header: bytes, payload: bytes) -> bytes:
        assert self._key is not None
        return hmac.digest(self._key, b"".join((_DOMAIN, _STAMP.pack(len(header)), header, payload)), "sha256")

    def pack(self, msg: Message, to: str = ANYONE, *, signer: str | None = None) -> list[bytes]:
        """Frame ``msg`` for the peer named ``to`` (signed under a shared secret; ignored without one),
        as our identity or as ``signer``, another of our ``names`` (the one that peer knows us by)."""
        return self.seal(encode(msg), to, signer=signer)

    def seal(self, payload: bytes, to: str = ANYONE, *, signer: str | None = None) -> list[bytes]:
        """Frame already-encoded bytes (``pack`` without the encoding; tests forge payloads with it)."""
        if self._key is None:
            return [b"", payload]
        if signer is not None and signer not in self.names:
            raise ValueError(f"cannot sign as {signer!r}: not one of this peer's names {sorted(self.names)}")
        identity = self._identity if signer is None else _name_bytes(signer)
        header = b"".join((os.urandom(_NONCE_BYTES), _STAMP.pack(int(self._clock() * 1000)),
                           _NAME_LEN.pack(len(identity)), identity, _name_bytes(to)))
        return [self._tag(header, payload) + header, payload]

    def unpack(self, frames: Sequence[bytes]) -> Message:
        return self.open(frames).msg

    def open(self, frames: Sequence[bytes]) -> Envelope:
        """Check and decode one frame; a rejected frame is counted and raises a ProtocolError subclass."""
        try:
            return self._open(frames)
        except ProtocolError as exc:
            self.count_rejected(rejection_of(exc))
            raise

    def count_rejected(self, reason: Rejection) -> None:
        with self._lock:
            self._rejected[reason] += 1

    @property
    def rejected(self) -> dict[str, int]:
        """Frames refused so far, by :class:`Rejection` value."""
        with self._lock:
            return {reason.value: n for reason, n in self._rejected.items()}

    def _open(self, frames: Sequence[bytes]) -> Envelope:
        size = sum(len(f) for f in frames)
        if size > self.max_message_bytes:
            raise OversizedError(f"control frame of {size} bytes exceeds the limit of {self.max_message_bytes} bytes "
                                 "(protocol.MAX_MESSAGE_BYTES)")
        if len(frames) != 2:
            raise ProtocolError(f"expected 2 frames [auth, payload], got {len(frames)}")
        auth, payload = bytes(frames[0]), bytes(frames[1])
        if self._key is None:
            return Envelope(decode(payload), "", 0.0)
        nonce, stamp_ms, identity, recipient = self._read_header(auth, payload)
        now_ms = int(self._clock() * 1000)
        if abs(now_ms - stamp_ms) > self._window_ms:
            raise StaleFrameError(f"control frame stamped {(now_ms - stamp_ms) / 1000:.1f} s from this clock, "
                                  f"outside the window of {self._window_ms / 1000:.0f} s (p2p.auth_window_s / "
                                  "--auth-window-s; are clocks in sync?)")
        if stamp_ms < self._start_ms:
            raise StaleFrameError(f"control frame stamped {(self._start_ms - stamp_ms) / 1000:.3f} s before this "
                                  "peer started: meant for an earlier incarnation (or the signer's clock is behind)")
        if recipient not in self.names:
            raise MisaddressedError(f"control frame from {identity!r} is addressed to {recipient!r}, not to this "
                                    f"peer ({', '.join(sorted(map(repr, self.names)))}): replayed from another "
                                    "conversation, or the sender dials an address this peer does not advertise "
                                    "(p2p.advertise_host of a receiver, --advertise-host of the proxy)")
        with self._lock:
            self._replay.check_and_add(nonce, stamp_ms, now_ms, self._window_ms)
        return Envelope(decode(payload), identity, stamp_ms / 1000, recipient)

    def _read_header(self, auth: bytes, payload: bytes) -> tuple[bytes, int, str, str]:
        """(nonce, stamp_ms, identity, recipient) of an envelope whose tag verifies; AuthError if not."""
        malformed = AuthError(f"control message rejected: missing or malformed shared-secret envelope ({len(auth)} "
                              "bytes; p2p.shared_secret / --shared-secret must match on both sides)")
        if not _HEADER_MIN_BYTES <= len(auth) <= _HEADER_MAX_BYTES:
            raise malformed
        header = auth[_TAG_BYTES:]
        if not hmac.compare_digest(auth[:_TAG_BYTES], self._tag(header, payload)):
            raise AuthError("control message rejected: wrong shared-secret tag "
                            "(p2p.shared_secret / --shared-secret must match on both sides)")
        (stamp_ms,) = _STAMP.unpack_from(header, _NONCE_BYTES)
        (identity_len,) = _NAME_LEN.unpack_from(header, _NONCE_BYTES + _STAMP.size)
        if identity_len > min(len(auth) - _HEADER_MIN_BYTES, MAX_IDENTITY_BYTES):
            raise malformed
        names = header[_NONCE_BYTES + _STAMP.size + _NAME_LEN.size:]
        return (header[:_NONCE_BYTES], stamp_ms, names[:identity_len].decode("utf-8", errors="replace"),
                names[identity_len:].decode("utf-8", errors="replace"))


def dialled_name(endpoint: str) -> str:
    """The name a peer is addressed by when dialled at ``endpoint`` (``tcp://HOST:PORT`` -> ``HOST:PORT``)."""
    return endpoint.removeprefix("tcp://").strip("/")


def _name_bytes(name: str) -> bytes:
    return name.encode()[:MAX_IDENTITY_BYTES]  # a peer name as the envelope carries it
