"""What the sender's parts hand each other: chunks, targets, store batches and a request's state."""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from lmcache_p2p import protocol
from lmcache_p2p.transport import WriteHandle

logger = logging.getLogger(__name__)

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


class Readiness(enum.Enum):
    PENDING = "pending"  # the store's GPU work is still queued or running: its chunks' bytes are not there yet
    READY = "ready"
    FAILED = "failed"  # a CUDA error, or not done within p2p.store_ready_timeout_s: the bytes never come


class StoreReady:
    """Whether one store's GPU work is done, shared by every batch of that store. Settled once, by the thread
    that watches the GPU (``store_ready.StoreWatch``); read by the send service's thread, which posts a batch's
    writes only once it is READY. Listeners (the service's wake-up) run once it settles."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = Readiness.PENDING
        self.problem = ""  # why it FAILED
        self.settled_s = 0.0  # perf_counter when the watcher saw it settle
        self._listeners: list[Callable[[], None]] = []

    @property
    def state(self) -> Readiness:
        return self._state

    def set_ready(self) -> None:
        self._settle(Readiness.READY, "")

    def set_failed(self, problem: str) -> None:
        self._settle(Readiness.FAILED, problem)

    def on_settled(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` once this settles (now, if it has)."""
        with self._lock:
            if self._state is Readiness.PENDING:
                if listener not in self._listeners:  # a store's batches share it and their listener
                    self._listeners.append(listener)
                return
        listener()

    def _settle(self, state: Readiness, problem: str) -> None:
        with self._lock:
            if self._state is not Readiness.PENDING:
                return
            self.problem, self.settled_s = problem, time.perf_counter()
            self._state = state  # last: whoever sees it settled sees its problem and stamp
            listeners, self._listeners = self._listeners, []
        for listener in listeners:
            try:
                listener()
            except Exception:  # the watcher's thread goes on with the next store
                logger.exception("lmcache_p2p sender: a listener of a store's readiness failed")


@dataclasses.dataclass
class Batch:
    chunks: list[Chunk]
    last: bool
    called_s: float = 0.0  # perf_counter when the engine's store call began (the request's timeline)
    submit_s: float = 0.0  # time the engine's thread spent in that store call, up to queueing it
    ready: StoreReady | None = None  # its store's GPU work; None: its bytes are there already
    taken_s: float = 0.0  # perf_counter when the service's thread took it

    @property
    def is_ready(self) -> bool:
        """Whether its bytes are there (its store's GPU work is done, or it had none)."""
        return self.ready is None or self.ready.state is Readiness.READY

    @property
    def sendable_s(self) -> float:
        """perf_counter since when its bytes could be written: taken, and its GPU work seen done."""
        return max(self.taken_s, self.ready.settled_s if self.ready is not None else 0.0)


@dataclasses.dataclass
class Held:
    """A granted batch whose store's GPU work is not done yet: its writes wait for it (never posted before)."""

    batch: Batch
    pairs: list[tuple[Chunk, int]]  # its chunks to write and their granted slots
    asked_at: float  # monotonic: when its Alloc left (the write window counts from it)


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
    held: Held | None = None  # granted, waiting for its store's GPU work; no next Alloc until it is written
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
    picked_s: float = 0.0  # its first batch could be written: taken by the service thread, its GPU work done
    alloc_s: float = 0.0  # its first Alloc left
    granted_s: float = 0.0  # its first Grant came back
    posted_s: float = 0.0  # its first write was posted

    @property
    def wire(self) -> str:
        return self.wire_id or self.req_id

    def failed_store(self) -> StoreReady | None:
        """The store of one of its unwritten batches whose GPU work failed (those bytes never come), if any."""
        batches = (self.alloc_batch, self.held.batch if self.held else None, *self.queue)
        return next((b.ready for b in batches if b is not None and b.ready is not None
                     and b.ready.state is Readiness.FAILED), None)

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
