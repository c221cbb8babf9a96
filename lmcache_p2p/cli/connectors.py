"""Which KV connector the launched instances run (``launch --connector``), and what that changes.

``lmcache_p2p`` (the default) is LMCache with our plugin: each instance gets an LMCache YAML, announces
itself to the proxy's registry and receives KV into its decoder buffer (``instance.py``). ``nixl`` and
``nixl-push`` are vLLM's own connectors, started unchanged: a plain vLLM server with
``--kv-transfer-config {"kv_connector": "NixlConnector" | "NixlPushConnector", "kv_role": "kv_both"}``
(``kv_buffer_device: cpu`` on vLLM-CPU), no LMCache. ``NixlConnector`` is vLLM's name for its pull
connector (the decoder reads the prefiller's blocks); ``NixlPushConnector`` has the prefiller write into
blocks the decoder registered, which is the one to run on one node without RDMA, where UCX serves remote
reads over TCP (docs/ROUTERS.md).

This module is the one place that says what differs for such an instance: its transfer config, the
environment of vLLM's NIXL recipe (:func:`nixl_env`), the proxy's ``--nixl-prefill`` / ``--nixl-decode``
flags naming it (it cannot announce itself: :func:`announces`; a pod's registration sidecar,
``cli/register.py``, names it instead) and the id the proxy's registry lists it by (:func:`registry_id`), and
the launch flags that mean nothing without LMCache (:func:`check_flags`). Its handshake port (vLLM's
``VLLM_NIXL_SIDE_CHANNEL_PORT``) is in the launcher's port plan (``layout.side_channel_port``).
"""

from __future__ import annotations

import argparse
import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lmcache_p2p.errors import ConfigError

if TYPE_CHECKING:  # layout plans the side-channel ports by the connector: it imports this module
    from lmcache_p2p.cli.layout import Instance

SIDE_CHANNEL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
SIDE_CHANNEL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
# Flags that set our plugin's LMCache config only; given with a vLLM connector they would do nothing.
LMCACHE_ONLY_FLAGS = ("--buffer-size", "--send-buffer-size", "--p2p")


class Connector(str, enum.Enum):
    LMCACHE_P2P = "lmcache_p2p"
    NIXL = "nixl"
    NIXL_PUSH = "nixl-push"

    @property
    def vllm_name(self) -> str | None:
        """vLLM's ``kv_connector`` name (None: ours, LMCache's connector with our plugin)."""
        return {Connector.NIXL: "NixlConnector", Connector.NIXL_PUSH: "NixlPushConnector"}.get(self)


def connector_of(args: argparse.Namespace) -> Connector:
    return Connector(getattr(args, "connector", Connector.LMCACHE_P2P.value))


def native(args: argparse.Namespace) -> bool:
    """Whether the instances run a connector of vLLM's own (no LMCache, no plugin of ours in the KV path)."""
    return connector_of(args) is not Connector.LMCACHE_P2P


def announces(args: argparse.Namespace) -> bool:
    """Whether the instances announce themselves to the proxy's registry (ours do); a vLLM connector's are
    registered by URL (``POST /instances/register``, or the proxy's ``--nixl-prefill`` / ``--nixl-decode``)."""
    return not native(args)


def transfer_config(connector: Connector, device: str) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for a vLLM connector: both roles in one config, as the proxy picks the
    role per request; the KV buffer in host memory on vLLM-CPU (there is no device memory)."""
    if connector.vllm_name is None:
        raise ValueError("the lmcache_p2p connector's transfer config is instance.transfer_config's")
    config: dict[str, Any] = {"kv_connector": connector.vllm_name, "kv_role": "kv_both"}
    return {**config, "kv_buffer_device": "cpu"} if device == "cpu" else config


def nixl_env(side_channel_port: int, side_channel_host: str, on_cpu: bool) -> dict[str, str]:
    """What vLLM's NIXL connectors need of an instance's environment, over ``vllm_env``'s (whose UCX defaults,
    ``tcp,self`` on CPU and CUDA memory support on GPU, are theirs too): the handshake listener's port and the
    address peers dial it at. On vLLM-CPU our vLLM plugin stays loaded, for its spin cap only (it patches
    LMCache's modules when they are imported, and none are here), so that the instances share cores as ours
    do; on a GPU no plugin is loaded."""
    return {SIDE_CHANNEL_PORT_ENV: str(side_channel_port), SIDE_CHANNEL_HOST_ENV: side_channel_host,
            "VLLM_PLUGINS": "lmcache_p2p" if on_cpu else ""}


def check_flags(args: argparse.Namespace) -> None:
    """Refuse, naming the flag, what has no meaning with a vLLM connector (nothing with ours)."""
    if not native(args):
        return
    name = connector_of(args).value
    if getattr(args, "transport", "nixl") != "nixl":
        raise ConfigError("--transport", f"{args.transport} is our plugin's transport; with --connector {name} "
                                         "vLLM's connector moves the KV over NIXL itself: leave --transport out")
    given = {*getattr(args, "given", ()), *(["--p2p"] if getattr(args, "p2p", None) else [])}
    for flag in LMCACHE_ONLY_FLAGS:
        if flag in given:
            raise ConfigError(flag, f"sets our plugin's LMCache config, which --connector {name} instances do not "
                                    "have (vLLM's connector keeps the KV in vLLM's own cache): leave it out")


class Given(argparse.Action):
    """Store the value and remember that the flag was given (``args.given``), so that a flag left at its default
    is not refused (:func:`check_flags`)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = {*getattr(namespace, "given", set()), self.option_strings[-1]}


def url_of(inst: Instance) -> str:
    return f"http://{inst.host}:{inst.http_port}"


def proxy_flags(instances: Sequence[Instance]) -> list[str]:
    """The proxy's flags registering each instance by its URL: it cannot announce itself."""
    return [f"--nixl-{'prefill' if inst.role == 'prefiller' else 'decode'}={url_of(inst)}" for inst in instances]


def registry_id(args: argparse.Namespace, role: str, name: str, url: str) -> str:
    """The id the proxy's registry lists an instance under (what ``drain`` takes): the name our plugin
    announces, or, for a vLLM connector's, the id of its registration by ``url``."""
    from lmcache_p2p.config import Role
    from lmcache_p2p.proxy.router.instances import Backend, registered_id

    if announces(args):
        return name
    return registered_id(Backend.VLLM_NIXL, Role.SENDER if role == "prefiller" else Role.RECEIVER, url)


def registry_ids(args: argparse.Namespace, instances: Sequence[Instance]) -> list[str]:
    """The ids the proxy's registry lists the instances under once they are routable."""
    return [registry_id(args, inst.role, inst.name, url_of(inst)) for inst in instances]
