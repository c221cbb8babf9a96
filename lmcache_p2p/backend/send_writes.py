"""The sender's write tracker: posts writes, polls them, and hands chunks back only once nothing reads them.

A granted batch's writes are posted only once its store's GPU work is done (``Batch.is_ready``): before,
the chunks' bytes are not there, and the decoder would load garbage. Until then the batch is held on its
request (``Request.held``) and :meth:`WriteTracker.post_held` posts it once it is ready. A store that
failed is not the tracker's to handle: the pipeline fails its request (the held chunks go back then).

A chunk's reference goes back to LMCache (``Chunk.done``) only once the transport says nothing
reads it any more (``Transport.settled``): at once for a completed write, later for an aborted
one. One that never settles within ``p2p.settle_timeout_s`` is kept (leaked, logged): LMCache
reusing memory that a transfer still reads would put other KV on the wire.

Owned by the send service's thread.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

from lmcache_p2p import protocol
from lmcache_p2p.backend.send_peers import Peer
from lmcache_p2p.backend.send_types import Batch, Chunk, Held, Request, Write, release
from lmcache_p2p.config import P2PConfig
from lmcache_p2p.errors import TransportError
from lmcache_p2p.transport import Transport, WriteHandle

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Unsettled:
    """A failed or aborted write whose chunks wait until the transport says nothing reads them."""

    handle: WriteHandle
    chunks: list[Chunk]
    req_id: str
    give_up_at: float


def _drop(req: Request, write: Write) -> None:
    """Take one write out of ``req.writes`` (by identity: handles may compare equal)."""
    req.writes = [w for w in req.writes if w is not write]


class WriteTracker:
    """Writes in flight (on their requests) and failed writes whose reads have not ended yet."""

    def __init__(self, cfg: P2PConfig, transport: Transport, sender_id: str) -> None:
        self._cfg = cfg
        self._transport = transport
        self._sender_id = sender_id
        self._unsettled: list[_Unsettled] = []
        # Chunks given up on (never settled): held for the process's life. Dropping the last reference
        # would not leak them: LMCache's TensorMemoryObj frees itself into its allocator when collected.
        self._leaked_chunks: list[Chunk] = []
        self.leaked = 0

    def write(self, peer: Peer | None, req: Request, batch: Batch, pairs: Sequence[tuple[Chunk, int]],
              asked_at: float) -> str:
        """Write granted chunks of ``batch`` if its store's GPU work is done, else hold them on ``req`` (one
        batch at a time: the pipeline sends no further Alloc meanwhile); "" when posted or held, else why not
        (their chunks are handed back).

        Every write must end (or be aborted) within the write window of its Alloc
        (``Peer.write_timeout_s``), so it can never land in a slot the receiver re-granted."""
        if not batch.is_ready:
            req.held = Held(batch, list(pairs), asked_at)
            return ""
        req.picked_s = req.picked_s or batch.sendable_s
        chunks = [c for c, _ in pairs]
        slots = [s for _, s in pairs]
        if peer is None or not peer.name:
            release(chunks)
            return "receiver connection lost before writing"
        deadline = asked_at + (peer.write_timeout_s or self._cfg.transfer_timeout_s)
        if time.monotonic() >= deadline:
            release(chunks)  # nothing was posted
            return (f"the write to {req.target.endpoint} could start only {time.monotonic() - asked_at:.1f}s after "
                    f"its Alloc (its Grant, then its store's GPU work), past the {deadline - asked_at:.1f}s write "
                    "window (p2p.transfer_timeout_s): not written, the receiver may have given those slots up")
        notif = protocol.encode(protocol.Written(self._sender_id, req.wire, slots))
        try:
            handle = self._transport.write(peer.name, [c.tensor for c in chunks],
                                           [peer.buffer_addr + s * peer.slot_bytes for s in slots], notif)
        except Exception as exc:  # a write that raises posted nothing (the transport's contract)
            if not isinstance(exc, (TransportError, ValueError)):
                logger.exception("request %s: unexpected error writing to %s", req.req_id, req.target.endpoint)
            release(chunks)
            return f"write to {req.target.endpoint} failed: {type(exc).__name__}: {exc}"
        req.writes.append((handle, chunks, deadline))
        req.posted_s = req.posted_s or time.perf_counter()
        return ""

    def post_held(self, peer: Peer | None, req: Request) -> str:
        """Post ``req``'s held batch if its store's GPU work is now done; "" when posted or still held, else why
        not (its chunks are handed back)."""
        held = req.held
        if held is None or not held.batch.is_ready:
            return ""
        req.held = None
        return self.write(peer, req, held.batch, held.pairs, held.asked_at)

    def poll(self, req: Request) -> str:
        """Poll ``req``'s writes: completed ones hand their chunks back; "" or why the request failed."""
        failed = ""
        # A write leaves req.writes before its chunks are released: should a later poll raise, the
        # request's failure then handles only the writes not yet released (a second done would free a
        # reused page).
        for write in list(req.writes):
            handle, chunks, deadline = write
            try:
                done = self._transport.poll(handle)
            except TransportError as exc:
                _drop(req, write)
                self.release_after(handle, chunks, req.req_id)
                failed = f"write to {req.target.endpoint} failed: {exc}"
                continue
            if not done and time.monotonic() > deadline:
                _drop(req, write)
                self._transport.abort(handle)
                self.release_after(handle, chunks, req.req_id)
                failed = (f"write of {handle.nbytes} bytes to {req.target.endpoint} not done within its write "
                          f"window (p2p.transfer_timeout_s, the smaller of ours and the receiver's, from the Alloc)")
            elif done:
                _drop(req, write)
                release(chunks)  # completed: settled by contract
                req.nbytes += handle.nbytes
                req.chunks_sent += len(chunks)
        return failed

    def abort(self, req: Request) -> None:
        """Abort every write of a failed request; its chunks go back once nothing reads them (a held batch's
        at once: nothing was posted)."""
        held, req.held = req.held, None
        if held is not None:
            release(c for c, _ in held.pairs)
        for handle, chunks, _ in req.writes:
            self._transport.abort(handle)
            self.release_after(handle, chunks, req.req_id)

    def release_after(self, handle: WriteHandle, chunks: list[Chunk], req_id: str) -> None:
        """Hand ``chunks`` back once nothing reads them: now if the write settled, else later."""
        if self._transport.settled(handle):
            release(chunks)
            return
        self._unsettled.append(_Unsettled(handle, chunks, req_id, time.monotonic() + self._cfg.settle_timeout_s))

    def progress_unsettled(self, final: bool = False) -> None:
        """Release chunks of failed writes whose reads ended; give up (leak) past settle_timeout_s."""
        if not self._unsettled:
            return
        now = time.monotonic()
        keep: list[_Unsettled] = []
        for item in self._unsettled:
            if self._transport.settled(item.handle):
                release(item.chunks)
            elif final or now >= item.give_up_at:
                self.leaked += len(item.chunks)
                self._leaked_chunks.extend(item.chunks)
                logger.log(logging.WARNING if final else logging.ERROR,
                           "request %s: a failed write of %d bytes to %s did not confirm that its reads ended %s; "
                           "its %d chunk(s) stay referenced (leaked) so that LMCache never reuses memory a "
                           "transfer may still read", item.req_id, item.handle.nbytes, item.handle.peer,
                           "before shutdown" if final else
                           f"within {self._cfg.settle_timeout_s:.1f}s (p2p.settle_timeout_s)", len(item.chunks))
            else:
                keep.append(item)
        self._unsettled = keep
