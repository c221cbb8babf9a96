"""Observability: Prometheus metrics, ``GET /stats``, the rolling summary line, and the
per-request timeline (``metrics``, ``timeline``).

Must not: change what a request does; everything here only records.
"""
