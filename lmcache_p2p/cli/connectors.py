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

``nixl-lmcache-mp`` and ``nixl-push-lmcache-mp`` are LMCache's recipe for PD in its multi-process mode
(LMCache docs ``mp/disaggregated_prefill.rst``): vLLM's ``MultiConnector`` running the NIXL connector (the
prefill -> decode handoff, as ``nixl`` / ``nixl-push``) beside ``LMCacheMPConnector`` (offload to and reuse
from the instance's own LMCache server), and per instance one ``lmcache server`` process (:class:`LmcacheServer`,
:func:`lmcache_server_argv`), started before its instance and supervised and logged like it. LMCache's connector
returns no ``kv_transfer_params`` unless asked for its cache statistics, so the prefill's answer carries the NIXL
connector's alone and the proxy's two-stage flow is the ``nixl`` one. On vLLM-CPU it runs where vLLM takes
LMCache's own connector (:func:`check_runs_here`): vLLM's built-in fallback records CUDA events.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmcache_p2p.errors import ConfigError

if TYPE_CHECKING:  # layout plans the side-channel ports by the connector: it imports this module
    from lmcache_p2p.cli.layout import Instance

SIDE_CHANNEL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
SIDE_CHANNEL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
# Flags that set our plugin's LMCache config only; given with a vLLM connector they would do nothing.
LMCACHE_ONLY_FLAGS = ("--buffer-size", "--send-buffer-size", "--p2p")
# Flags of the LMCache MP servers only; given with another connector they would do nothing.
LMCACHE_MP_ONLY_FLAGS = ("--lmcache-l1-size", "--lmcache-server-port")
LMCACHE_SERVER_SUFFIX = "-lmcache"  # an instance's LMCache server is its name + this (its child, its log)
# LMCache's chunk: a multiple of vLLM's KV block on GPUs (16 tokens) and on vLLM-CPU (128), as its connector requires.
LMCACHE_CHUNK_TOKENS = 256
# vLLM takes LMCache's own LMCacheMPConnector where lmcache ships this module and the environment does not ask for
# vLLM's built-in one (vllm/distributed/kv_transfer/kv_connector/v1/lmcache_mp_connector.py,
# _resolve_lmcache_mp_connector); the built-in one records torch.cuda.Event(interprocess=True) on every load and
# store. LMCache's runs on vLLM-CPU through its engine-driven transfer and its CPU device (lmcache 0.5.6).
LMCACHE_MP_CONNECTOR_FILE = "integration/vllm/lmcache_mp_connector.py"
LMCACHE_CPU_DEVICE_FILE = "v1/platform/devices/cpu/__init__.py"
UPSTREAM_MP_ENV = "LMCACHE_USE_UPSTREAM_MP"
VLLM_MP_SOURCE = "vllm/distributed/kv_transfer/kv_connector/v1/lmcache_mp_connector.py"


class Connector(str, enum.Enum):
    LMCACHE_P2P = "lmcache_p2p"
    NIXL = "nixl"
    NIXL_PUSH = "nixl-push"
    NIXL_LMCACHE_MP = "nixl-lmcache-mp"
    NIXL_PUSH_LMCACHE_MP = "nixl-push-lmcache-mp"

    @property
    def vllm_name(self) -> str | None:
        """vLLM's ``kv_connector`` name of the NIXL connector that moves the KV (None: ours, LMCache's connector
        with our plugin)."""
        return {Connector.NIXL: "NixlConnector", Connector.NIXL_PUSH: "NixlPushConnector",
                Connector.NIXL_LMCACHE_MP: "NixlConnector", Connector.NIXL_PUSH_LMCACHE_MP: "NixlPushConnector"}.get(self)

    @property
    def lmcache_mp(self) -> bool:
        """Whether each instance also runs LMCacheMPConnector with an LMCache server of its own."""
        return self in (Connector.NIXL_LMCACHE_MP, Connector.NIXL_PUSH_LMCACHE_MP)

    @property
    def label(self) -> str:
        """What serves, in the launcher's words."""
        if self.vllm_name is None:
            return "lmcache_p2p"
        return f"vLLM's {self.vllm_name}" + (" beside LMCache MP (MultiConnector)" if self.lmcache_mp else "")


@dataclasses.dataclass(frozen=True)
class LmcacheServer:
    """Where one instance's LMCache MP server listens: its request port (``lmcache.mp.port``, which the instance's
    LMCacheMPConnector dials) and its HTTP port (``/healthcheck``, ``/status``)."""

    host: str
    port: int
    http_port: int

    @property
    def health_url(self) -> str:
        return f"http://{self.host}:{self.http_port}/healthcheck"


def connector_of(args: argparse.Namespace) -> Connector:
    return Connector(getattr(args, "connector", Connector.LMCACHE_P2P.value))


def native(args: argparse.Namespace) -> bool:
    """Whether the instances run a connector of vLLM's own (no LMCache, no plugin of ours in the KV path)."""
    return connector_of(args) is not Connector.LMCACHE_P2P


def announces(args: argparse.Namespace) -> bool:
    """Whether the instances announce themselves to the proxy's registry (ours do); a vLLM connector's are
    registered by URL (``POST /instances/register``, or the proxy's ``--nixl-prefill`` / ``--nixl-decode``)."""
    return not native(args)


def transfer_config(connector: Connector, device: str, server: LmcacheServer | None = None) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for a vLLM connector: both roles in one config, as the proxy picks the
    role per request; the KV buffer in host memory on vLLM-CPU (there is no device memory). With LMCache MP, the
    NIXL connector's config and LMCacheMPConnector's (dialing ``server``) side by side in a MultiConnector."""
    if connector.vllm_name is None:
        raise ValueError("the lmcache_p2p connector's transfer config is instance.transfer_config's")
    config: dict[str, Any] = {"kv_connector": connector.vllm_name, "kv_role": "kv_both"}
    nixl = {**config, "kv_buffer_device": "cpu"} if device == "cpu" else config
    if not connector.lmcache_mp:
        return nixl
    if server is None:
        raise ValueError(f"--connector {connector.value} needs the instance's LMCache server")
    # NIXL first: on a decoder MultiConnector loads from the first connector that reports matched tokens.
    lmcache = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"lmcache.mp.host": f"tcp://{server.host}", "lmcache.mp.port": server.port}}
    return {"kv_connector": "MultiConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [nixl, lmcache]}}


def lmcache_server_argv(server: LmcacheServer, instance_id: str, l1_size_bytes: int,
                        python: str = sys.executable) -> list[str]:
    """``lmcache server`` for one instance: L1 of ``l1_size_bytes`` in host memory, LRU eviction. Both of its
    transfer paths (``auto``): vLLM-CPU's workers register by the engine-driven one, which lmcache 0.5.6 leaves
    out by default, and a worker whose server lacks it waits out ``lmcache.mp.mq_timeout`` at start-up."""
    return [python, "-m", "lmcache.cli.main", "server", "--host", server.host, "--port", str(server.port),
            "--http-host", server.host, "--http-port", str(server.http_port), "--instance-id", instance_id,
            "--l1-size-gb", f"{l1_size_bytes / 2**30:g}", "--eviction-policy", "LRU",
            "--chunk-size", str(LMCACHE_CHUNK_TOKENS), "--supported-transfer-mode", "auto"]


def lmcache_server_env(gpus: Sequence[int] | None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The LMCache server's environment: its instance's GPUs (it opens the instance's KV cache through CUDA IPC,
    by the device numbers the instance sees), no usage reports."""
    env = dict(os.environ if base is None else base)
    env.update({"LMCACHE_TRACK_USAGE": "false", "PYTHONUNBUFFERED": "1"})
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    return env


def is_lmcache_server(child_name: str) -> bool:
    return child_name.endswith(LMCACHE_SERVER_SUFFIX)


def check_runs_here(args: argparse.Namespace, environ: Mapping[str, str] | None = None,
                    lmcache_dir: Path | None = None) -> None:
    """Refuse up front, with the reason, an LMCache MP connector that cannot run here: no lmcache to start its
    servers, or vLLM-CPU where vLLM would take its built-in LMCacheMPConnector, which needs CUDA."""
    connector = connector_of(args)
    if not connector.lmcache_mp:
        return
    environ = os.environ if environ is None else environ
    lmcache_dir = lmcache_dir if lmcache_dir is not None else installed_lmcache_dir()
    if lmcache_dir is None:
        raise ConfigError("--connector", f"{connector.value} starts an LMCache server per instance, and lmcache is "
                                         "not installed here: install lmcache (0.5.6 on vLLM-CPU) or choose another "
                                         "--connector")
    if getattr(args, "device", "cpu") != "cpu":
        return
    builtin = (f"vLLM's built-in LMCacheMPConnector, which records torch.cuda.Event(interprocess=True) on every KV "
               f"load and store ({VLLM_MP_SOURCE}): it needs CUDA")
    if environ.get(UPSTREAM_MP_ENV):
        raise ConfigError("--connector", f"{connector.value} on vLLM-CPU: {UPSTREAM_MP_ENV} in the environment asks "
                                         f"for {builtin}; unset it (LMCache's own connector runs on CPU) or use "
                                         "--device cuda")
    missing = [f for f in (LMCACHE_MP_CONNECTOR_FILE, LMCACHE_CPU_DEVICE_FILE) if not (lmcache_dir / f).is_file()]
    if missing:
        raise ConfigError("--connector", f"{connector.value} on vLLM-CPU: the lmcache installed in {lmcache_dir} has "
                                         f"no {' or '.join('lmcache/' + f for f in missing)}, so vLLM falls back to "
                                         f"{builtin}. Install lmcache 0.5.6 (its connector runs on CPU) or use "
                                         "--device cuda")


def installed_lmcache_dir() -> Path | None:
    """The installed lmcache package's folder, found without importing it (None: not installed)."""
    spec = importlib.util.find_spec("lmcache")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations else None


def nixl_env(side_channel_port: int, side_channel_host: str, on_cpu: bool) -> dict[str, str]:
    """What vLLM's NIXL connectors need of an instance's environment, over ``vllm_env``'s (whose UCX defaults,
    ``tcp,self`` on CPU and CUDA memory support on GPU, are theirs too): the handshake listener's port and the
    address peers dial it at. On vLLM-CPU our vLLM plugin stays loaded, for its spin cap only (it patches
    LMCache's modules when they are imported, and none are here), so that the instances share cores as ours
    do; on a GPU no plugin is loaded."""
    return {SIDE_CHANNEL_PORT_ENV: str(side_channel_port), SIDE_CHANNEL_HOST_ENV: side_channel_host,
            "VLLM_PLUGINS": "lmcache_p2p" if on_cpu else ""}


def check_flags(args: argparse.Namespace) -> None:
    """Refuse, naming the flag, what has no meaning with the chosen connector: our plugin's flags with a vLLM
    connector, the LMCache servers' flags without LMCache MP."""
    given = {*getattr(args, "given", ()), *(["--p2p"] if getattr(args, "p2p", None) else [])}
    name = connector_of(args).value
    if not connector_of(args).lmcache_mp:
        for flag in LMCACHE_MP_ONLY_FLAGS:
            if flag in given:
                raise ConfigError(flag, f"sets the LMCache MP servers of --connector nixl-lmcache-mp / "
                                        f"nixl-push-lmcache-mp; --connector {name} starts none: leave it out")
    if not native(args):
        return
    if getattr(args, "transport", "nixl") != "nixl":
        raise ConfigError("--transport", f"{args.transport} is our plugin's transport; with --connector {name} "
                                         "vLLM's connector moves the KV over NIXL itself: leave --transport out")
    check_tp_runs_here(args)
    servers = "; their LMCache servers take --lmcache-l1-size" if connector_of(args).lmcache_mp else ""
    for flag in LMCACHE_ONLY_FLAGS:
        if flag in given:
            raise ConfigError(flag, f"sets our plugin's LMCache config, which --connector {name} instances do not "
                                    f"have (vLLM's connector keeps the KV in vLLM's own cache{servers}): leave it out")


def check_tp_runs_here(args: argparse.Namespace) -> None:
    """Refuse a prefiller and a decoder of different TP sizes with a vLLM connector on vLLM-CPU: run through
    ``launch`` and our proxy on vLLM-CPU 0.32.0 (float32, the tiny model), P TP2 -> D TP1 served after 5.5 min,
    then the decoder's first pull never completed and the prefiller's engine stopped stepping ("No available shared
    memory broadcast block found in 60 seconds"), so the request ended 504 after the decode's idle timeout; with
    P TP1 -> D TP2 the decoder's second rank did not start until the prefiller was stopped (not serving after
    10 min). Ours pairs different sizes on vLLM-CPU (``bench/results/tp_cpu.json``); on GPUs vLLM's own does."""
    from lmcache_p2p.cli.tensor_parallel import tp_sizes

    sizes = tp_sizes(args)
    if getattr(args, "device", "cpu") == "cpu" and sizes.prefill != sizes.decode:
        name = connector_of(args).value
        raise ConfigError("--decode-tp", (
            f"--prefill-tp {sizes.prefill} and --decode-tp {sizes.decode} with --connector {name} on vLLM-CPU: vLLM's "
            "NIXL connector did not serve different TP sizes here (the first pull never completed and the prefiller "
            "stopped stepping, or the decoder's second rank never started; docs/COMPATIBILITY.md): give both roles "
            "one size, or leave --connector out (ours pairs different sizes on vLLM-CPU)"))


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
