"""Patch a third-party module right after its first import, without importing it now.

vLLM loads general plugins before it scans its CPU kernels; importing lmcache at that moment broke
the scan, so the vLLM plugin (:mod:`lmcache_p2p.vllm_plugin`) installs these hooks instead and the
patches run when vLLM or LMCache imports the module itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

_lock = threading.Lock()


def patch_on_import(target: str, patch: Callable[[types.ModuleType], Any]) -> None:
    """Run ``patch`` on module ``target`` now if it is imported, else right after its first import
    (idempotent per target and patch)."""
    with _lock:
        module = sys.modules.get(target)
        if module is not None:
            patch(module)
            return
        if not any(isinstance(f, _PatchOnImport) and f.target == target and f.patch is patch for f in sys.meta_path):
            sys.meta_path.insert(0, _PatchOnImport(target, patch))
            logger.debug("import hook for %s installed", target)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds module ``target`` through the other finders and runs ``patch`` on it once loaded."""

    def __init__(self, target: str, patch: Callable[[types.ModuleType], Any]) -> None:
        self.target = target
        self.patch = patch

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.target:
            return None
        patches = [f.patch for f in sys.meta_path if isinstance(f, _PatchOnImport) and f.target == fullname]
        for finder in sys.meta_path:
            if isinstance(finder, _PatchOnImport) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, patches)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, patches: list[Callable[[types.ModuleType], Any]]) -> None:
        self._loader = loader
        self._patches = patches

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        for patch in self._patches:
            patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for tooling
        return getattr(self._loader, name)
