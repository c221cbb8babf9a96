"""One instance of a deployment as data: its vLLM command, its environment, its LMCache config.

``lmcache-p2p launch`` (processes on this host) and ``lmcache-p2p deploy kubernetes`` (pods) build
every instance here, from the same plan (``layout.plan``) and the same flags, so that the two
cannot drift apart: ports, environment, vLLM flags, GPU memory arithmetic, the LMCache YAML and
the shared secret all come from :func:`instance_spec` and :func:`proxy_command`.

What differs is only where an instance runs, its :class:`Site`: the address it binds and
advertises, its name, where it finds the proxy's registry, where its files lie. A pod learns its
address and name only once it runs, so a pod's site spells them as references: ``$(POD_IP)`` in
the command (the kubelet fills it in) and ``${POD_IP}`` in the LMCache YAML (``P2PConfig`` fills
it in at load, as it does ``${LMCACHE_P2P_SECRET}``, which never lands in a file).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from lmcache_p2p.cli import connectors, routers
from lmcache_p2p.cli import gpu as gpu_plan
from lmcache_p2p.cli.layout import Instance, lmcache_server, side_channel_port, tp_of
from lmcache_p2p.cli.tensor_parallel import split_tp_arg, tp_sizes
from lmcache_p2p.cli.vllm_env import HOST, vllm_argv, vllm_env
from lmcache_p2p.config import P2PConfig, parse_size_bytes
from lmcache_p2p.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SECRET_ENV = "LMCACHE_P2P_SECRET"


@dataclasses.dataclass(frozen=True)
class Site:
    """Where an instance runs, as its command and its LMCache YAML spell what is known only there."""

    # What vLLM (--host) and the receiver's listeners (p2p.host) bind; None: the plan's address for the
    # instance (Instance.host where the plan has one, else loopback).
    bind_host: str | None = None
    advertise_host: str | None = None  # what peers and the proxy dial (None: the bind address)
    config_host: str | None = None  # the bind address as the LMCache YAML spells it (None: the bind address)
    instance_id: str | None = None  # p2p.instance_id (None: the plan's name, e.g. decoder-1)
    proxy_host: str = HOST  # where the instances find the proxy's registry
    shared_secret: str | None = None  # p2p.shared_secret as the YAML spells it
    config_file: str = "{name}.yaml"  # LMCACHE_CONFIG_FILE; {name} and {role} are the instance's
    logging_file: str | None = None  # VLLM_LOGGING_CONFIG_PATH
    python: str = sys.executable
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)  # over the environment's defaults
    # Values for the references above, only to validate the LMCache YAML when it is made.
    sample_env: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def bind(self, inst: Instance | None = None) -> str:
        return self.bind_host or (getattr(inst, "host", HOST) if inst is not None else HOST)

    def config_bind(self, inst: Instance) -> str:
        return self.config_host or self.bind(inst)

    def advertised(self, inst: Instance, in_config: bool) -> str:
        if self.advertise_host is not None:
            return self.advertise_host
        return self.config_bind(inst) if in_config else self.bind(inst)


@dataclasses.dataclass(frozen=True)
class GpuAssignment:
    """Where one instance runs on a GPU host."""

    indices: tuple[int, ...]  # the CUDA devices it sees, one per TP rank (empty: the ones its pod is given)
    memory_utilization: float  # vLLM's --gpu-memory-utilization for it (the same share on each of its GPUs)

    @property
    def index(self) -> int | None:
        """Its first GPU (rank 0's); None when the pod's device plugin chooses."""
        return self.indices[0] if self.indices else None


@dataclasses.dataclass(frozen=True)
class InstanceSpec:
    """Everything one instance is started with."""

    instance: Instance
    tp_size: int
    argv: list[str]
    env: dict[str, str]  # what we set, over the ``base`` environment given to instance_spec
    lmcache_config: dict[str, Any] | None  # the LMCache YAML's content (None: a vLLM connector, no LMCache)
    lmcache_config_file: str | None
    health_url: str


def p2p_overrides(items: list[str]) -> dict[str, object]:
    """``--p2p KEY=VALUE`` pairs as a map (VALUE parsed as YAML: numbers, booleans, lists)."""
    out: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError("--p2p", f"expects KEY=VALUE (a key of extra_config.p2p), got {item!r}")
        out[key.strip()] = yaml.safe_load(value)
    return out


def send_buffer_bytes(args: argparse.Namespace) -> int:
    """The prefillers' VRAM send arena (--send-buffer-size; 0: chunks stay in host memory)."""
    value = getattr(args, "send_buffer_size", "0")
    return 0 if str(value).strip() == "0" else parse_size_bytes("--send-buffer-size", value)


def cache_flags(prefix_caching: bool = True) -> list[str]:
    """vLLM flags every instance we start gets, and every reference it is compared with.

    Prefix caching is vLLM's default (on); ``--no-prefix-caching`` turns it off. Prompt-token
    details make every response carry ``usage.prompt_tokens_details.cached_tokens``: how many
    prompt tokens the instance did not compute (its prefix cache plus KV loaded through LMCache).
    """
    return ["--enable-prompt-tokens-details", *([] if prefix_caching else ["--no-enable-prefix-caching"])]


def lmcache_config(inst: Instance, args: argparse.Namespace, site: Site) -> dict[str, Any]:
    """The instance's LMCache YAML: the shipped file with this instance's addresses filled in."""
    base = "prefiller.yaml" if inst.role == "prefiller" else "decoder.yaml"
    cfg = yaml.safe_load((CONFIGS / base).read_text())
    p2p = cfg["extra_config"]["p2p"]
    advertised = site.advertised(inst, in_config=True)
    p2p.update(transport=args.transport, instance_id=site.instance_id or inst.name,
               http_url=f"http://{advertised}:{inst.http_port}")
    if not routers.foreign(args):  # a foreign router keeps no registry: nothing to announce to
        p2p["proxy_url"] = f"tcp://{site.proxy_host}:{args.proxy_control_port}"
    p2p.update(routers.router_p2p(inst, args, tp_sizes(args).decode))
    if site.shared_secret:
        p2p["shared_secret"] = site.shared_secret
    if inst.role == "prefiller":
        # a sender listens on nothing of ours, but Gloo (--transport nccl on CPU) binds its pair's socket here
        p2p["host"] = advertised
        if args.device == "cuda" and send_buffer_bytes(args):
            p2p.update(buffer_size=args.send_buffer_size, buffer_device="cuda")
    if inst.role == "decoder":
        p2p["host"] = site.config_bind(inst)
        if site.advertise_host is not None:
            p2p["advertise_host"] = site.advertise_host
        p2p.update(buffer_size=args.buffer_size, buffer_device=args.device, control_ports=inst.control_port,
                   transport_ports=inst.transport_port)
        if not getattr(args, "prefix_caching", True):
            p2p["buffer_cache"] = False
    if inst.tp_size > 1:  # every rank stores and loads its own KV (LMCache keeps an MLA latent on rank 0 only)
        cfg["extra_config"]["save_only_first_rank"] = False
    p2p.update(p2p_overrides(getattr(args, "p2p", [])))
    # a bad --p2p fails here, naming the key, not in every instance's log
    P2PConfig.from_mapping(p2p, environ={**os.environ, **site.sample_env})
    return cfg


def transfer_config(inst: Instance, args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's --kv-transfer-config for the instance's role (with a vLLM connector, its recipe's)."""
    if connectors.native(args):
        return connectors.transfer_config(connectors.connector_of(args), args.device, lmcache_server(inst, args))
    transfer: dict[str, Any] = {"kv_connector": "LMCacheConnectorV1",
                                "kv_role": "kv_producer" if inst.role == "prefiller" else "kv_consumer"}
    if inst.role == "decoder":
        transfer["kv_connector_extra_config"] = {"skip_last_n_tokens": 1}
        # A chunk missing at retrieve after the lookup counted it (cancelled or expired in between) is
        # computed by vLLM instead of failing the request (vLLM's default policy is "fail").
        transfer["kv_load_failure_policy"] = "recompute"
    return transfer


def instance_utilization(inst: Instance, args: argparse.Namespace, total_bytes: int, sharing: int = 1) -> float:
    """vLLM's --gpu-memory-utilization for the instance: its part of the GPU (``sharing`` instances on
    it) less its buffer's share (a decoder's receive buffer, a prefiller's send arena) on each GPU."""
    base, _ = gpu_plan.split_utilization_arg(args.vllm_arg)
    base = args.gpu_memory_utilization if base is None else base
    share = math.floor(base / sharing * 100 + 1e-6) / 100
    if connectors.native(args):  # vLLM's connector keeps the KV in vLLM's own cache: no buffer of ours
        return share
    if inst.role == "decoder":
        return gpu_plan.utilization_with_buffer(share, parse_size_bytes("--buffer-size", args.buffer_size),
                                                total_bytes)
    send_bytes = send_buffer_bytes(args)
    if send_bytes:
        return gpu_plan.utilization_with_buffer(share, send_bytes, total_bytes, "--send-buffer-size",
                                                "the prefiller's send arena")
    return share


def instance_spec(inst: Instance, model: Path | str, args: argparse.Namespace, site: Site,
                  gpu: GpuAssignment | None = None, cpu_core: int | Sequence[int] | None = None,
                  base: Mapping[str, str] | None = None) -> InstanceSpec:
    """The instance's command, environment and LMCache config (``gpu``: on a GPU, with its share); with a vLLM
    connector (``--connector nixl``) no LMCache config, the environment of vLLM's NIXL recipe instead.

    ``base``: the environment the instance starts over (default ``os.environ``, whose values win over
    the defaults of vllm_env); ``{}`` gives only what we set (a rendered pod's environment).
    """
    _, vllm_args = split_tp_arg(args.vllm_arg)  # each instance gets its own role's TP size below
    _, passthrough = gpu_plan.split_utilization_arg(vllm_args)
    gpu_args = [] if gpu is None else ["--gpu-memory-utilization", f"{gpu.memory_utilization:.2f}"]
    argv = vllm_argv(model, inst.http_port, *cache_flags(getattr(args, "prefix_caching", True)),
                     "--max-model-len", str(args.max_model_len), *tp_flags(inst.tp_size),
                     "--kv-transfer-config", json.dumps(transfer_config(inst, args)), *gpu_args,
                     *(passthrough if gpu is not None else vllm_args), host=site.bind(inst), python=site.python)
    native = connectors.native(args)
    config_file = None if native else site.config_file.format(name=inst.name, role=inst.role)
    env = vllm_env(cpu_core=cpu_core, gpu=gpu.indices if gpu is not None and gpu.indices else None,
                   on_gpu=gpu is not None,
                   lmcache_config=config_file, logging_config=site.logging_file, base=base,
                   extra={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"})  # a failed NCCL op must not kill the server
    env.update(site.env)
    if native:
        env.pop("LMCACHE_CONFIG_FILE", None)  # one in the caller's environment would be our plugin's to check
        env.update(connectors.nixl_env(side_channel_port(inst, args), site.advertised(inst, in_config=False),
                                       on_cpu=gpu is None))
    return InstanceSpec(inst, tp_of(inst, args), argv, env, None if native else lmcache_config(inst, args, site),
                        config_file, f"http://{site.advertised(inst, in_config=False)}:{inst.http_port}/health")


def tp_flags(tp_size: int) -> list[str]:
    """vLLM's flag for an instance's TP size (none at TP 1, vLLM's default: a TP1 argv stays as it was)."""
    return [] if tp_size == 1 else ["--tensor-parallel-size", str(tp_size)]


def proxy_command(args: argparse.Namespace, site: Site, tokenizer: str | None = None,
                  advertise_host: str | None = None) -> list[str]:
    """The proxy's command line: HTTP on --proxy-port, the registry on --proxy-control-port (instances dial it
    by ``advertise_host`` when that is not the bind address)."""
    named = any(a.startswith("--tokenizer") for a in args.proxy_arg)
    # instances that split reasoning out of the answer do it on their chat endpoint: the proxy decodes chats there
    parsers = any(a.startswith("--reasoning-parser") for a in getattr(args, "vllm_arg", None) or ()) and not any(
        a.startswith(("--chat-parsers", "--no-chat-parsers")) for a in args.proxy_arg)
    host = site.bind_host or getattr(args, "host", HOST)
    return [site.python, "-m", "lmcache_p2p.cli.main", "proxy", "--host", host,
            "--port", str(args.proxy_port), "--control-port", str(args.proxy_control_port), "--policy", args.policy,
            "--workers", str(args.proxy_workers), *(["--advertise-host", advertise_host] if advertise_host else []),
            *(["--tokenizer", tokenizer] if tokenizer and not named else []), *(["--chat-parsers"] if parsers else []),
            *args.proxy_arg]
