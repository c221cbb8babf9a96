"""One request's flow: the steps between a client's request and its last byte.

Owns: the request's step API and its typed data (``steps``), implemented by the request's owner
(``flow``: ``RequestFlow``, prefill -> KV handover -> decode with an explicit ``phase``), what its
parts share (``context``), where it runs and moves on a failure (``placement``), the prefill
attempts (``prefill``), its KV handover (``handover``) and what differs between the KV backends a pair
runs (``backends``: ours, vLLM's NixlConnector), the decode session with migration
(``decode``), its output and what the proxy learns from it (``output``), and the side that serves
the client (``client``), which drives the steps: in one process on the ``RequestFlow`` itself, in a
relay worker through ``relay/link.py``.

Must not: import ``app``, ``relay`` or ``server`` (they sit above it); rank instances itself
(``router`` does, asked by ``placement``) or parse client HTTP (``app``, ``http.shaping``).
"""
