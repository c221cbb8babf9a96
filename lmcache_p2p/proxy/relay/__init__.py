"""``--workers N``: relay processes that serve the HTTP port and stream decodes, and the coordinator
that keeps routing, admission, KV waits and metrics for all of them.

Owns: the worker processes' supervision (``workers``), one worker (``worker``), its link to the
coordinator (``link``), the coordinator's relay API (``coordinator``) and their messages
(``messages``, msgspec).

Must not: route or wait for KV in a worker (the coordinator does both).
"""
