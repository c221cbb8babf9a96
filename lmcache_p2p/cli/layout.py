"""Where each instance of a launch runs: its name, its ports and (on vLLM-CPU) its cores.

Ports follow LMCache's 1p1d example (--proxy-port 9100, --prefill-port 7100+i, --decode-port
7200+i, --kv-port 7300+10*i, the NCCL store 100 above); :func:`planned_ports` lists every one a
launch will listen on, with what it is for, so that the launcher checks them before it starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os

from lmcache_p2p.cli import ports

KV_PORT_STRIDE = 10  # decoder i's KV ports start at --kv-port + 10*i (one per TP rank from there)
TRANSPORT_PORT_OFFSET = 100  # a decoder's NCCL store ports sit this far above its control ports


class CpuPlacement(str, enum.Enum):
    """Where the launcher lets the processes around the vLLM-CPU workers run (``--cpu-placement``)."""

    ROLES = "roles"
    WORKERS = "workers"


@dataclasses.dataclass(frozen=True)
class Instance:
    role: str  # "prefiller" | "decoder"
    index: int
    http_port: int
    control_port: int = 0
    transport_port: int = 0
    # Where every listener of the instance binds (vLLM's HTTP, a decoder's KV control port and NCCL
    # store) and the address peers dial; --host, or each host's own address on several machines.
    host: str = "127.0.0.1"

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


def plan(args: argparse.Namespace) -> list[Instance]:
    host = getattr(args, "host", "127.0.0.1")
    prefillers = [Instance("prefiller", i, args.prefill_port + i, host=host) for i in range(args.prefill)]
    decoders = [decoder_instance(args, i) for i in range(args.decode)]
    return prefillers + decoders


def decoder_instance(args: argparse.Namespace, index: int) -> Instance:
    """Decoder ``index``: HTTP on --decode-port + i, KV control on --kv-port + 10*i, NCCL store 100 above."""
    control = args.kv_port + KV_PORT_STRIDE * index
    return Instance("decoder", index, args.decode_port + index, control, control + TRANSPORT_PORT_OFFSET,
                    getattr(args, "host", "127.0.0.1"))


def tp_size_of(vllm_args: list[str]) -> int:
    """The tensor-parallel size among the vLLM arguments (1 when not given)."""
    for i, arg in enumerate(vllm_args):
        name, sep, value = arg.partition("=")
        if name in ("--tensor-parallel-size", "-tp"):
            raw = value if sep else (vllm_args[i + 1] if i + 1 < len(vllm_args) else "1")
            try:
                return max(1, int(raw))
            except ValueError:
                return 1
    return 1


def tp_of(inst: Instance, args: argparse.Namespace) -> int:
    """The instance's tensor-parallel size: its ranks, GPUs and per-rank ports."""
    return tp_size_of(args.vllm_arg)


def instance_ports(inst: Instance, args: argparse.Namespace) -> list[ports.PortUse]:
    """Every port one instance listens on, with what it is for: HTTP, then per TP rank its KV control
    port and (NCCL) its store."""
    flag = "--prefill-port" if inst.role == "prefiller" else "--decode-port"
    uses = [ports.PortUse(inst.http_port, f"{inst.name}'s HTTP ({flag})")]
    if inst.role != "decoder":
        return uses
    ranks = range(tp_of(inst, args))
    uses += [ports.PortUse(inst.control_port + r, f"{inst.name} rank {r}'s KV control port (--kv-port)")
             for r in ranks]
    if args.transport == "nccl":
        uses += [ports.PortUse(inst.transport_port + r, f"{inst.name} rank {r}'s NCCL store (--kv-port + "
                               f"{TRANSPORT_PORT_OFFSET})") for r in ranks]
    return uses


def planned_ports(args: argparse.Namespace) -> list[ports.PortUse]:
    """Every port the launch will listen on, with what it is for (checked before anything starts)."""
    uses = [ports.PortUse(args.proxy_port, "the proxy's HTTP (--proxy-port)"),
            ports.PortUse(args.proxy_control_port, "the proxy's registry (--proxy-control-port)")]
    for inst in plan(args):
        uses += instance_ports(inst, args)
    return uses


def slot_of(inst: Instance, args: argparse.Namespace) -> int:
    """The instance's place in the launch order (prefillers first): its CPU core or GPU."""
    return inst.index if inst.role == "prefiller" else args.prefill + inst.index


def cpu_core_of(inst: Instance, args: argparse.Namespace, cores: int | None = None) -> int:
    """The vLLM-CPU instance's core. With a core per instance, one each in launch order. With fewer
    cores than instances, prefillers and decoders get separate cores (prefillers the first
    ``max(1, cores * P // (P + D))``) and share within their role: a prefill burst then never slows
    a decoder's steps, and a decoder never slows a prefill (time to first token)."""
    cores = cores or os.cpu_count() or 1
    total = args.prefill + args.decode
    if total <= cores or cores < 2:
        return slot_of(inst, args) % cores
    prefill_cores = min(cores - 1, max(1, cores * args.prefill // total))
    if inst.role == "prefiller":
        return inst.index % prefill_cores
    return prefill_cores + inst.index % (cores - prefill_cores)


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
    prefill_cores = {cpu_core_of(i, args, cores) for i in instances if i.role == "prefiller"}
    decode_cores = {cpu_core_of(i, args, cores) for i in instances if i.role == "decoder"}
    if prefill_cores & decode_cores:
        return {}
    mine = frozenset(os.sched_getaffinity(0) if usable is None else usable)
    allowed = (frozenset(range(cores)) - prefill_cores) & mine
    if not allowed:  # the launcher itself may not use any of them (taskset / cpuset): leave the decoders free
        return {}
    return {i.name: allowed for i in instances if i.role == "decoder"}
