"""The KV handover's shared services: from "the prefill stored the KV" to "the decoder may load it".

Owns: the waits for KV ready on every TP rank of a decoder (``waiters``, fed by the control socket)
and the ``Cancel`` sent for KV the proxy will not use (``cancel``). One request's handover (its
waiter, settle or retry, take, abandon) is the request's own: ``flow/handover.py``.

A service below the request's flow. Must not: import ``flow``, choose instances or make client
responses; it never waits without a deadline.
"""
