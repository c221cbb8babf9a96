"""Compatibility: the vLLM entry point as installed before it moved to :mod:`lmcache_p2p.vllm_plugin`.

An environment set up before then still calls ``lmcache_p2p.cpu_connector.plugin:register`` until
it is reinstalled (``make setup``); this module can go once no such environment is left.
"""

from lmcache_p2p.vllm_plugin import register
from lmcache_p2p.vllm_plugin.cpu_connector_factory import install

__all__ = ["install", "register"]
