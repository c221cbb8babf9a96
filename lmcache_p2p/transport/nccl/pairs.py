"""The two halves of an NCCL-transport pair, each with its thread, and what they share.

``SendPair`` (rank 1, ``send_pair.py``) owns a queue of writes and the thread that posts them in
order (doorbell, then the chunks' sends) and completes them oldest first. ``RecvPair`` (rank 0,
``recv_pair.py``) owns the thread that pairs with one sender after ``accept`` and then serves its
doorbells: check the header, receive each chunk into its slot, hand the notification to the
transport. Both hold the pair's store client and group and drop them when their thread ends.
``pair_common.py`` holds what both use. See transport.py for the whole design.
"""

from __future__ import annotations

from lmcache_p2p.transport.nccl.pair_common import (
    PairingReport,
    PairSettings,
    PendingWrite,
    Stopwatch,
    enter_device,
    flat_bytes,
    new_send_ring,
)
from lmcache_p2p.transport.nccl.recv_pair import RECV_AHEAD, STOP_CHECK_S, RecvHooks, RecvPair
from lmcache_p2p.transport.nccl.send_pair import IDLE_WAIT_S, SendPair

__all__ = [
    "IDLE_WAIT_S", "RECV_AHEAD", "STOP_CHECK_S", "PairSettings", "PairingReport", "PendingWrite", "RecvHooks",
    "RecvPair", "SendPair", "Stopwatch", "enter_device", "flat_bytes", "new_send_ring",
]
