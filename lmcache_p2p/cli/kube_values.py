"""What a platform team sets per cluster: images, replicas, resources, scheduling, the optional objects.

These are the Helm chart's values (``deploy helm``) and the flags of ``deploy kubernetes`` that
make them: the renderer builds its objects from a :class:`Values`, and the chart's templates are
those same objects with every value replaced by a reference into ``values.yaml``. What shapes the
instances themselves (model, TP, ports, buffers, transport) is the plan's, fixed when rendering.

Resources default to what the plan needs: CPU and memory per TP rank, the host memory LMCache and
the buffers pin, the /dev/shm size (a memory emptyDir counts against the pod's memory limit), and
for the proxy a core and a GiB per relay worker (each loads a tokenizer). Requests equal limits
(Guaranteed QoS: evicted last) unless ``--cpu-limit none``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import yaml

from lmcache_p2p import __version__
from lmcache_p2p.cli.instance import InstanceSpec
from lmcache_p2p.config import parse_size_bytes
from lmcache_p2p.errors import ConfigError

DEFAULT_IMAGE = f"lmcache-p2p:{__version__}"  # deploy/docker/Dockerfile builds it
RUN_AS_USER = 10001  # the Dockerfile's user; above the host's UIDs
CPU_PER_RANK = {"cuda": 8, "cpu": 2}  # cores per TP rank: vLLM's API server, engine core, worker, tokenizers
MEMORY_GIB_PER_RANK = {"cuda": 32, "cpu": 8}  # host memory per TP rank besides LMCache's and the buffers
SHM_GIB_PER_RANK = 2  # /dev/shm: vLLM's TP message queue and NCCL's host buffers
PROXY_MEMORY_GIB = 1  # the coordinator (registry, routing, metrics)
PROXY_WORKER_MEMORY_GIB = 1  # a relay worker with its tokenizer
SCRATCH_SIZE = "20Gi"  # HOME and /tmp of an instance pod: torch, Triton and vLLM compile caches
PROXY_SCRATCH_SIZE = "1Gi"
REGISTRAR_CPU, REGISTRAR_MEMORY = "100m", "128Mi"  # an HTTP call every few seconds; Python with httpx
# An LMCache MP server beside its L1 (--lmcache-l1-size): Python with torch and lmcache imported, its request and
# HTTP servers; one core serves one instance's lookups, stores and loads.
LMCACHE_SERVER_CPU, LMCACHE_SERVER_MEMORY_GIB = "1", 2
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
_QUANTITY = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")
_CPU = re.compile(r"\d+(?:\.\d+)?m?")
_SUFFIX = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def chart_field(kind: str, default: Any = dataclasses.MISSING, factory: Any = dataclasses.MISSING) -> Any:
    """A value of the chart: ``scalar`` (always written), ``optional`` (left out when empty) or
    ``block`` (a mapping or list, left out when empty); how deploy/helm templates it."""
    return dataclasses.field(default=default, default_factory=factory, metadata={"chart": kind})


@dataclasses.dataclass
class PodValues:
    """Where the pods of one role run and what they may use."""

    resources: dict[str, Any] = chart_field("block", factory=dict)
    node_selector: dict[str, str] = chart_field("block", factory=dict)
    tolerations: list[dict[str, str]] = chart_field("block", factory=list)
    affinity: dict[str, Any] = chart_field("block", factory=dict)
    topology_spread_constraints: list[dict[str, Any]] = chart_field("block", factory=list)
    priority_class_name: str = chart_field("optional", "")
    runtime_class_name: str = chart_field("optional", "")


@dataclasses.dataclass
class RoleValues(PodValues):
    replicas: Any = chart_field("scalar", 1)


@dataclasses.dataclass
class ImageValues:
    ref: str = chart_field("scalar", DEFAULT_IMAGE)
    pull_policy: str = chart_field("scalar", "Always")
    pull_secrets: list[dict[str, str]] = chart_field("block", factory=list)


@dataclasses.dataclass
class Toggle:
    enabled: Any = chart_field("scalar", False)


@dataclasses.dataclass
class Values:
    """The chart's values.yaml (keys in camelCase there, as Helm charts spell them)."""

    image: ImageValues
    prefill: RoleValues
    decode: RoleValues
    proxy: PodValues
    shared_secret: str = chart_field("scalar", "")
    service_monitor: Toggle = dataclasses.field(default_factory=Toggle)
    network_policy: Toggle = dataclasses.field(default_factory=Toggle)

    def role(self, role: str) -> RoleValues:
        return self.prefill if role == "prefiller" else self.decode

    def enabled(self, path: str) -> bool:
        """Whether the value at ``path`` (camelCase, dotted) is set: an optional object is rendered."""
        node: Any = self
        for key in path.split("."):
            node = getattr(node, _snake(key))
        return bool(node)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def _snake(name: str) -> str:
    return re.sub(r"[A-Z]", lambda m: "_" + m.group().lower(), name)


def to_chart(values: Any) -> Any:
    """``values`` as values.yaml holds them: dataclass fields in camelCase, what they hold as it is."""
    if dataclasses.is_dataclass(values):
        return {_camel(f.name): to_chart(getattr(values, f.name)) for f in dataclasses.fields(values)}
    return values


def markers(cls: type, path: str = "") -> Any:
    """A ``cls`` whose every value is a marker naming its kind and path (``@@block:decode.tolerations@@``):
    the objects built from it are the chart's templates (helm_chart.py replaces the markers)."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        at = f"{path}.{_camel(f.name)}" if path else _camel(f.name)
        kind = f.metadata.get("chart")
        kwargs[f.name] = markers(_field_type(cls, f), at) if kind is None else f"@@{kind}:{at}@@"
    return cls(**kwargs)


def _field_type(cls: type, f: dataclasses.Field) -> type:
    return {"image": ImageValues, "prefill": RoleValues, "decode": RoleValues, "proxy": PodValues,
            "service_monitor": Toggle, "network_policy": Toggle}[f.name]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    r = parser.add_argument_group("resources (requests = limits by default: Guaranteed QoS)")
    for role, flag in (("prefiller", "prefill"), ("decoder", "decode")):
        r.add_argument(f"--{flag}-cpu", default=None, metavar="CORES",
                       help=f"CPU of a {role} pod (default {CPU_PER_RANK['cuda']} per TP rank on GPUs, "
                            f"{CPU_PER_RANK['cpu']} on vLLM-CPU)")
        r.add_argument(f"--{flag}-memory", default=None, metavar="QUANTITY",
                       help=f"memory of a {role} pod, e.g. 96Gi (default: {MEMORY_GIB_PER_RANK['cuda']}Gi per TP "
                            f"rank on GPUs, {MEMORY_GIB_PER_RANK['cpu']}Gi on vLLM-CPU, plus LMCache's host memory, "
                            "host-side buffers and --shm-size)")
    r.add_argument("--proxy-cpu", default=None, metavar="CORES",
                   help="CPU of the proxy pod (default: one per relay worker and one to route)")
    r.add_argument("--proxy-memory", default=None, metavar="QUANTITY",
                   help=f"memory of the proxy pod (default {PROXY_MEMORY_GIB}Gi, plus "
                        f"{PROXY_WORKER_MEMORY_GIB}Gi per relay worker with --proxy-workers > 1: each loads a tokenizer)")
    r.add_argument("--shm-size", default=None, metavar="QUANTITY",
                   help=f"size limit of /dev/shm in an instance pod (default {SHM_GIB_PER_RANK}Gi per TP rank); "
                        "it counts against the pod's memory")
    r.add_argument("--scratch-size", default=SCRATCH_SIZE, metavar="QUANTITY",
                   help="size limit of each writable emptyDir of an instance pod (HOME, /tmp: compile caches) "
                        "(default %(default)s)")
    r.add_argument("--cpu-limit", choices=["equal", "none"], default="equal",
                   help="equal: CPU limit = request (Guaranteed QoS, exclusive cores under the static CPU manager); "
                        "none: no CPU limit (Burstable, never throttled) (default %(default)s)")
    s = parser.add_argument_group("scheduling (instance pods; --proxy-* for the proxy's)")
    s.add_argument("--node-selector", action="append", default=[], metavar="KEY=VALUE",
                   help="a node label every instance pod requires, e.g. nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3; "
                        "repeatable")
    s.add_argument("--toleration", action="append", default=[], metavar="KEY[=VALUE][:EFFECT]",
                   help="a taint instance pods tolerate, e.g. nvidia.com/gpu:NoSchedule (no VALUE: any value); "
                        "repeatable")
    s.add_argument("--affinity", type=Path, default=None, metavar="FILE",
                   help="a YAML file holding a pod `affinity` for the instance pods (node affinity, ...); the "
                        "decoders' anti-affinity (--decoder-spread) is added to it")
    s.add_argument("--topology-spread", action="append", default=[], metavar="KEY[:DoNotSchedule]",
                   help="spread each role's pods evenly over this node label (maxSkew 1), e.g. "
                        "topology.kubernetes.io/zone; ScheduleAnyway unless :DoNotSchedule; repeatable")
    s.add_argument("--runtime-class", default="", metavar="NAME",
                   help="runtimeClassName of the instance pods, e.g. nvidia")
    s.add_argument("--priority-class", default="", metavar="NAME",
                   help="priorityClassName of every pod (the proxy's too: its restart fails every open request)")
    s.add_argument("--proxy-node-selector", action="append", default=[], metavar="KEY=VALUE",
                   help="a node label the proxy pod requires; repeatable")
    s.add_argument("--proxy-toleration", action="append", default=[], metavar="KEY[=VALUE][:EFFECT]",
                   help="a taint the proxy pod tolerates; repeatable")
    s.add_argument("--image-pull-policy", choices=PULL_POLICIES, default="Always",
                   help="imagePullPolicy of every container; Always re-checks the tag with the registry at each "
                        "start and downloads only what changed (default %(default)s)")
    s.add_argument("--image-pull-secret", action="append", default=[], metavar="NAME",
                   help="a Secret of type kubernetes.io/dockerconfigjson for the image's registry; repeatable")
    o = parser.add_argument_group("security and optional objects")
    o.add_argument("--run-as-user", type=int, default=RUN_AS_USER,
                   help="UID (and GID) every container runs as; the image's user (default %(default)s)")
    o.add_argument("--service-monitor", action="store_true",
                   help="a ServiceMonitor (Prometheus Operator) scraping /metrics of the proxy and every instance")
    o.add_argument("--no-network-policy", dest="network_policy", action="store_false",
                   help="leave out the NetworkPolicies (rendered by default: each port open only to its peers)")


def quantity_bytes(flag: str, value: str) -> int:
    """A Kubernetes memory quantity (``64Gi``, ``500M``, ``1073741824``) in bytes; errors name ``flag``."""
    m = _QUANTITY.fullmatch(str(value).strip())
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(flag, f"must be a Kubernetes quantity > 0 such as 64Gi or 500Mi, got {value!r}")
    return int(float(m.group(1)) * _SUFFIX[m.group(2)])


def _cpu(flag: str, value: str) -> str:
    if not _CPU.fullmatch(str(value).strip()) or float(str(value).rstrip("m")) <= 0:
        raise ConfigError(flag, f"must be CPU cores > 0 such as 8, 1.5 or 500m, got {value!r}")
    return str(value).strip()


def _gib(n_bytes: int) -> str:
    return f"{math.ceil(n_bytes / 2**30)}Gi"


def shm_size(args: argparse.Namespace, tp_size: int) -> str:
    if args.shm_size is None:
        return f"{SHM_GIB_PER_RANK * tp_size}Gi"
    quantity_bytes("--shm-size", args.shm_size)
    return args.shm_size


def host_bytes(spec: InstanceSpec) -> int:
    """Host memory LMCache pins for one instance: its chunk allocator and a buffer held in host memory,
    per TP rank (each rank runs its own LMCache engine)."""
    cfg = spec.lmcache_config
    if cfg is None:  # a vLLM connector's: its KV stays in vLLM's own cache
        return 0
    p2p = cfg["extra_config"]["p2p"]
    per_rank = int(float(cfg.get("max_local_cpu_size", 0)) * 2**30)
    if p2p.get("buffer_size") and str(p2p.get("buffer_device", "cpu")) == "cpu":
        per_rank += parse_size_bytes("p2p.buffer_size", p2p["buffer_size"])
    return per_rank * spec.tp_size


def instance_resources(args: argparse.Namespace, spec: InstanceSpec, flag: str) -> dict[str, Any]:
    """requests = limits (CPU limit only with --cpu-limit equal); the GPUs and RDMA device as limits."""
    tp = spec.tp_size
    cpu = _cpu(f"--{flag}-cpu", getattr(args, f"{flag}_cpu")) if getattr(args, f"{flag}_cpu") else \
        str(CPU_PER_RANK[args.device] * tp)
    shm = quantity_bytes("--shm-size", shm_size(args, tp))
    given = getattr(args, f"{flag}_memory")
    if given:
        memory = given
        if quantity_bytes(f"--{flag}-memory", given) <= shm:
            raise ConfigError(f"--{flag}-memory", f"{given} leaves nothing beside /dev/shm ({shm_size(args, tp)}, "
                                                  "which counts against the pod's memory): raise it or lower --shm-size")
    else:
        memory = _gib(MEMORY_GIB_PER_RANK[args.device] * tp * 2**30 + host_bytes(spec) + shm)
    limits: dict[str, Any] = {"cpu": cpu, "memory": memory} if args.cpu_limit == "equal" else {"memory": memory}
    if args.device == "cuda":
        limits[args.gpu_resource] = tp  # one GPU per TP rank
    if args.rdma:
        limits[args.rdma_resource] = 1
    return {"requests": {"cpu": cpu, "memory": memory}, "limits": limits}


def registrar_resources(args: argparse.Namespace) -> dict[str, Any]:
    """The registration sidecar of a vLLM connector's instance pod: a small Python loop (fixed, not a value)."""
    return _fixed(args, REGISTRAR_CPU, REGISTRAR_MEMORY)


def lmcache_server_resources(args: argparse.Namespace) -> dict[str, Any]:
    """The LMCache server container of an LMCache MP instance pod: its L1 in host memory and what it runs beside
    it (fixed by the plan, not a value: --lmcache-l1-size is rendered into its command)."""
    l1 = parse_size_bytes("--lmcache-l1-size", args.lmcache_l1_size)
    return _fixed(args, LMCACHE_SERVER_CPU, _gib(l1 + LMCACHE_SERVER_MEMORY_GIB * 2**30))


def proxy_resources(args: argparse.Namespace) -> dict[str, Any]:
    cpu = _cpu("--proxy-cpu", args.proxy_cpu) if args.proxy_cpu else str(args.proxy_workers + 1)
    if args.proxy_memory:
        quantity_bytes("--proxy-memory", args.proxy_memory)
        memory = args.proxy_memory
    else:
        workers = args.proxy_workers if args.proxy_workers > 1 else 0  # one process loads no tokenizer
        memory = f"{PROXY_MEMORY_GIB + PROXY_WORKER_MEMORY_GIB * workers}Gi"
    return _fixed(args, cpu, memory)


def _fixed(args: argparse.Namespace, cpu: str, memory: str) -> dict[str, Any]:
    """requests = limits; the CPU limit only with --cpu-limit equal."""
    limits = {"cpu": cpu, "memory": memory} if args.cpu_limit == "equal" else {"memory": memory}
    return {"requests": {"cpu": cpu, "memory": memory}, "limits": limits}


def node_selector(flag: str, items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(flag, f"expects KEY=VALUE (a node label), got {item!r}")
        out[key.strip()] = value.strip()
    return out


def toleration(flag: str, spec: str) -> dict[str, str]:
    """``KEY[=VALUE][:EFFECT]`` (as ``kubectl taint`` spells a taint) as a toleration."""
    rest, _, effect = spec.rpartition(":") if ":" in spec else (spec, "", "")
    key, sep, value = rest.partition("=")
    if not key.strip() or (effect and effect not in EFFECTS):
        raise ConfigError(flag, f"expects KEY[=VALUE][:EFFECT] with EFFECT one of {', '.join(EFFECTS)}, got {spec!r}")
    out = {"key": key.strip(), "operator": "Equal" if sep else "Exists"}
    if sep:
        out["value"] = value.strip()
    if effect:
        out["effect"] = effect
    return out


def _affinity(args: argparse.Namespace) -> dict[str, Any]:
    if args.affinity is None:
        return {}
    try:
        loaded = yaml.safe_load(Path(args.affinity).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError("--affinity", f"cannot read {args.affinity}: {exc}") from exc
    loaded = loaded.get("affinity", loaded) if isinstance(loaded, dict) else loaded
    known = {"nodeAffinity", "podAffinity", "podAntiAffinity"}
    if not isinstance(loaded, dict) or not set(loaded) <= known:
        raise ConfigError("--affinity", f"{args.affinity} must hold a pod affinity: a mapping of {sorted(known)}")
    return loaded


def decoder_spread(args: argparse.Namespace, labels: dict[str, str], base: dict[str, Any]) -> dict[str, Any]:
    """Decoders on different nodes: one node lost takes one decoder's buffer and streams, not several."""
    term = {"labelSelector": {"matchLabels": labels}, "topologyKey": "kubernetes.io/hostname"}
    anti = dict(base.get("podAntiAffinity", {}))
    if args.decoder_spread == "required":
        key, item = "requiredDuringSchedulingIgnoredDuringExecution", term
    else:
        key, item = "preferredDuringSchedulingIgnoredDuringExecution", {"weight": 100, "podAffinityTerm": term}
    anti[key] = [*anti.get(key, []), item]
    return {**base, "podAntiAffinity": anti}


def spread_constraints(args: argparse.Namespace, labels: dict[str, str]) -> list[dict[str, Any]]:
    out = []
    for item in args.topology_spread:
        key, _, mode = item.partition(":")
        if not key.strip() or mode not in ("", "DoNotSchedule", "ScheduleAnyway"):
            raise ConfigError("--topology-spread", f"expects KEY[:DoNotSchedule], got {item!r}")
        out.append({"maxSkew": 1, "topologyKey": key.strip(), "whenUnsatisfiable": mode or "ScheduleAnyway",
                    "labelSelector": {"matchLabels": labels}})
    return out


def values_from_args(args: argparse.Namespace, specs: dict[str, InstanceSpec],
                     labels: dict[str, dict[str, str]]) -> Values:
    """The values the flags give (``labels``: each component's pod labels, for spread and anti-affinity)."""
    if args.run_as_user < 1:
        raise ConfigError("--run-as-user", f"must be a non-root UID (>= 1), got {args.run_as_user}")
    quantity_bytes("--scratch-size", args.scratch_size)
    nodes = node_selector("--node-selector", args.node_selector)
    tolerations = [toleration("--toleration", t) for t in args.toleration]
    affinity = _affinity(args)
    roles = {}
    for role, flag, replicas in (("prefiller", "prefill", args.prefill), ("decoder", "decode", args.decode)):
        roles[role] = RoleValues(
            resources=instance_resources(args, specs[role], flag), node_selector=nodes, tolerations=tolerations,
            affinity=decoder_spread(args, labels[role], affinity) if role == "decoder" else affinity,
            topology_spread_constraints=spread_constraints(args, labels[role]),
            priority_class_name=args.priority_class, runtime_class_name=args.runtime_class, replicas=replicas)
    proxy = PodValues(resources=proxy_resources(args),
                      node_selector=node_selector("--proxy-node-selector", args.proxy_node_selector),
                      tolerations=[toleration("--proxy-toleration", t) for t in args.proxy_toleration],
                      topology_spread_constraints=[], priority_class_name=args.priority_class)
    image = ImageValues(ref=args.image, pull_policy=args.image_pull_policy,
                        pull_secrets=[{"name": n} for n in args.image_pull_secret])
    return Values(image=image, prefill=roles["prefiller"], decode=roles["decoder"], proxy=proxy,
                  shared_secret=args.shared_secret or "", service_monitor=Toggle(args.service_monitor),
                  network_policy=Toggle(args.network_policy))
