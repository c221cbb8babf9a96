"""What the sender's parts hand each other: chunks, targets, store batches and a request's state."""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from lmcache_p2p import protocol
from lmcache_p2p.transport import WriteHandle

RETRY_FIRST_S = 0.002  # the first backoff after a FULL refusal (doubled up to RETRY_MAX_S)
RETRY_MAX_S = 0.05


@dataclasses.dataclass
class Chunk:
    """One chunk to send: its key, shape and bytes; ``done`` drops the caller's reference."""

    key: str
    shape: protocol.ChunkShape
    tensor: Any  # torch.Tensor, contiguous
    done: Callable[[], None]


def release(chunks: Iterable[Chunk]) -> None:
    """Hand each chunk back (its ``done``): nothing of it will be sent."""
    for c in chunks:
        c.done()


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a request's KV goes: the receiver's control endpoint for this TP rank."""

    host: str
    control_port: int

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.control_port}"

    @property
    def address(self) -> str:
        """The name a Hello addresses the receiver by (it answers to its control address)."""
        return f"{self.host}:{self.control_port}"


@dataclasses.dataclass
class Batch:
    chunks: list[Chunk]
    last: bool
    called_s: float = 0.0  # perf_counter when the engine's store call began (the request's timeline)
    submit_s: float = 0.0  # time the engine's thread spent in that store call, up to queueing it


Write = tuple[WriteHandle, list[Chunk], float]  # a posted write, its chunks, its deadline (monotonic)


@dataclasses.dataclass
class Request:
    req_id: str  # the pipeline's key: the request's id, or ``wire_id@receiver`` for a share of it
    target: Target
    wire_id: str = ""  # what the receiver knows it by, when not req_id (a piece of another TP split)
    base_id: str = ""  # what the proxy knows it by (KvSent, KvFailed), when not req_id
    queue: deque[Batch] = dataclasses.field(default_factory=deque)
    alloc_seq: int | None = None  # outstanding Alloc
    alloc_batch: Batch | None = None
    alloc_deadline: float = 0.0  # buffer credit: the first Alloc of the batch + p2p.alloc_timeout_s
    alloc_sent_at: float = 0.0  # when the outstanding Alloc left (a silent receiver never answers it)
    retry_at: float | None = None
    retry_delay_s: float = RETRY_FIRST_S
    refusal: str = ""  # the receiver's last FULL refusal, for the error if credit never comes
    writes: list[Write] = dataclasses.field(default_factory=list)
    last_granted: bool = False
    last_received: bool = False  # the engine's last store batch arrived
    granted_any: bool = False  # the receiver holds some of this request's chunks
    started: float = dataclasses.field(default_factory=time.monotonic)
    nbytes: int = 0
    first_called_s: float = 0.0  # perf_counter: the first store call's start (KvSent's times)
    last_stored_s: float = 0.0  # perf_counter: the last store call's end
    submit_s: float = 0.0  # summed over the request's store calls
    chunks_sent: int = 0
    # perf_counter stamps of the request's first pass through each step (KvSent's split of transfer_s)
    picked_s: float = 0.0  # the service thread took its first batch
    alloc_s: float = 0.0  # its first Alloc left
    granted_s: float = 0.0  # its first Grant came back
    posted_s: float = 0.0  # its first write was posted

    @property
    def wire(self) -> str:
        return self.wire_id or self.req_id

    @property
    def base(self) -> str:
        return self.base_id or self.req_id


@dataclasses.dataclass(frozen=True)
class SendStats:
    requests_done: int
    requests_failed: int
    bytes_sent: int
    rejected_frames: dict[str, int] = dataclasses.field(default_factory=dict)  # by reason, see protocol.Rejection
    chunks_leaked: int = 0  # never handed back: their transfer never confirmed it stopped reading
    chunks_skipped: int = 0  # not sent: the receiver already held them (its buffer cache, or sent before)
