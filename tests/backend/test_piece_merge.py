"""A decoder rank fed by several sender ranks (prefiller TP larger than the decoder's): each sender
rank's share is its own request; the pieces of a chunk are merged into one slot before the chunk
is served, the other slots are freed, and the proxy hears one KvReady or one KvFailed.

The receive service runs for real with the fake transport of test_receive_service (the test
writes each piece's bytes into the buffer itself, as the transport would, then injects its Written).
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from lmcache_p2p import protocol
from lmcache_p2p.buffer import SlotState
from test_receive_service import FINGERPRINT, SLOT_BYTES, eventually, make_rig  # noqa: F401 (fixture)

TOKENS = 8
PIECE = protocol.ChunkShape([2, 2, TOKENS, 32], "bfloat16", 2 * 2 * TOKENS * 32 * 2)  # one head of 32
DECODER = msgspec.structs.replace(FINGERPRINT, chunk_tokens=TOKENS)  # TP1, 2 heads
SENDER = msgspec.structs.replace(DECODER, tp_size=2, kv_heads=1, kv_heads_total=2)


def _piece(seed: int) -> torch.Tensor:
    return torch.randn(PIECE.shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _write(buffer: torch.Tensor, slot: int, data: torch.Tensor) -> None:
    buffer[slot * SLOT_BYTES:slot * SLOT_BYTES + data.nbytes].copy_(data.flatten().view(torch.uint8))


@pytest.fixture
def rig(make_rig):  # noqa: F811
    buffer = torch.zeros(4 * SLOT_BYTES, dtype=torch.uint8)
    r = make_rig(num_slots=4, fingerprint=DECODER, buffer=buffer)
    r.buffer, r.reports = buffer, []
    r.service.merger._report = r.reports.append
    r.shares = []
    for rank in (0, 1):
        s = r.sender(f"sender-{rank}", f"tx-{rank}", hello=False)
        assert isinstance(s.hello(msgspec.structs.replace(SENDER, tp_rank=rank)), protocol.Welcome)
        r.shares.append(s)
    return r


def test_pieces_are_merged_into_one_chunk_and_one_kv_ready_is_reported(rig) -> None:
    pieces = [_piece(1), _piece(2)]
    slots = []
    for rank, s in enumerate(rig.shares):
        grant = s.alloc(f"req~{rank}/2", ["k1"], shape=PIECE)
        assert isinstance(grant, protocol.Grant), grant
        slots.append(grant.slots[0])
        _write(rig.buffer, grant.slots[0], pieces[rank])
    rig.transport.land("tx-1", "sender-1", "req~1/2", [slots[1]])  # the later share lands first
    assert eventually(lambda: rig.pool.state(slots[1]) is SlotState.READY)
    assert rig.service.count_ready(["k1"]) == 0 and not rig.reports  # half a chunk is never served
    rig.transport.land("tx-0", "sender-0", "req~0/2", [slots[0]])
    assert eventually(lambda: rig.service.count_ready(["k1"]) == 1)
    ready, = rig.reports
    assert isinstance(ready, protocol.KvReady) and ready.req_id == "req"
    assert (ready.chunks, ready.nbytes) == (1, 2 * PIECE.nbytes)
    assert rig.pool.state(slots[1]) is SlotState.FREE and rig.service.merger.merged == 1
    chunk = rig.service.take("k1")
    assert chunk.slot == slots[0] and chunk.shape.shape == [2, 2, TOKENS, 64]
    got = rig.buffer[chunk.slot * SLOT_BYTES:][:chunk.shape.nbytes].view(torch.bfloat16).view(chunk.shape.shape)
    assert torch.equal(got, torch.cat(pieces, dim=-1))
    rig.service.release(chunk)
    assert rig.pool.free_slots == 4 and not rig.service.grants.requests
    assert rig.pool.cached_slot("k1") == slots[0]  # the merged chunk, never a piece, is cached


def test_a_share_the_sender_does_not_owe_is_refused(rig) -> None:
    reply = rig.shares[0].alloc("req~1/2", ["k1"], shape=PIECE)
    assert isinstance(reply, protocol.ErrorReply) and "not share 1 of 2" in reply.message
    reply = rig.shares[0].alloc("req", ["k1"], shape=PIECE)
    assert isinstance(reply, protocol.ErrorReply) and "not share 0 of 1" in reply.message
    reply = rig.shares[0].alloc("req~0/2", ["k1"], shape=protocol.ChunkShape([2, 2, TOKENS, 64], "bfloat16", 4096))
    assert isinstance(reply, protocol.ErrorReply) and "is not 1 KV heads of 32" in reply.message
    assert rig.pool.free_slots == 4


def test_one_failed_share_fails_the_request_once_and_frees_every_slot(rig) -> None:
    slots = [rig.shares[r].alloc(f"req~{r}/2", ["k1", "k2"], shape=PIECE).slots for r in (0, 1)]
    rig.transport.land("tx-1", "sender-1", "req~1/2", slots[1])
    assert eventually(lambda: all(rig.pool.state(s) is SlotState.READY for s in slots[1]))
    assert isinstance(rig.shares[0].cancel("req~0/2"), protocol.Ack)  # sender rank 0 gave up
    assert eventually(lambda: rig.pool.free_slots == 2)  # share 1's landed slots are freed too
    failed, = [m for m in rig.reports if isinstance(m, protocol.KvFailed)]
    assert failed.req_id == "req" and "share 0 of 2" in failed.reason
    late = rig.shares[1].alloc("req~1/2", ["k3"], shape=PIECE)
    assert isinstance(late, protocol.Refused) and late.code is protocol.RefusalCode.FINISHED
    assert rig.service.count_ready(["k1", "k2"]) == 0 and len(rig.reports) == 1


def test_the_proxys_cancel_of_the_request_cancels_every_share(rig) -> None:
    slots = rig.shares[1].alloc("req~1/2", ["k1"], shape=PIECE).slots
    rig.transport.land("tx-1", "sender-1", "req~1/2", slots)
    assert eventually(lambda: rig.pool.state(slots[0]) is SlotState.READY)
    proxy = rig.sender("proxy", "tx-proxy", hello=False)  # the proxy never says Hello
    assert isinstance(proxy.cancel("req"), protocol.Ack)
    assert eventually(lambda: rig.pool.free_slots == 4)
    refused = rig.shares[0].alloc("req~0/2", ["k1"], shape=PIECE)
    assert isinstance(refused, protocol.Refused) and refused.code is protocol.RefusalCode.FINISHED
