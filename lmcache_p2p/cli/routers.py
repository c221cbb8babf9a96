"""Which router stands in front of the instances (``launch --router``), and what each one needs of them.

``lmcache_p2p`` is our proxy. ``vllm-router`` is vllm-project's Rust router in its vLLM PD mode, started
unchanged in front of the same instances (docs/ROUTERS.md): it names the decoder by its HTTP address in
the request id, so every instance gets ``p2p.router_control_port_offset`` (a decoder's control port minus
its HTTP port) and decoders' HTTP ports are spaced like their KV ports, keeping that offset one number.
Its Prometheus listener takes ``--proxy-control-port`` (no registry runs with it).
"""

from __future__ import annotations

import argparse
import enum
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # layout places decoders by the router in front: it imports this module
    from lmcache_p2p.cli.layout import Instance


class Router(str, enum.Enum):
    LMCACHE_P2P = "lmcache_p2p"
    VLLM_ROUTER = "vllm-router"


def router_of(args: argparse.Namespace) -> Router:
    return Router(getattr(args, "router", Router.LMCACHE_P2P.value))


def foreign(args: argparse.Namespace) -> bool:
    """Whether a router other than our proxy stands in front (no registry, no disagg_spec)."""
    return router_of(args) is not Router.LMCACHE_P2P


def control_port_offset(args: argparse.Namespace) -> int:
    """A decoder's first control port minus its HTTP port, the same for every decoder (see layout)."""
    return args.kv_port - args.decode_port


def router_p2p(inst: Instance, args: argparse.Namespace, decode_tp: int) -> dict[str, Any]:
    """The ``p2p`` keys an instance needs behind a foreign router (none behind our proxy)."""
    if not foreign(args):
        return {}
    keys: dict[str, Any] = {"router_control_port_offset": control_port_offset(args)}
    if inst.role == "prefiller":
        keys["router_decoder_tp_size"] = decode_tp
    return keys


def vllm_router_command(args: argparse.Namespace, instances: list[Instance], host: str,
                        python: str = sys.executable) -> list[str]:
    """vllm-router in vLLM PD mode over the plan's instances, HTTP on --proxy-port."""
    argv = [python, "-m", "vllm_router.launch_router", "--vllm-pd-disaggregation", "--host", host,
            "--port", str(args.proxy_port), "--prometheus-host", host,
            "--prometheus-port", str(args.proxy_control_port)]
    for inst in instances:
        argv += ["--prefill" if inst.role == "prefiller" else "--decode", f"http://{inst.host}:{inst.http_port}"]
    return argv
