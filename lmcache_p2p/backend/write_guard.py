"""The receiver's write guard: which transport writes may land in the receive buffer.

Two-sided transports (NCCL) ask before receiving (``TwoSided.set_write_guard``): a write must
target exactly the slots its Written notification names, each granted to that request of that
writer and not written before under this grant. The slots then stay quarantined, if given up,
until this write's receive deadline passed. Called from transport threads; the pool is
thread-safe, and the refusal counter is taken under the service's lock.
"""

from __future__ import annotations

import threading

from lmcache_p2p import protocol
from lmcache_p2p.backend.receiver_counters import Counters
from lmcache_p2p.buffer import SlotPool
from lmcache_p2p.errors import ProtocolError


class WriteGuard:
    """Admits a transport write into the receive buffer only for the slots granted to its writer."""

    def __init__(self, pool: SlotPool, *, region_addr: int, slot_bytes: int, write_window_s: float,
                 counters: Counters, lock: threading.Lock) -> None:
        self._pool = pool
        self._region_addr = region_addr
        self._slot_bytes = slot_bytes
        self._write_window_s = write_window_s
        self._counters = counters
        self._lock = lock

    def admit(self, peer: str, dests: list[tuple[int, int]], notif: bytes) -> str:
        """May ``peer`` write ``dests`` ((address, bytes) each) with notification ``notif``? "" if so.

        Admitted only when the notification is a Written of a request granted to ``peer``, and
        ``dests`` are exactly its slots, each RESERVED (or QUARANTINED) for that request and writer
        and not written before under this grant.
        """
        reason = self._refusal(peer, dests, notif)
        if reason:
            with self._lock:
                self._counters.writes_refused += 1
        return reason

    def _refusal(self, peer: str, dests: list[tuple[int, int]], notif: bytes) -> str:
        try:
            written = protocol.decode(notif)
        except ProtocolError as exc:
            return f"its notification is not a Written: {exc}"
        if not isinstance(written, protocol.Written):
            return f"its notification is a {type(written).__name__}, not a Written"
        slots = []
        for addr, nbytes in dests:
            offset = addr - self._region_addr
            slot, rest = divmod(offset, self._slot_bytes)
            if offset < 0 or rest or not 0 < nbytes <= self._slot_bytes or slot >= self._pool.num_slots:
                return f"destination 0x{addr:x} (+{nbytes} bytes) is not a slot of the receive buffer"
            slots.append(slot)
        if sorted(slots) != sorted(written.slots) or len(set(slots)) != len(slots):
            return f"it writes slots {slots} but its Written names {written.slots}"
        until = self._pool.now() + self._write_window_s
        refused = self._pool.admit_write((peer, written.req_id), slots, until)
        if refused:
            return (f"slots {refused} are not granted to request {written.req_id} of {peer}, "
                    "or this grant was already written")
        return ""
