"""The HTTP front end: the OpenAI endpoints clients call and the shapes of what crosses them.

Owns: the Starlette app (``app``), reading a client's request and building what prefillers and
decoders receive (``shaping``), response shapes (``responses``), the model's tokenizer in the proxy
(``tokenizer``) and the client's text made from token ids as one vLLM instance makes it
(``detokenize``, ``held_text`` for a proxy without a tokenizer).

Must not: choose instances (``router``), wait for KV (``handover``) or run a request's steps
(``flow``); it hands each request to the flow host and streams what it yields.
"""
