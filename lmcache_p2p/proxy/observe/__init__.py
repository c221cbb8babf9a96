"""Observability: Prometheus metrics, ``GET /stats``, the rolling summary line, and the
per-request timeline (``metrics``, ``timeline``).

A service below the request's flow. Must not: change what a request does (everything here only
records), or import ``flow``, ``app`` or ``relay``.
"""
