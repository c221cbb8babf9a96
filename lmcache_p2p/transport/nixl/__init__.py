"""NIXL/UCX transport: one-sided writes (tcp, shared memory, cuda_ipc) with a notification.

Reading order: ``transport.py`` (the :class:`NixlTransport`: agents, registration, writes,
notifications), then ``staging.py`` (the ring on the sender's GPU that host chunks bound for a
remote GPU go through). Imports ``nixl`` lazily; descriptors never cross the wire pickled.
"""
