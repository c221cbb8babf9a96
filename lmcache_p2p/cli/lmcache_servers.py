"""The LMCache servers of LMCache's multi-process PD recipe (``launch --connector nixl-lmcache-mp``): one per
instance, a child of the launcher like the instance, started before it.

What the server runs with is the recipe's (``connectors.lmcache_server_argv``); where it listens is the plan's
(``layout.lmcache_server``). Here: the server as a launcher child (named, logged and placed after its instance)
and the order children start in.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lmcache_p2p.cli import connectors
from lmcache_p2p.cli.instance import GpuAssignment
from lmcache_p2p.cli.layout import Instance, cpu_sets, lmcache_server
from lmcache_p2p.cli.processes import Child, startup_waves
from lmcache_p2p.config import parse_size_bytes


def child(inst: Instance, args: argparse.Namespace, log_dir: Path, gpu: GpuAssignment | None = None) -> Child | None:
    """With LMCache MP: the instance's LMCache server (named and logged after it, on its GPUs and CPUs); else None."""
    server = lmcache_server(inst, args)
    if server is None:
        return None
    name = inst.name + connectors.LMCACHE_SERVER_SUFFIX
    argv = connectors.lmcache_server_argv(server, inst.name, parse_size_bytes("--lmcache-l1-size", args.lmcache_l1_size))
    env = connectors.lmcache_server_env(gpu.indices if gpu is not None else None)
    return Child(name, argv, env, log_dir / f"{name}.log", server.health_url, cpus=cpu_sets(args).get(inst.name))


def start_waves(children: list[Child]) -> list[list[Child]]:
    """The groups the children start in: LMCache servers first (an instance's LMCacheMPConnector registers its KV
    cache with its server as the instance starts), then the rest as :func:`startup_waves` orders them."""
    servers = [c for c in children if connectors.is_lmcache_server(c.name)]
    rest = [c for c in children if not connectors.is_lmcache_server(c.name)]
    return ([servers] if servers else []) + startup_waves(rest)
