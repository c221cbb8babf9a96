"""The early Alloc on a real GPU: a VRAM store's Alloc goes out while its GPU work still runs, and its writes
are posted only once the CUDA event that :func:`store_ready.gpu_done` recorded has completed.

The store's "gather" (the copy that fills the VRAM chunks) is queued on a store stream behind a GPU sleep
(``torch.cuda._sleep``), as LMCache's store queues its gather behind vLLM's forward. The transport double
reads each source as a DMA engine would: on a stream of its own, not ordered after the store stream. A write
posted before the gather ran reads what was there before (zeros); the control case shows this check sees
such a write. :class:`StoreWatch` settles the readiness, :class:`SendService` holds the granted batch:
the same objects and threads as in the sender (``sender.py``)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from test_send_service import FakeTransport, ScriptedReceiver, make_service, receiver, transport  # noqa: F401

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LATE_CYCLES = 600_000_000  # ~0.3 s of a GPU clock: the Alloc, its Grant and the hand-over take milliseconds
WAIT_S = 30.0
NBYTES = 256  # test_send_service.SHAPE's bytes


class ReadingTransport(FakeTransport):
    """Reads each write's sources when it is posted, on its own stream (unordered with the store stream)."""

    def __init__(self) -> None:
        super().__init__()
        self.read: list[list[bytes]] = []
        self.gpu_done_at_post: list[bool] = []
        self._stream = torch.cuda.Stream()
        self.done: Any = None  # the store's readiness check, when the test wants it seen at each post

    def write(self, peer: str, srcs: Sequence[Any], dst_addrs: Sequence[int], notif: bytes) -> Any:
        if self.done is not None:
            self.gpu_done_at_post.append(self.done())
        with torch.cuda.stream(self._stream):
            copies = [src.to("cpu", non_blocking=True) for src in srcs]
        self._stream.synchronize()
        self.read.append([bytes(c.numpy().tobytes()) for c in copies])
        return super().write(peer, srcs, dst_addrs, notif)


@pytest.fixture
def transport() -> ReadingTransport:  # noqa: F811 - the reading double in place of test_send_service's
    return ReadingTransport()


@pytest.fixture
def watch() -> Iterator[Any]:
    from lmcache_p2p.backend.store_ready import StoreWatch

    w = StoreWatch("gpu-test-store", timeout_s=WAIT_S, max_stores=8)
    yield w
    w.close()


def _late_store(count: int, first_value: int) -> tuple[list[Any], list[bytes], Any]:
    """``count`` zeroed VRAM chunks that a store stream fills with ``first_value``, ``first_value + 1``, ...
    after ~0.3 s of GPU sleep; the chunks, the bytes they will hold, and the store's readiness check."""
    from lmcache_p2p import protocol
    from lmcache_p2p.backend.send_service import Chunk
    from lmcache_p2p.backend.store_ready import gpu_done

    shape = protocol.ChunkShape(shape=[2, 1, 4, 8], dtype="uint8", nbytes=NBYTES)
    tensors = [torch.zeros(NBYTES, dtype=torch.uint8, device="cuda") for _ in range(count)]
    values = [torch.full((NBYTES,), first_value + i, dtype=torch.uint8, device="cuda") for i in range(count)]
    store_stream = torch.cuda.Stream()
    store_stream.wait_stream(torch.cuda.current_stream())  # after the zeros (on the GPU: the CPU does not wait)
    with torch.cuda.stream(store_stream):
        torch.cuda._sleep(LATE_CYCLES)  # the forward is still running
        for dst, src in zip(tensors, values):
            dst.copy_(src)  # the gather into the send arena
            src.record_stream(store_stream)  # freed below, but not reused before this copy ran
    done = gpu_done(store_stream)
    chunks = [Chunk(f"chunk-{first_value + i}", shape, t, lambda: None) for i, t in enumerate(tensors)]
    return chunks, [bytes([first_value + i]) * NBYTES for i in range(count)], done


def _wait_for(cond: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {WAIT_S}s waiting for {what}"
        time.sleep(0.005)


def test_the_alloc_is_granted_during_the_stores_gpu_work_and_the_write_reads_the_stored_bytes(
        make_service, transport, receiver, watch) -> None:  # noqa: F811
    service = make_service()
    chunks, expected, done = _late_store(2, first_value=7)
    transport.done = done
    service.submit("req-1", receiver.target, chunks, last=True, ready=watch.watch(done))
    receiver.welcome()
    alloc = receiver.grant()
    assert alloc.keys == [c.key for c in chunks] and alloc.last
    assert not done(), "the store's GPU work ended before its Alloc was granted: this run shows no overlap"
    _wait_for(lambda: service.stats().requests_done == 1, "the request written once its GPU work is done")
    assert transport.gpu_done_at_post == [True], "a write was posted while the store's GPU work still ran"
    assert transport.read == [expected], "the write read bytes the store had not written yet"


def test_the_stores_of_one_request_are_written_in_order_each_after_its_own_gpu_work(
        make_service, transport, receiver, watch) -> None:  # noqa: F811
    service = make_service()
    expected = []
    for n in range(3):  # three steps' stores of one request, each queued behind the GPU's sleep
        chunks, want, done = _late_store(1, first_value=10 + n)
        service.submit("req-1", receiver.target, chunks, last=n == 2, ready=watch.watch(done))
        expected.append(want)
    receiver.welcome()
    for _ in range(3):
        receiver.grant([0])  # the decoder grants the same slot each time: each batch written before the next Alloc
    _wait_for(lambda: service.stats().requests_done == 1, "the three stores written")
    assert transport.read == expected


def test_the_check_sees_a_write_posted_before_the_stores_gpu_work(make_service, transport, receiver) -> None:  # noqa: F811
    """Control: a batch handed over as ready (no readiness) while the GPU still works is written at its Grant,
    and the transport reads the zeros that were there: the checks above would fail for an early write."""
    service = make_service()
    chunks, expected, done = _late_store(1, first_value=42)
    service.submit("req-1", receiver.target, chunks, last=True)
    receiver.welcome()
    receiver.grant()
    _wait_for(lambda: service.stats().requests_done == 1, "the write at the Grant")
    assert not done(), "the GPU work ended before the write: the control shows nothing"
    assert transport.read != [expected], "the early write read the stored bytes: this check cannot see one"
    torch.cuda.synchronize()
