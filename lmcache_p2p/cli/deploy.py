"""``lmcache-p2p deploy kubernetes``: print the Kubernetes objects of an XpYd deployment (``deploy helm``: the
same objects as a Helm chart).

    lmcache-p2p deploy kubernetes --prefill 2 --decode 2 --model /models/Llama-3.1-8B --model-pvc models \\
        --device cuda --image registry.example/lmcache-p2p:0.1.0 --namespace serving > pd.yaml
    kubectl -n serving create secret generic lmcache-p2p-secret --from-literal=shared-secret="$(openssl rand -hex 32)"
    kubectl apply -f pd.yaml

The same flags as ``launch`` make the same instances (one code path: cli/instance.py): a prefiller
and a decoder StatefulSet (one pod per instance, a GPU per TP rank), the proxy's Deployment and
Service (HTTP and registry ports), each role's LMCache YAML as a ConfigMap named by its content,
disruption budgets, NetworkPolicies and, with --shared-secret or $LMCACHE_P2P_SECRET, the secret as
a Secret (otherwise create it as above: it is always required, the pods listen beyond loopback).
Resources, scheduling and the image's user are the flags below; the image is deploy/docker/Dockerfile's.
--prefill/--decode are the replicas (instances join and leave through the proxy's registry).
--connector nixl (or nixl-push): plain vLLM pods running vLLM's own NIXL connector, no LMCache, each
registered with the proxy by a sidecar (lmcache-p2p register) and drained by the id it registered.
--connector nixl-lmcache-mp (or nixl-push-lmcache-mp), vLLM-CPU only: the same, with LMCache's multi-process
recipe: each pod also runs its LMCache server (--lmcache-l1-size, --lmcache-server-port) on 127.0.0.1 in a
container of its own, and vLLM starts once the server answers.
See docs/KUBERNETES.md.
"""

from __future__ import annotations

import argparse
import math
import re
import shlex
import sys
from pathlib import Path

from lmcache_p2p.cli import connectors, kube_lmcache, kube_policy, kube_values, kube_yaml, launch
from lmcache_p2p.errors import ConfigError, GpuPlanError

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
HELM_DESCRIPTION = """Write the Helm chart of an XpYd deployment: the objects `deploy kubernetes` prints for the same flags,
with the image, replicas, resources, scheduling, the shared secret, the ServiceMonitor and the
NetworkPolicies as values (values.yaml holds what the flags gave). The instances themselves (model,
TP, ports, buffers, transport, connector) are fixed in the templates: write the chart again to change them.

    lmcache-p2p deploy helm --out charts/pd --prefill 2 --decode 2 --device cuda --model /models/m
    helm install pd charts/pd --namespace serving --set decode.replicas=4
"""
DEFAULT_UCX_PORTS = "7500-7599"
PORT_FLAGS = ("proxy_port", "proxy_control_port", "prefill_port", "decode_port", "kv_port")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("deploy", help="render a deployment for a cluster (kubernetes)")
    targets = p.add_subparsers(dest="target", required=True)
    k = targets.add_parser("kubernetes", help="print the Kubernetes objects (YAML) of an XpYd deployment",
                           description=__doc__.replace("``", ""), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_kubernetes_args(k)
    k.set_defaults(func=run)
    h = targets.add_parser("helm", help="write a Helm chart of an XpYd deployment (the objects of `deploy kubernetes`)",
                           description=HELM_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    h.add_argument("--out", type=Path, required=True, help="the chart's folder (written anew)")
    add_kubernetes_args(h)
    h.set_defaults(func=run_helm)
    return p


def add_kubernetes_args(k: argparse.ArgumentParser) -> None:
    launch.add_plan_args(k, local=False)
    _add_kubernetes_args(k.add_argument_group("Kubernetes"))
    _add_rdma_args(k.add_argument_group("UCX and RDMA (InfiniBand / RoCE; see docs/MULTINODE.md)"))
    kube_values.add_arguments(k)


def _add_kubernetes_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--image", default=kube_values.DEFAULT_IMAGE,
                   help="container image with vLLM, LMCache and lmcache_p2p installed; deploy/docker/Dockerfile "
                        "builds it (default %(default)s)")
    g.add_argument("--python", default="python3", help="the image's Python (default %(default)s)")
    g.add_argument("--name", default="lmcache-p2p", help="prefix of every object's name (default %(default)s)")
    g.add_argument("--namespace", default=None, help="metadata.namespace of every object (default: kubectl's)")
    g.add_argument("--model-pvc", default=None, metavar="CLAIM",
                   help="a PersistentVolumeClaim mounted read-only at /models in every pod (then --model "
                        "/models/...); without it the model folder must be in the image")
    g.add_argument("--gpu-memory-gib", type=float, default=80.0,
                   help="--device cuda: memory of one GPU of the nodes, for each instance's "
                        "--gpu-memory-utilization (the launcher asks nvidia-smi) (default %(default)s)")
    g.add_argument("--gpu-resource", default="nvidia.com/gpu",
                   help="the device plugin's GPU resource; a pod asks for one per TP rank (default %(default)s)")
    g.add_argument("--decoder-spread", choices=["preferred", "required"], default="preferred",
                   help="anti-affinity between decoders (kubernetes.io/hostname): preferred (default) or "
                        "required (a node never runs two decoders; more decoders than nodes stay Pending)")
    g.add_argument("--drain-timeout-s", type=float, default=120.0,
                   help="a stopping instance's preStop hook drains it through the proxy for at most this long; "
                        "the pod's grace period is 30 s more (default %(default)s)")
    g.add_argument("--bind-all", action="store_true",
                   help="listen on 0.0.0.0 instead of the pod IP (still advertising the pod IP): for "
                        "kubectl port-forward or a sidecar on localhost; the secret stays required")


def _add_rdma_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--rdma", action="store_true",
                   help="NIXL over RDMA: UCX_TLS with rc,ud (and cuda_copy, cuda_ipc on GPUs), an RDMA device "
                        "from --rdma-resource and the IPC_LOCK capability per instance pod")
    g.add_argument("--rdma-resource", default="rdma/rdma_shared_device_a",
                   help="the RDMA device plugin's resource, one per instance pod (default %(default)s)")
    g.add_argument("--ucx-net-devices", default="all",
                   help="UCX_NET_DEVICES in the instance pods, e.g. mlx5_0:1 or eth0 (default %(default)s: UCX "
                        "picks; the launcher's loopback-only default does not apply in a pod)")
    g.add_argument("--ucx-port-range", default=DEFAULT_UCX_PORTS, metavar="LOW-HIGH",
                   help="UCX_TCP_PORT_RANGE of the instance pods: UCX's TCP listeners take ports from it, and the "
                        "NetworkPolicies open it between prefillers and decoders (default %(default)s)")


def check_args(args: argparse.Namespace) -> None:
    """Refuse what cannot make a working deployment, naming the flag."""
    if args.model is None:
        raise ConfigError("--model", "required: the model folder as the pods see it (in the image or "
                                     "under /models with --model-pvc)")
    for flag, value in (("--prefill", args.prefill), ("--decode", args.decode)):
        if value < 0:
            raise ConfigError(flag, f"must be >= 0 instances, got {value}")
    if args.prefill + args.decode == 0:
        raise ConfigError("--decode", "--prefill 0 and --decode 0: nothing would serve")
    if args.proxy_workers < 1:
        raise ConfigError("--proxy-workers", f"must be at least 1, got {args.proxy_workers}")
    for name in PORT_FLAGS:
        value = getattr(args, name)
        if not 1 <= value <= 65535:
            raise ConfigError("--" + name.replace("_", "-"), f"must be a TCP port (1-65535), got {value}")
    for flag, value in (("--name", args.name), ("--namespace", args.namespace)):
        if value is not None and (len(value) > 40 or not _DNS_LABEL.fullmatch(value)):
            raise ConfigError(flag, f"must be a DNS label of at most 40 characters (lower-case letters, digits, "
                                    f"'-'), got {value!r}")
    if not (math.isfinite(args.gpu_memory_gib) and args.gpu_memory_gib > 0):
        raise ConfigError("--gpu-memory-gib", f"must be > 0, got {args.gpu_memory_gib}")
    if not (math.isfinite(args.drain_timeout_s) and args.drain_timeout_s > 0):
        raise ConfigError("--drain-timeout-s", f"must be > 0, got {args.drain_timeout_s}")
    if not args.image.strip():
        raise ConfigError("--image", "must name a container image")
    connectors.check_flags(args)
    kube_lmcache.check_args(args)
    kube_policy.check_port_range(args, [use.port for use in launch.planned_ports(args)])


def render_text(args: argparse.Namespace) -> str:
    """The YAML stream ``deploy kubernetes`` prints (objects from kubernetes.render)."""
    from lmcache_p2p.cli import kubernetes

    check_args(args)
    objects = kubernetes.render(args)
    header = (f"# Rendered by: {command_line(args)}\n"
              "# From launch's plan. Change it with the flags (or use the Helm chart's values, docs/KUBERNETES.md);\n"
              "# --prefill/--decode are the replicas: the next apply of this file undoes a `kubectl scale`.\n")
    return header + kube_yaml.dump_all(objects)


def command_line(args: argparse.Namespace) -> str:
    """The command as given, for the file it rendered (the secret's value hidden)."""
    return shlex.join(["lmcache-p2p", *_redacted(getattr(args, "argv", []))])


def _redacted(argv: list[str]) -> list[str]:
    """The command line without the secret's value (it goes into the Secret, never into a comment)."""
    out, hide = [], False
    for arg in argv:
        if hide:
            out.append("***")
        elif arg.startswith("--shared-secret="):
            out.append("--shared-secret=***")
        else:
            out.append(arg)
        hide = arg == "--shared-secret"
    return out


def run(args: argparse.Namespace) -> int:
    try:
        text = render_text(args)
    except (ConfigError, GpuPlanError) as exc:
        print(f"lmcache-p2p deploy kubernetes: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    if not args.shared_secret:
        name = f"{args.name}-secret"
        print(f"# the pods need the Secret {name}: kubectl create secret generic {name} "
              f"--from-literal=shared-secret=\"$(openssl rand -hex 32)\"", file=sys.stderr)
    return 0


def run_helm(args: argparse.Namespace) -> int:
    from lmcache_p2p.cli import helm_chart

    try:
        check_args(args)
        written = helm_chart.write_chart(args, args.out, command_line(args))
    except (ConfigError, GpuPlanError) as exc:
        print(f"lmcache-p2p deploy helm: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(written)} files of the chart into {args.out}", file=sys.stderr)
    return 0
