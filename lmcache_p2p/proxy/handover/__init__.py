"""The KV handover: from "the prefill stored the KV" to "the decoder may load it".

Owns: per-request waits for KV ready on every TP rank of the chosen decoder (``waiters``), the
``Cancel`` sent for KV the proxy will not use (``cancel``), and one request's handover: its waiter,
settle or retry, take, abandon (``request``).

Must not: choose instances or make client responses; it never waits without a deadline.
"""
