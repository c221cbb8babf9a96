"""The receiver's preallocated receive buffer.

Owns the slot state machine (``pool.py``: FREE -> RESERVED -> READY -> LOADING -> FREE or CACHED,
leases, all-or-nothing reservations, QUARANTINED slots that a late write may still land in, FIFO
reuse, CACHED slots of loaded chunks kept for later requests: pinned, read or evicted LRU)
with its cached half in ``cache.py``, and the memory behind it (``memory.py``: one tensor,
allocated and registered once). It knows nothing of LMCache, requests' keys, or the network.
"""

from lmcache_p2p.buffer.pool import SlotPool, SlotState

__all__ = ["SlotPool", "SlotState"]
