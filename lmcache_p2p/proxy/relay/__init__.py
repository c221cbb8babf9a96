"""``--workers N``: relay processes that serve the HTTP port and stream decodes, and the coordinator
that keeps routing, admission, KV waits and metrics for all of them.

Owns: the worker processes' supervision (``workers``), one worker (``worker``), its link to the
coordinator (``link``: ``RemoteSteps``, the only code that turns a request's steps into wire
messages), its copy of the tokenizer (``tokenizers``), the coordinator's relay API (``coordinator``)
and its table of the workers' open requests (``host``, which turns messages back into step calls),
and their messages (``messages``, msgspec).

Must not: route or wait for KV in a worker (the coordinator does both); be imported by anything
but ``server`` (it sits above ``app`` and ``flow``).
"""
