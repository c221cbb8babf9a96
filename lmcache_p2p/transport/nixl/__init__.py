"""NIXL/UCX transport: one-sided writes (tcp, shared memory, cuda_ipc) with a notification.

Reading order: ``transport.py`` (the :class:`NixlTransport`: the NIXL behaviour relied on, its
lifecycle, registration, notifications), ``state.py`` (the one state object its parts share),
``peers.py`` (loading and forgetting remote agents), ``submit.py`` (a write's descriptors and its
post), ``settle.py`` (polling, aborting, and when a write's sources are free), ``records.py`` (the
plain records they share), then ``staging.py`` (the ring on the sender's GPU that host chunks
bound for a remote GPU go through). Imports ``nixl`` lazily; descriptors never cross the wire pickled.
"""
