"""The OpenAI API's shapes and the model's text: what a request and its answers look like, on the
client's side and on the instances'.

Owns: reading a client's request and building what prefillers and decoders receive (``shaping``),
response shapes (``responses``), the model's tokenizer in the proxy (``tokenizer``, ``pieces`` for a
long text on several cores) and the client's text made from token ids as one vLLM instance makes
it (``detokenize``, ``held_text`` for a continuation's text).

A library below the request's flow: the endpoints that drive requests are ``app.py`` (one level up).
Must not: import ``flow``, ``relay`` or ``app``; choose instances (``router``), wait for KV
(``handover``) or run a request's steps (``flow``).
"""
