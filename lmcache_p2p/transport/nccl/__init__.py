"""NCCL transport: one 2-rank torch.distributed group per sender/receiver pair (Gloo on CPU).

Reading order: ``transport.py`` (the :class:`NcclTransport` and its doorbells), ``pairs.py``
(pairing, per-pair send and receive queues), ``group.py`` (creating and tearing down a pair
group), ``wire.py`` (the doorbell records), ``staging.py`` (rings for host chunks into GPU peers).
Imports torch.distributed lazily through ``transport.py``.
"""
