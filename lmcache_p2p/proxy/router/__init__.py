"""The router: which prefiller and decoder serve a request, and what the proxy knows of each.

Owns: the live registry of instances (``registry``: ``instances`` for one instance's ranks, state
and load, ``credit`` for decoder buffer credit, ``pairing`` for "may this prefiller's KV go to that
decoder"), health gating (``health``), the routing modes and policies (``routing``, ``policies``:
one class per policy behind one protocol), prompt-prefix affinity (``prefix``), the admission queue
for decoder credit (``admission``) and one request's placement and failover (``placement``).

Must not: speak HTTP to instances (``upstream``) or await anything: it is single-threaded on the
event loop and every decision is synchronous.
"""
