"""NCCL transport: one 2-rank torch.distributed group per sender/receiver pair (Gloo on CPU).

Reading order: ``transport.py`` (the :class:`NcclTransport`, its design and lifecycle),
``state.py`` (its settings and the state both sides share), ``sending.py`` and ``receiving.py``
(its sender and receiver sides, composed over that state), ``pairs.py`` (the two halves
of a pair: ``send_pair.py``, ``recv_pair.py``, ``pair_common.py``), ``group.py`` (creating and
tearing down a pair group), ``wire.py`` (the doorbell records), ``staging.py`` (rings for host
chunks to and from GPU pairs). Imports torch.distributed lazily through ``transport.py``.
"""
