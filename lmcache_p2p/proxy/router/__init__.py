"""The router: which prefiller and decoder may serve a request, and what the proxy knows of each.

Owns: the live registry of instances (``registry``: ``instances`` for one instance's ranks, state
and load, ``credit`` for decoder buffer credit, ``lease`` for one request's claim on an instance,
``pairing`` for "may this prefiller's KV go to that decoder"), health gating (``health``), the
routing modes and policies (``routing``, ``policies``: one class per policy behind one protocol),
prompt-prefix affinity (``prefix``) and the admission queue for decoder credit (``admission``).

A service below the request's flow: it answers questions and hands out leases. Must not: import
``flow`` (one request's placement lives there, ``flow/placement.py``), speak HTTP to instances
(``upstream``) or await anything but the admission queue's bounded wait: it is single-threaded on
the event loop and every decision is synchronous.
"""
