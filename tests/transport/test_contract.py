"""The transport contract (lmcache_p2p/transport/base.py), run against every transport in conftest.

Each test drives a real receiver process and a real sender process; data is fresh random bytes
every run, written into scattered slots of the receiver's buffer from unaligned source offsets.
"""

from __future__ import annotations

import signal
import time
import uuid
from typing import TYPE_CHECKING

import pytest

from lmcache_p2p.errors import PeerUnreachable, TransportError, TransportTimeout

if TYPE_CHECKING:
    from conftest import Pair

WAIT_S = 10.0
SRC_SKEW = 13  # sources start at odd addresses
SLOT_BYTES = 2 << 20  # conftest.SLOT_BYTES: the receive buffer's slot size and the source window


def _notif() -> bytes:
    return f"written-{uuid.uuid4().hex}".encode()


def _write(pair: Pair, slots: list[int], sizes: list[int], windows: list[int], *, registered: bool = True):
    """Write chunk i (``sizes[i]`` bytes, from source window ``windows[i]``) into ``slots[i]``."""
    assert pair.slot_bytes == SLOT_BYTES
    chunks = [(window * SLOT_BYTES + SRC_SKEW, size) for window, size in zip(windows, sizes)]
    notif = _notif()
    handle, digests = pair.tx.call(
        "write", pair.peer, chunks, [pair.slot_addr(s) for s in slots], notif, registered
    )
    return handle, digests, notif


def _complete(pair: Pair, handles: list[int], count: int) -> list[tuple[str, bytes]]:
    """Wait on the sender's handles while the receiver polls (as a real receiver always does:
    with UCX tcp and no progress thread, a receiver that does not poll stalls its senders)."""
    pair.rx.begin("notifications", count, WAIT_S)
    for handle in handles:
        pair.tx.call("wait", handle, WAIT_S)
    return pair.rx.finish("notifications", WAIT_S + 5)


def _assert_landed(pair: Pair, slots: list[int], sizes: list[int], digests: list[str]) -> None:
    ranges = [(slot * SLOT_BYTES, size) for slot, size in zip(slots, sizes)]
    landed, stray = pair.rx.call("check", ranges, pair.fill)
    assert landed == digests, "bytes in the receiver's slots differ from what was sent"
    assert stray == 0, f"{stray} bytes outside the written slots changed"


@pytest.mark.parametrize("chunk_bytes", [1, 4093, 65536, (1 << 20) + 3, SLOT_BYTES - SRC_SKEW])
def test_scattered_chunks_land_exactly_and_both_sides_see_completion(pair: Pair, chunk_bytes: int) -> None:
    slots, windows = [7, 2, 5], [4, 0, 2]
    sizes = [chunk_bytes] * 3
    handle, digests, notif = _write(pair, slots, sizes, windows)
    assert _complete(pair, [handle], 1) == [(pair.tx.name, notif)]
    _assert_landed(pair, slots, sizes, digests)
    assert pair.rx.call("wait_notifications", 0.05)[0] == [], "one write gave more than one notification"


def test_sources_outside_registered_memory(pair: Pair) -> None:
    slots, sizes = [3, 0], [300_001, 4096]
    handle, digests, notif = _write(pair, slots, sizes, [0, 1], registered=False)
    assert _complete(pair, [handle], 1) == [(pair.tx.name, notif)]
    _assert_landed(pair, slots, sizes, digests)


def test_several_writes_in_flight(pair: Pair) -> None:
    plan = [([6, 1], [1 << 20, 777]), ([0], [SLOT_BYTES - SRC_SKEW]), ([4, 7, 3], [5000, 99_999, 1]), ([2], [12345])]
    posted = []
    window = 0
    for slots, sizes in plan:  # post every write before waiting on any
        windows = list(range(window, window + len(slots)))
        window += len(slots)
        posted.append((slots, sizes, *_write(pair, slots, sizes, windows)))
    got = _complete(pair, [handle for _, _, handle, _, _ in posted], len(plan))
    assert sorted(got) == sorted((pair.tx.name, notif) for *_, notif in posted)
    all_slots = [s for slots, *_ in posted for s in slots]
    all_sizes = [n for _, sizes, *_ in posted for n in sizes]
    all_digests = [d for *_, digests, _ in posted for d in digests]
    _assert_landed(pair, all_slots, all_sizes, all_digests)


def test_wait_notifications_with_nothing_pending_returns_empty_within_timeout(pair: Pair) -> None:
    notifs, elapsed_s = pair.rx.call("wait_notifications", 0.3)
    assert notifs == []
    assert 0.3 <= elapsed_s < 5.0  # its timeout, then at most what a loaded machine adds to a wake-up


def test_disconnect_then_reconnect(pair: Pair) -> None:
    pair.tx.call("disconnect", pair.peer)
    with pytest.raises(PeerUnreachable):
        _write(pair, [1], [100], [0])
    # A reconnect is a new Hello: the receiver accepts again (two-sided transports pair anew there).
    pair.rx.call("accept", pair.tx_info_bytes)
    assert pair.tx.call("connect", pair.rx_info_bytes, WAIT_S) == pair.peer
    handle, digests, notif = _write(pair, [1], [100], [0])
    assert _complete(pair, [handle], 1) == [(pair.tx.name, notif)]
    _assert_landed(pair, [1], [100], digests)


def test_close_is_idempotent_and_later_use_raises_closed(pair: Pair) -> None:
    raised = pair.tx.call("close_check")
    assert raised == ["register", "info", "connect", "write", "get_notifications", "disconnect"]


def test_a_transport_is_usable_only_once_started_and_never_after_close(pair: Pair) -> None:
    """Construction opens nothing: every call before ``start()`` raises ClosedError; a transport
    closed before it started stays closed (``start()`` raises too)."""
    calls = ["register", "info", "connect", "write", "get_notifications", "disconnect"]
    assert pair.tx.call("unstarted_check") == {"built": calls, "closed": [*calls, "start"]}


def test_stalled_receiver_times_out_or_completes_one_sided(fresh_receiver: Pair) -> None:
    """A SIGSTOPped receiver: waits end at their deadline (TransportTimeout), zero included.

    Truly one-sided paths (UCX shared memory) complete without the receiver and say so in the
    registry; their notifications then arrive once the receiver runs again. Paths where it
    depends on UCX's wire-up (cuda_ipc) only have to end every wait by its deadline.
    """
    pair = fresh_receiver
    count = pair.num_slots
    windows = pair.src_bytes // pair.slot_bytes
    chunks = [((i % windows) * pair.slot_bytes, pair.slot_bytes) for i in range(count)]
    addrs = [pair.slot_addr(i) for i in range(count)]
    pair.rx.signal(signal.SIGSTOP)
    first, _ = pair.tx.call("write", pair.peer, chunks, addrs, b"stalled-1")
    second, _ = pair.tx.call("write", pair.peer, chunks, addrs, b"stalled-2")
    if pair.case.stalls_without_receiver is None:
        for handle in (first, second):
            start = time.monotonic()
            try:
                pair.tx.call("wait", handle, 1.0)
            except TransportTimeout:
                pass
            assert time.monotonic() - start < 10.0  # by its deadline: a stopped receiver would hold it for good
        pair.rx.signal(signal.SIGCONT)
        handle, digests, notif = _write(pair, [3], [5555], [1])
        pair.rx.begin("notifications_until", notif, WAIT_S)
        pair.tx.call("wait", handle, WAIT_S)
        assert (pair.tx.name, notif) in pair.rx.finish("notifications_until", WAIT_S + 5)
    elif pair.case.stalls_without_receiver:
        start = time.monotonic()
        with pytest.raises(TransportTimeout):
            pair.tx.call("wait", first, 0.0)
        assert time.monotonic() - start < 5.0  # at once (a call to the peer): a stopped receiver would hold it for good
        start = time.monotonic()
        with pytest.raises(TransportTimeout):
            pair.tx.call("wait", second, 1.0)
        assert 1.0 <= time.monotonic() - start < 10.0
        pair.rx.signal(signal.SIGCONT)
        # The pair recovers: a new write lands (aborted writes may or may not notify).
        handle, digests, notif = _write(pair, [3], [5555], [1])
        pair.rx.begin("notifications_until", notif, WAIT_S)
        pair.tx.call("wait", handle, WAIT_S)
        assert (pair.tx.name, notif) in pair.rx.finish("notifications_until", WAIT_S + 5)
    else:
        pair.tx.call("wait", first, 0.0)
        pair.tx.call("wait", second, WAIT_S)
        pair.rx.signal(signal.SIGCONT)
        got = pair.rx.call("notifications", 2, WAIT_S)
        assert sorted(got) == [(pair.tx.name, b"stalled-1"), (pair.tx.name, b"stalled-2")]


def test_dead_peer_fails_writes_within_deadline(fresh_receiver: Pair) -> None:
    pair = fresh_receiver
    handle, _, notif = _write(pair, [0], [4096], [0])
    assert _complete(pair, [handle], 1) == [(pair.tx.name, notif)]
    pair.rx.kill()
    start = time.monotonic()
    error = pair.tx.call("write_until_error", pair.peer, 1 << 20, pair.slot_addr(1), 2.0, 10.0)
    assert error in {cls.__name__ for cls in (TransportError, PeerUnreachable, TransportTimeout)}
    assert time.monotonic() - start < 12.0
    if pair.case.factory.endswith("NcclTransport"):
        time.sleep(2.0)  # torch's NCCL watchdog acts on a failed op within a few hundred ms
        assert pair.tx.process.is_alive(), "a dead peer's failed pair ended the sender's process"


@pytest.mark.parametrize("then_disconnect", [False, True], ids=["abort", "abort+disconnect"])
def test_aborted_write_settles_only_once_its_reads_ended(fresh_receiver: Pair, then_disconnect: bool) -> None:
    """``abort`` fails a write for its caller at once, but the sources stay in use until
    ``settled``: never while a stopped receiver still has to take the bytes in, always once
    the write finished (the caller may then hand the memory back), disconnected peer included."""
    pair = fresh_receiver
    count = pair.num_slots
    windows = pair.src_bytes // pair.slot_bytes
    chunks = [((i % windows) * pair.slot_bytes, pair.slot_bytes) for i in range(count)]
    addrs = [pair.slot_addr(i) for i in range(count)]
    pair.rx.signal(signal.SIGSTOP)
    handle, _ = pair.tx.call("write", pair.peer, chunks, addrs, b"to-abort")
    assert pair.tx.call("posted_within", handle, WAIT_S), "the write never reached the wire"  # NCCL posts it later
    pair.tx.call("abort", handle)
    if then_disconnect:
        pair.tx.call("disconnect", pair.peer)  # as the sender service does when a request to it fails
    if pair.case.stalls_without_receiver:
        assert pair.tx.call("poll_error", handle) != "", "an aborted write did not fail for its caller"
        assert not pair.tx.call("settle_within", handle, 1.0), (
            "settled while a stopped receiver still had to take the write's bytes: its sources could be reused "
            "under a live read")
    pair.rx.signal(signal.SIGCONT)
    pair.rx.begin("notifications", 1, 3.0)  # a receiver keeps polling (UCX tcp moves bytes only then)
    assert pair.tx.call("settle_within", handle, WAIT_S), "an aborted write never settled after it could finish"
    pair.rx.finish("notifications", WAIT_S)
