"""One request's flow: the steps between a client's request and its last byte.

Owns: the request's owner-side flow (``flow``: prefill -> KV handover -> decode, with an explicit
phase, ``phase``), what its parts share (``context``), where it runs and moves on a failure
(``placement``), the prefill attempts (``prefill``), its KV handover (``handover``), the
decode session with migration (``decode``), its output and what the proxy learns from it
(``output``), and the two sides of the one request path: the side that serves the client
(``client``) and the host of open requests that both one process and relay workers drive
(``host``).

Must not: rank instances itself (``router`` does, asked by ``placement``) or parse client HTTP (``http``).
"""
