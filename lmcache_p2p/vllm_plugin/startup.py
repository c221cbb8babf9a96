"""A vLLM server whose LMCache YAML names our plugin serves with the plugin running, or not at all.

LMCache 0.5.6 builds storage plugins in ``lmcache.v1.storage_backend.storage_plugin_launcher``
under ``except Exception``: a plugin whose constructor raises is logged ("Failed to create backend
p2p: ...") and the engine serves without it, a decoder that never receives KV or a prefiller that
never sends. Two guards make that start fail instead:

- :func:`check_config_file`, run by the vLLM plugin in every vLLM process as vLLM loads plugins:
  the ``p2p`` section of ``LMCACHE_CONFIG_FILE`` is validated (:class:`~lmcache_p2p.config.P2PConfig`
  and the role against the plugin class); a bad one raises ConfigError, so the API server exits
  before it loads a model.
- :func:`guard_plugin_launcher`, applied when LMCache's storage-backend module is imported: after
  LMCache's launcher ran, a plugin of ours that it was asked for and did not create ends the
  process (:func:`exit_process`), after logging the cause. Not an exception: LMCache's
  ``LMCacheManager.post_init`` turns any Exception into a "degraded mode (recompute)"; vLLM's
  worker reports one to the engine and keeps running, so the engine waits for it forever; and even
  a BaseException leaves the worker hanging at exit on threads LMCache started. A worker that is
  gone is what vLLM handles: its monitor sees it die, the engine stops and the server exits
  non-zero. This covers what only the engine knows (the model's chunk size against
  ``p2p.buffer_size``, a port that cannot be bound).

Nothing here imports lmcache or vllm at import time.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import yaml

from lmcache_p2p.config import P2PConfig, Role
from lmcache_p2p.errors import ConfigError

logger = logging.getLogger(__name__)

CONFIG_ENV = "LMCACHE_CONFIG_FILE"
STORAGE_MODULE = "lmcache.v1.storage_backend"
LAUNCHER = "storage_plugin_launcher"
BACKEND_MODULE = "lmcache_p2p.backend"
ROLE_OF_CLASS = {"SenderBackend": Role.SENDER, "ReceiverBackend": Role.RECEIVER}
_PATCHED_ATTR = "_lmcache_p2p_fail_loud"
PLUGIN_START_EXIT_CODE = 78  # EX_CONFIG: the process cannot serve as configured


def our_plugins(storage_plugins: Any, extra: Mapping[str, Any] | None) -> dict[str, str]:
    """Plugin name -> class name for each configured storage plugin that is one of ours."""
    extra = extra or {}
    return {str(name): str(extra.get(f"storage_plugin.{name}.class_name"))
            for name in (storage_plugins or [])
            if extra.get(f"storage_plugin.{name}.module_path") == BACKEND_MODULE}


def check_p2p_section(storage_plugins: Any, extra: Mapping[str, Any] | None) -> None:
    """Raise ConfigError (naming the key) when a plugin of ours is configured with a bad ``p2p`` map."""
    for name, class_name in our_plugins(storage_plugins, extra).items():
        role = ROLE_OF_CLASS.get(class_name)
        if role is None:
            raise ConfigError(f"storage_plugin.{name}.class_name",
                              f"{class_name!r} is not a class of {BACKEND_MODULE}; use one of "
                              f"{', '.join(ROLE_OF_CLASS)}")
        cfg = P2PConfig.from_mapping((extra or {}).get("p2p"))
        if cfg.role is not role:
            raise ConfigError("p2p.role", f"is {cfg.role.value} but the plugin class is the {role.value} "
                                          f"(storage_plugin.{name}.class_name); make them agree")


def check_config_file(environ: Mapping[str, str] = os.environ) -> None:
    """Validate our section of the LMCache YAML this process will use; a bad one raises ConfigError."""
    path = environ.get(CONFIG_ENV, "").strip()
    if not path:
        return
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        logger.warning("%s=%s not readable (%s): lmcache_p2p's settings are checked when LMCache loads it",
                       CONFIG_ENV, path, exc)
        return
    if not isinstance(raw, Mapping):
        return
    extra = raw.get("extra_config")
    try:
        check_p2p_section(raw.get("storage_plugins"), extra if isinstance(extra, Mapping) else None)
    except ConfigError as exc:
        logger.error("lmcache_p2p: %s=%s: %s; vLLM will not start", CONFIG_ENV, path, exc)
        detail = str(exc).removeprefix(f"{exc.key}: ")
        raise ConfigError(exc.key, f"{detail} (in {CONFIG_ENV}={path})") from None


def exit_process(message: str) -> None:
    """End this vLLM process at once: flush what was logged, then exit with PLUGIN_START_EXIT_CODE."""
    logger.critical("%s; this process exits (code %d)", message, PLUGIN_START_EXIT_CODE)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(PLUGIN_START_EXIT_CODE)


def guard_plugin_launcher(module: Any, abort: Callable[[str], None] = exit_process) -> None:
    """Wrap ``storage_plugin_launcher`` so that a plugin of ours that did not start fails the engine."""
    original = getattr(module, LAUNCHER, None)
    if original is None:
        logger.warning("%s.%s not found: a plugin that fails to start is only logged by LMCache",
                       STORAGE_MODULE, LAUNCHER)
        return
    if getattr(original, _PATCHED_ATTR, False):
        return
    lmcache_logger = getattr(module, "logger", None)
    setattr(module, LAUNCHER, _fail_loud(original, lmcache_logger if isinstance(lmcache_logger, logging.Logger)
                                         else None, abort))


def _fail_loud(original: Callable[..., Any], lmcache_logger: logging.Logger | None,
               abort: Callable[[str], None]) -> Callable[..., Any]:
    @functools.wraps(original)
    def storage_plugin_launcher(config: Any, metadata: Any, loop: Any, local_cpu_backend: Any, dst_device: str,
                                storage_backends: Any) -> None:
        causes = _Causes()
        if lmcache_logger is not None:
            lmcache_logger.addHandler(causes)
        try:
            original(config, metadata, loop, local_cpu_backend, dst_device, storage_backends)
        finally:
            if lmcache_logger is not None:
                lmcache_logger.removeHandler(causes)
        extra = getattr(config, "extra_config", None)
        for name, class_name in our_plugins(getattr(config, "storage_plugins", None), extra).items():
            if name not in storage_backends:
                abort(f"lmcache_p2p plugin {name!r} ({BACKEND_MODULE}.{class_name}) did not start, so this "
                      f"server must not serve: {causes.of(name, config, extra)}")

    setattr(storage_plugin_launcher, _PATCHED_ATTR, True)
    return storage_plugin_launcher


class _Causes(logging.Handler):
    """Collects the exception LMCache logs for each plugin it failed to create ("Failed to create backend
    %s: %s"): the launcher keeps nothing else of it."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.errors: dict[str, BaseException] = {}

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) == 2 and isinstance(args[1], BaseException):
            self.errors[str(args[0])] = args[1]

    def of(self, name: str, config: Any, extra: Any) -> str:
        if name in self.errors:
            return str(self.errors[name])
        try:
            check_p2p_section(getattr(config, "storage_plugins", None), extra)
        except ConfigError as exc:
            return str(exc)
        return f"see LMCache's \"Failed to create backend {name}\" above"
