"""The heads every Kubernetes object of a deployment shares: names, labels, namespace, and the
checkov checks an object does not meet, each annotated with why (checkov reports them skipped).

``Deployment`` is what every object is made from (kubernetes.py makes the workloads,
kube_policy.py who may reach them and how they may be disrupted).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from lmcache_p2p.cli.instance import InstanceSpec
from lmcache_p2p.cli.kube_values import Values
from lmcache_p2p.cli.layout import LMCACHE_SERVER_PORTS, Instance, decoder_instance, instance_ports
from lmcache_p2p.cli.tensor_parallel import tp_sizes

# Checks a deployment cannot meet as rendered, and why.
SKIP_NAMESPACE = ("CKV_K8S_21", "the namespace is kubectl's (kubectl apply -n); --namespace writes it")
SKIP_DIGEST = ("CKV_K8S_43", "the image is pinned by its tag (--image); pass --image REPO@sha256:DIGEST to pin it")
SKIP_SECRET_ENV = ("CKV_K8S_35", "LMCache's config reads the secret as ${LMCACHE_P2P_SECRET} and the proxy as "
                                 "$LMCACHE_P2P_SECRET: both from the environment, never from a file")
SKIP_SECRET_ENV_REGISTRAR = ("CKV_K8S_35", "the proxy, the registration sidecar and the preStop drain read the "
                                           "secret as $LMCACHE_P2P_SECRET from the environment, never from a file")
SKIP_CPU_LIMIT = ("CKV_K8S_11", "--cpu-limit none: no CPU limit, so vLLM is never throttled")
_IPC_LOCK = "--rdma: UCX registers (pins) the buffers it reads and writes, which takes IPC_LOCK"
SKIP_IPC_LOCK = [("CKV_K8S_25", _IPC_LOCK), ("CKV_K8S_37", _IPC_LOCK)]
SKIP_PULL_POLICY = ("CKV_K8S_15", "--image-pull-policy is not Always: the node's copy of the pinned image serves")


@dataclasses.dataclass(frozen=True)
class Names:
    """What every object of one deployment is called (``configs``: each role's ConfigMap)."""

    base: str  # --name
    configs: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def secret(self) -> str:
        return f"{self.base}-secret"

    @property
    def proxy(self) -> str:
        return f"{self.base}-proxy"

    def role(self, role: str) -> str:
        return f"{self.base}-{role}"


@dataclasses.dataclass(frozen=True)
class Part:
    """One object and where the chart keeps it: its template file and the value it is rendered under."""

    obj: dict[str, Any]
    file: str
    when: str | None = None  # a values path (camelCase): the object exists only when that value is set


@dataclasses.dataclass(frozen=True)
class Deployment:
    """What every object is made from: the flags, the names, each role's instance and the values."""

    args: argparse.Namespace
    names: Names
    specs: dict[str, InstanceSpec]
    values: Values
    namespace: str | None  # metadata.namespace (None: kubectl's)


def pod_instances(args: argparse.Namespace) -> dict[str, Instance]:
    """The instance every pod of a role runs: the plan's first of that role. A pod is alone at its address, so it
    is first in its own launch order too: a vLLM connector's handshake port is --kv-port in every pod (an LMCache MP
    server's --lmcache-server-port), and a change of --prefill leaves the decoders' pods as they are."""
    return {"prefiller": Instance("prefiller", 0, args.prefill_port, tp_size=tp_sizes(args).prefill, slot=0),
            "decoder": dataclasses.replace(decoder_instance(args, 0), slot=0)}


def container_ports(spec: InstanceSpec, args: argparse.Namespace, server: bool = False) -> list[dict[str, Any]]:
    """The instance's ports (layout.instance_ports) by their names: http, kv-R (control, rank R), nccl-R (store),
    side-channel (a vLLM connector's NIXL handshake); ``server``: instead its LMCache MP server's, lmcache and
    lmcache-http (on loopback: in no Service and no NetworkPolicy)."""
    return [{"name": use.name, "containerPort": use.port} for use in instance_ports(spec.instance, args)
            if (use.name in LMCACHE_SERVER_PORTS) == server]


def labels_of(name: str, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "lmcache-p2p", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/component": component}


def meta(d: Deployment, api: str, kind: str, name: str, component: str, workload: bool = False) -> dict[str, Any]:
    """An object's head: name, labels, namespace, and the checkov checks it does not meet, each with why."""
    metadata: dict[str, Any] = {"name": name, "labels": labels_of(d.args.name, component)}
    if d.namespace:
        metadata["namespace"] = d.namespace
    annotations = checkov_skips(d, workload, component)
    if annotations:
        metadata["annotations"] = annotations
    return {"apiVersion": api, "kind": kind, "metadata": metadata}


def checkov_skips(d: Deployment, workload: bool, component: str) -> dict[str, str]:
    """``checkov.io/skipN`` annotations: the checks this object does not meet, each with its reason."""
    skips = [] if d.namespace else [SKIP_NAMESPACE]
    if workload:
        lmcache = all(spec.lmcache_config is not None for spec in d.specs.values())
        skips += [SKIP_DIGEST, SKIP_SECRET_ENV if lmcache else SKIP_SECRET_ENV_REGISTRAR]
        if d.args.cpu_limit == "none":
            skips.append(SKIP_CPU_LIMIT)
        if d.args.rdma and component != "proxy":
            skips += SKIP_IPC_LOCK
        if d.values.image.pull_policy != "Always":
            skips.append(SKIP_PULL_POLICY)
    # checkov takes every key holding "checkov.io/skip" and splits its value at "=": one "=" only
    return {f"checkov.io/skip-{check}": f"{check}={why}" for check, why in skips}
