"""The NCCL receive ring's ordering (transport/nccl/staging.py ``RecvRing``), on CPU.

A GPU pair whose receive buffer is in host memory receives each piece into a device slot and
copies it out to the host slot. The property under test: a piece is copied into host memory only
once the CPU saw its receive complete without error, so a receive that fails (its pair aborted,
however long the abort takes) never lands bytes in a host slot the receiver may have freed. CUDA's
stream and events are host stand-ins here; the receives are fake Works the test completes or fails.
The same property on real GPUs: test_nccl.py ``test_gpu_host_receive_buffer_gets_nothing_of_a_failed_receive``.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

from lmcache_p2p.errors import TransportError
from lmcache_p2p.transport.nccl.staging import CopyOut, RecvRing

PIECE = 1024
WAIT_S = 5.0


class _Stream:
    def query(self) -> bool:
        return True


class _Event:
    def record(self, _stream) -> None:
        pass

    def query(self) -> bool:
        return True


@pytest.fixture
def host_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "stream", lambda _s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Stream", lambda _d: _Stream())
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)  # the pinned path: asynchronous copies


class _Work:
    def __init__(self, slot: torch.Tensor) -> None:
        self.slot, self.completed, self.error = slot, False, ""
        slot.fill_(0xEE)  # a device slot holds whatever it held before: another write's bytes

    def land(self, data: torch.Tensor) -> None:
        self.slot.copy_(data)
        self.completed = True

    def fail(self) -> None:
        self.completed, self.error = True, "aborted (test)"

    def is_completed(self) -> bool:
        return self.completed

    def wait(self, *_args) -> bool:
        if self.error:
            raise RuntimeError(self.error)
        return True


class _Group:
    def __init__(self, payloads: list[torch.Tensor] | None = None) -> None:
        self.works: list[_Work] = []
        self.payloads = payloads  # when given, each receive lands its payload at once

    def recv(self, tensors, _src, _tag) -> _Work:
        work = _Work(tensors[0])
        if self.payloads is not None:
            work.land(self.payloads[len(self.works)])
        self.works.append(work)
        return work


def _payload(i: int) -> torch.Tensor:
    return torch.full((PIECE,), i + 1, dtype=torch.uint8)


def test_a_failed_receive_copies_nothing_into_the_host_buffer(host_cuda) -> None:
    ring = RecvRing(torch.device("cpu"), PIECE, 4)
    group = _Group()
    dst = torch.full((3 * PIECE,), 0x11, dtype=torch.uint8)
    ring.recv(group, dst, PIECE, time.monotonic() + WAIT_S)
    assert bool((dst == 0x11).all()), "a piece was copied to host memory before its receive completed"
    group.works[0].land(_payload(0))
    group.works[1].fail()  # the pair aborts while the second piece is being received
    with pytest.raises(TransportError):
        ring.finish(time.monotonic() + WAIT_S)
    assert ring.quiesce(time.monotonic() + WAIT_S)
    assert torch.equal(dst[:PIECE], _payload(0))
    assert bool((dst[PIECE:] == 0x11).all()), "a failed (or later) receive's slot bytes reached the host buffer"


def test_pieces_of_one_write_through_a_smaller_ring_land_in_order(host_cuda) -> None:
    """More pieces than slots: a slot is received into again only after its piece was copied out."""
    ring = RecvRing(torch.device("cpu"), PIECE, 2)
    payloads = [_payload(i) for i in range(5)]
    group = _Group(payloads)
    dst = torch.zeros(5 * PIECE, dtype=torch.uint8)
    copy_out = CopyOut(ring)
    copy_out.upto = ring.recv(group, dst, PIECE, time.monotonic() + WAIT_S)[-1]
    copy_out(time.monotonic() + WAIT_S)
    assert torch.equal(dst, torch.cat(payloads))


def test_a_write_is_copied_out_without_waiting_for_the_next_writes_receives(host_cuda) -> None:
    """A write's finisher copies out its own pieces only: the next write's receives, posted ahead,
    may still be running (its notification must not wait for them, nor fail with them)."""
    ring = RecvRing(torch.device("cpu"), PIECE, 4)
    group = _Group()
    first, second = torch.zeros(PIECE, dtype=torch.uint8), torch.full((PIECE,), 0x11, dtype=torch.uint8)
    finisher = CopyOut(ring)
    finisher.upto = ring.recv(group, first, PIECE, time.monotonic() + WAIT_S)[-1]
    ring.recv(group, second, PIECE, time.monotonic() + WAIT_S)
    group.works[0].land(_payload(0))
    finisher(time.monotonic() + 0.5)  # the second write's receive has not completed: not waited for
    assert torch.equal(first, _payload(0)) and bool((second == 0x11).all())


def test_a_write_whose_pieces_left_through_slot_reuse_waits_for_no_later_receive(host_cuda) -> None:
    """The next write's receives reused this write's slots (so its pieces were copied out then):
    finishing this write must not wait for, nor fail with, the next write's receives."""
    ring = RecvRing(torch.device("cpu"), PIECE, 1)
    payloads = [_payload(0)]
    group = _Group(payloads)
    first, second = torch.zeros(PIECE, dtype=torch.uint8), torch.full((PIECE,), 0x11, dtype=torch.uint8)
    finisher = CopyOut(ring)
    finisher.upto = ring.recv(group, first, PIECE, time.monotonic() + WAIT_S)[-1]
    group.payloads = None  # the next write's receive stays in flight
    ring.recv(group, second, PIECE, time.monotonic() + WAIT_S)  # reuses the only slot: copies out the first
    finisher(time.monotonic() + 0.5)
    assert torch.equal(first, _payload(0)) and bool((second == 0x11).all())
