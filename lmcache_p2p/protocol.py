"""Every control-plane message of lmcache_p2p, and how it crosses the wire.

Messages are msgspec structs in one tagged union, encoded as MessagePack. A frame on the wire is
two ZMQ parts: ``[tag, payload]`` where ``tag`` is HMAC-SHA256(shared_secret, payload) when a
shared secret is configured and empty otherwise. Nothing from a peer is ever unpickled: decoding
accepts only the structs below and raises :class:`ProtocolError` for anything else.

Conversations:
  sender -> receiver (ZMQ DEALER -> ROUTER, the receiver's control port):
      Hello -> Welcome | ErrorReply
      Alloc -> Grant | Refused | ErrorReply     (one per store batch, never per chunk)
      Cancel -> Ack
      Goodbye                                    (no reply)
  sender -> receiver (transport notification, after the bytes landed):
      Written
  instance -> proxy (ZMQ PUSH -> PULL, the proxy's control address):
      Announce (start and every heartbeat), Goodbye, KvReady, KvFailed

Version history:
  1  first version.
  2  Hello and Announce carry the KV :class:`Fingerprint`; a receiver refuses a sender whose
     fingerprint differs and the proxy never pairs such instances.
"""

from __future__ import annotations

import enum
import hashlib
import hmac

import msgspec

from lmcache_p2p.errors import AuthError, ProtocolError

PROTOCOL_VERSION = 2


class RefusalCode(str, enum.Enum):
    FULL = "full"  # no free slots now; may succeed later
    TOO_LARGE = "too_large"  # can never fit: a chunk exceeds a slot or the request exceeds the buffer
    UNKNOWN_PEER = "unknown_peer"  # the sender must say Hello first (e.g. after a receiver restart)
    CLOSED = "closed"  # the receiver is shutting down
    FINISHED = "finished"  # the request already completed or failed here; start a new one


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
    """What a chunk's bytes mean. Two peers exchange KV only when every field agrees.

    A chunk hash names tokens, not the model that turned them into KV: a decoder must never load
    KV computed by another model, chunk size, dtype, layout or tensor-parallel split.
    """

    model: str  # the model name as LMCache sees it (metadata.model_name)
    num_layers: int
    kv_heads: int  # KV heads held by this TP rank
    head_size: int
    dtype: str  # torch dtype name without the "torch." prefix
    chunk_tokens: int
    tp_size: int
    tp_rank: int
    kv_format: str  # LMCache's KV layout, e.g. "KV_2LTD" (MLA models differ)

    def differences(self, other: Fingerprint, *, ignore: tuple[str, ...] = ()) -> list[str]:
        """``field: ours != theirs`` for every field that differs (empty: compatible)."""
        out = []
        for name in self.__struct_fields__:
            if name in ignore:
                continue
            ours, theirs = getattr(self, name), getattr(other, name)
            if ours != theirs:
                out.append(f"{name}: {ours!r} != {theirs!r}")
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
    slots: list[int]  # one per key of the Alloc, same order; -1: already held, do not write
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
    chunks: int
    nbytes: int


class KvFailed(msgspec.Struct, tag="kv_failed", frozen=True):
    req_id: str
    instance_id: str
    tp_rank: int
    reason: str


Message = (
    Hello | Welcome | Alloc | Grant | Refused | Written | Cancel | Ack | ErrorReply
    | Announce | Goodbye | KvReady | KvFailed
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(payload: bytes) -> Message:
    try:
        return _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed or unknown control message ({len(payload)} bytes): {exc}") from exc


class Codec:
    """Frames messages as ``[tag, payload]`` and checks the tag, with an optional shared secret."""

    def __init__(self, shared_secret: str | None = None) -> None:
        self._key = shared_secret.encode() if shared_secret else None

    def _tag(self, payload: bytes) -> bytes:
        if self._key is None:
            return b""
        return hmac.new(self._key, payload, hashlib.sha256).digest()

    def pack(self, msg: Message) -> list[bytes]:
        payload = encode(msg)
        return [self._tag(payload), payload]

    def unpack(self, frames: list[bytes]) -> Message:
        if len(frames) != 2:
            raise ProtocolError(f"expected 2 frames [tag, payload], got {len(frames)}")
        tag, payload = bytes(frames[0]), bytes(frames[1])
        if self._key is not None and not hmac.compare_digest(tag, self._tag(payload)):
            raise AuthError("control message rejected: missing or wrong shared-secret tag (p2p.shared_secret)")
        return decode(payload)
