"""lmcache_p2p: point-to-point KV transfer for prefill/decode disaggregated vLLM serving.

Layers (dependencies point downwards only; see shared/DESIGN.md):
  config, protocol, errors   typed settings, wire messages, the error hierarchy
  transport/                 move bytes into a peer's registered memory (nixl, nccl)
  buffer/                    the receiver's preallocated slot pool
  backend/                   the LMCache storage plugin: SenderBackend, ReceiverBackend
  cpu_connector/             LMCache <-> vLLM-CPU paged KV, installed as a vLLM general plugin
  proxy/                     OpenAI-compatible router with a live instance registry
  cli/                       the `lmcache-p2p` command; the only place that configures logging
"""

__version__ = "0.1.0"
