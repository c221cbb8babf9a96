"""Where each instance of a launch runs: its name, its TP size, its ports and (on vLLM-CPU) its cores.

Ports follow LMCache's 1p1d example (--proxy-port 9100, --prefill-port 7100+i, --decode-port
7200+i, --kv-port 7300+10*i, the NCCL store 100 above); a decoder of TP size k listens on k control
ports (and k NCCL store ports) from there, one per rank, and decoders sit max(10, k) ports apart.
With a vLLM connector (``--connector nixl``) no instance listens on a port of ours; each one's NIXL
handshake listener takes --kv-port + its place in the launch order (prefillers first) instead, and with
LMCache MP (``--connector nixl-lmcache-mp``) each one's LMCache server takes two ports from
--lmcache-server-port + 2 * that place (its request port, then its HTTP port).
:func:`planned_ports` lists every port a launch will listen on, with what it is for, so that the
launcher checks them before it starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os

from lmcache_p2p.cli import connectors, ports, routers
from lmcache_p2p.cli.tensor_parallel import tp_sizes

LOOPBACK = "127.0.0.1"

KV_PORT_STRIDE = 10  # decoder i's KV ports start at --kv-port + 10*i (one per TP rank from there)
TRANSPORT_PORT_OFFSET = 100  # a decoder's NCCL store ports sit this far above its control ports
SIDE_CHANNEL = "side-channel"  # the name of a vLLM connector's NIXL handshake port (vLLM's word for it)
LMCACHE_SERVER_PORTS = ("lmcache", "lmcache-http")  # the names of an LMCache MP server's ports (loopback only)


class CpuPlacement(str, enum.Enum):
    """Where the launcher lets the processes around the vLLM-CPU workers run (``--cpu-placement``)."""

    ROLES = "roles"
    WORKERS = "workers"


@dataclasses.dataclass(frozen=True)
class Instance:
    role: str  # "prefiller" | "decoder"
    index: int
    http_port: int
    control_port: int = 0  # a decoder's rank 0; rank r listens on control_port + r
    transport_port: int = 0  # a decoder's rank 0 NCCL store; rank r on transport_port + r
    tp_size: int = 1  # vLLM's --tensor-parallel-size for this instance
    # Where every listener of the instance binds (vLLM's HTTP, a decoder's KV control port and NCCL
    # store) and the address peers dial; --host, or each host's own address on several machines.
    host: str = "127.0.0.1"
    # Its place in the launch order, where the plan's counts do not say it (a pod is alone at its address: 0).
    slot: int | None = None

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def control_ports(self) -> tuple[int, ...]:
        """A decoder's KV control port per TP rank (empty for a prefiller: it listens on none)."""
        return tuple(self.control_port + r for r in range(self.tp_size)) if self.role == "decoder" else ()

    @property
    def transport_ports(self) -> tuple[int, ...]:
        """A decoder's NCCL store port per TP rank (used with --transport nccl only)."""
        return tuple(self.transport_port + r for r in range(self.tp_size)) if self.role == "decoder" else ()


def plan(args: argparse.Namespace) -> list[Instance]:
    sizes = tp_sizes(args)
    host = getattr(args, "host", "127.0.0.1")
    prefillers = [Instance("prefiller", i, args.prefill_port + i, tp_size=sizes.prefill, host=host)
                  for i in range(args.prefill)]
    decoders = [decoder_instance(args, i) for i in range(args.decode)]
    return prefillers + decoders


def kv_port_stride(args: argparse.Namespace) -> int:
    """How far apart two decoders' first KV ports are: 10, or the decoders' TP size when larger."""
    return max(KV_PORT_STRIDE, tp_sizes(args).decode)


def decoder_instance(args: argparse.Namespace, index: int) -> Instance:
    """Decoder ``index``: HTTP on --decode-port + i, KV control on --kv-port + 10*i (+ rank), NCCL store 100 above.
    Behind a foreign router its HTTP port is --decode-port + 10*i: every decoder's control port is then its
    HTTP port + one offset, which is how such a router's prefillers find it (cli/routers.py)."""
    control = args.kv_port + kv_port_stride(args) * index
    http = args.decode_port + (kv_port_stride(args) * index if routers.foreign(args) else index)
    return Instance("decoder", index, http, control, control + TRANSPORT_PORT_OFFSET,
                    tp_size=tp_sizes(args).decode, host=getattr(args, "host", "127.0.0.1"))


def tp_of(inst: Instance, args: argparse.Namespace) -> int:
    """The instance's tensor-parallel size: its ranks, GPUs and per-rank ports (its role's, from the plan)."""
    return inst.tp_size


def instance_ports(inst: Instance, args: argparse.Namespace) -> list[ports.PortUse]:
    """Every port one instance listens on, with what it is for: HTTP, then per TP rank its KV control
    port and (NCCL) its store; with a vLLM connector HTTP and its NIXL handshake port."""
    flag = "--prefill-port" if inst.role == "prefiller" else "--decode-port"
    uses = [ports.PortUse(inst.http_port, f"{inst.name}'s HTTP ({flag})", "http")]
    if connectors.native(args):
        uses.append(ports.PortUse(side_channel_port(inst, args),
                                  f"{inst.name}'s NIXL handshake ({connectors.SIDE_CHANNEL_PORT_ENV}, --kv-port)",
                                  SIDE_CHANNEL))
        server = lmcache_server(inst, args)
        if server is not None:
            uses += [ports.PortUse(server.port, f"{inst.name}'s LMCache server (--lmcache-server-port)",
                                   LMCACHE_SERVER_PORTS[0]),
                     ports.PortUse(server.http_port, f"{inst.name}'s LMCache server HTTP (--lmcache-server-port + 1)",
                                   LMCACHE_SERVER_PORTS[1])]
        return uses
    uses += [ports.PortUse(port, f"{inst.name} rank {r}'s KV control port (--kv-port)", f"kv-{r}")
             for r, port in enumerate(inst.control_ports)]
    if args.transport == "nccl":
        uses += [ports.PortUse(port, f"{inst.name} rank {r}'s NCCL store (--kv-port + {TRANSPORT_PORT_OFFSET})",
                               f"nccl-{r}") for r, port in enumerate(inst.transport_ports)]
    return uses


def planned_ports(args: argparse.Namespace) -> list[ports.PortUse]:
    """Every port the launch will listen on, with what it is for (checked before anything starts)."""
    front = "vllm-router" if routers.foreign(args) else "the proxy"
    second = "Prometheus listener" if routers.foreign(args) else "registry"
    uses = [ports.PortUse(args.proxy_port, f"{front}'s HTTP (--proxy-port)"),
            ports.PortUse(args.proxy_control_port, f"{front}'s {second} (--proxy-control-port)")]
    for inst in plan(args):
        uses += instance_ports(inst, args)
    return uses


def side_channel_port(inst: Instance, args: argparse.Namespace) -> int:
    """With a vLLM connector: where the instance's NIXL handshake listener binds (its TP ranks share it)."""
    return args.kv_port + slot_of(inst, args)


def lmcache_server(inst: Instance, args: argparse.Namespace) -> connectors.LmcacheServer | None:
    """With LMCache MP: where the instance's LMCache server listens (its TP ranks share it); else None. Always on
    loopback, whatever the instance's ``--host``: only its own instance and the launcher's health check dial it,
    and it has no share of our secret."""
    if not connectors.connector_of(args).lmcache_mp:
        return None
    port = args.lmcache_server_port + 2 * slot_of(inst, args)
    return connectors.LmcacheServer(LOOPBACK, port, port + 1)


def slot_of(inst: Instance, args: argparse.Namespace) -> int:
    """The instance's place in the launch order (prefillers first)."""
    if inst.slot is not None:
        return inst.slot
    return inst.index if inst.role == "prefiller" else args.prefill + inst.index


def rank_slots_of(inst: Instance, args: argparse.Namespace) -> range:
    """The places of the instance's TP ranks among every rank of the launch (prefillers first): with
    ``--device cuda`` the positions in ``--gpus`` of its GPUs, one per rank."""
    first = 0 if inst.role == "prefiller" else args.prefill * tp_sizes(args).prefill
    start = first + inst.index * inst.tp_size
    return range(start, start + inst.tp_size)


def cpu_cores_of(inst: Instance, args: argparse.Namespace, cores: int | None = None) -> tuple[int, ...]:
    """The vLLM-CPU instance's core per TP rank (its ``VLLM_CPU_OMP_THREADS_BIND``, ``|`` between ranks).

    With a core per rank, one each in launch order. With fewer cores than ranks, prefillers and
    decoders get separate cores (prefillers the first ``max(1, cores * P ranks // all ranks)``) and
    share within their role: a prefill burst then never slows a decoder's steps, and a decoder never
    slows a prefill (time to first token). Where a role's share has fewer cores than its TP size, the
    roles share every core instead (an instance's ranks on cores of their own matter more): prefiller
    ranks count up from core 0, decoder ranks down from the last core."""
    cores = cores or os.cpu_count() or 1
    sizes = tp_sizes(args)
    prefill_ranks, decode_ranks = args.prefill * sizes.prefill, args.decode * sizes.decode
    if prefill_ranks + decode_ranks <= cores or cores < 2:
        return tuple(slot % cores for slot in rank_slots_of(inst, args))
    prefill_cores = min(cores - 1, max(1, cores * prefill_ranks // (prefill_ranks + decode_ranks)))
    within = [inst.index * inst.tp_size + r for r in range(inst.tp_size)]
    if sizes.prefill > prefill_cores or sizes.decode > cores - prefill_cores:
        if inst.role == "prefiller":
            return tuple(n % cores for n in within)
        return tuple(cores - 1 - n % cores for n in within)
    pool = range(prefill_cores) if inst.role == "prefiller" else range(prefill_cores, cores)
    return tuple(pool[n % len(pool)] for n in within)


def cpu_core_of(inst: Instance, args: argparse.Namespace, cores: int | None = None) -> int:
    """The core of the instance's first TP rank (see :func:`cpu_cores_of`)."""
    return cpu_cores_of(inst, args, cores)[0]


def cpu_sets(args: argparse.Namespace, cores: int | None = None,
             usable: set[int] | frozenset[int] | None = None) -> dict[str, frozenset[int]]:
    """The CPUs a child may use, by child name; a child not named runs anywhere.

    vLLM pins only an instance's worker (its model steps) to the instance's core; its API server and
    engine core run anywhere. A decoder's engine core schedules a step every few milliseconds and
    busy-waits for its worker in between, and its API server streams every token: left free, the
    kernel puts that work on the prefillers' cores, where the prefills that set time to first token
    wait for it. With ``--cpu-placement roles`` a decoder's processes use every core but the
    prefillers' worker cores. The proxy and the prefillers' other processes stay free: their work
    comes in short bursts per request and goes to whichever core is idle (keeping the proxy on the
    decoders' cores too made decode steps and handovers slower). Nothing is restricted when the
    roles share their cores (fewer than 2 cores). ``usable``: the CPUs the launcher may use
    (default its own affinity); a set is cut to them.
    """
    if args.device != "cpu" or CpuPlacement(getattr(args, "cpu_placement", CpuPlacement.ROLES.value)) \
            is not CpuPlacement.ROLES:
        return {}
    cores = cores or os.cpu_count() or 1
    instances = plan(args)
    prefill_cores = {c for i in instances if i.role == "prefiller" for c in cpu_cores_of(i, args, cores)}
    decode_cores = {c for i in instances if i.role == "decoder" for c in cpu_cores_of(i, args, cores)}
    if prefill_cores & decode_cores:
        return {}
    mine = frozenset(os.sched_getaffinity(0) if usable is None else usable)
    allowed = (frozenset(range(cores)) - prefill_cores) & mine
    if not allowed:  # the launcher itself may not use any of them (taskset / cpuset): leave the decoders free
        return {}
    return {i.name: allowed for i in instances if i.role == "decoder"}
