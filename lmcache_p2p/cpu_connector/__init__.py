"""LMCache <-> vLLM-CPU paged KV cache, so LMCacheConnectorV1 (and our backends) run without a GPU.

Owns:
  layout.py      learn the K/V element order inside a vLLM-CPU (block, head) page from vLLM's own
                 writer (``cpu_attn_reshape_and_cache``); never hard-code it, it varies by ISA/dtype
  connector.py   ``CPUPagedKVConnector``: LMCache's GPUConnectorInterface in plain torch, gathering
                 and scattering between the paged cache and KV_2LTD memory objects
  plugin.py      the ``vllm.general_plugins`` entry point that makes LMCache's connector factory
                 return ``CPUPagedKVConnector`` when vLLM runs on CPU; on every platform it also
                 hooks ``lmcache_p2p.backend.producer_lookup`` (a sender-only prefiller skips
                 LMCache's lookups, which cannot hit) onto LMCache's vLLM adapter when imported

Must not:
  - import lmcache or vllm at package import or while vLLM loads plugins (importing lmcache then
    broke vLLM-CPU's kernel scan): plugin.py installs an import hook, connector.py is imported late;
  - change LMCache's behaviour on GPUs or for anything but vLLM engines on a CPU-only LMCache device;
  - know about prefill/decode, transports or our storage backends: it only moves KV between the
    engine's paged cache and LMCache memory objects.
"""
