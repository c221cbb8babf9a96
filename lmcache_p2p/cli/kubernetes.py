"""The Kubernetes objects of an XpYd deployment, made from the launcher's plan (see deploy.py).

Every pod of a role runs the instance the plan makes first for that role (``prefiller-0``,
``decoder-0``: the same command, environment and LMCache config, built by ``instance.instance_spec``).
Pods have an address each, so every pod of a role uses that instance's ports; what differs
between them (address, name) comes from the downward API: ``$(POD_IP)`` in the command,
``${POD_IP}`` and ``${POD_NAME}`` in the LMCache YAML, the secret from a Secret as
``$LMCACHE_P2P_SECRET``. Objects are plain dicts, in the order ``kubectl apply`` should see them.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
from typing import Any

import yaml

from lmcache_p2p.cli.instance import (
    SECRET_ENV, GpuAssignment, InstanceSpec, Site, instance_spec, instance_utilization, proxy_command,
)
from lmcache_p2p.cli.layout import Instance, decoder_instance, instance_ports
from lmcache_p2p.cli.vllm_env import logging_config_text
from lmcache_p2p.cli.tensor_parallel import tp_sizes

CONFIG_DIR = "/etc/lmcache-p2p"
MODEL_DIR = "/models"
SECRET_KEY = "shared-secret"
PROBE_PERIOD_S = 10
# The addresses a pod is told only once it runs (what the LMCache YAML is checked with when rendered).
SAMPLE_POD_ENV = {"POD_IP": "10.0.0.1", "POD_NAME": "decoder-0", SECRET_ENV: "sample"}


@dataclasses.dataclass(frozen=True)
class Names:
    """What every object of one deployment is called."""

    base: str  # --name

    @property
    def config(self) -> str:
        return f"{self.base}-config"

    @property
    def secret(self) -> str:
        return f"{self.base}-secret"

    @property
    def proxy(self) -> str:
        return f"{self.base}-proxy"

    def role(self, role: str) -> str:
        return f"{self.base}-{role}"


def pod_site(args: argparse.Namespace, names: Names) -> Site:
    """A pod's instance: binds its pod IP (or every interface, --bind-all), advertises its pod IP, is named
    after its pod, finds the registry through the proxy's Service, reads the secret from its environment."""
    bind_all = getattr(args, "bind_all", False)
    env = {"UCX_NET_DEVICES": args.ucx_net_devices}
    if args.rdma:
        env["UCX_TLS"] = ("rc,ud,cuda_copy,cuda_ipc,tcp,self" if args.device == "cuda" else "rc,ud,sm,tcp,self")
    return Site(bind_host="0.0.0.0" if bind_all else "$(POD_IP)", config_host="0.0.0.0" if bind_all else "${POD_IP}",
                advertise_host="${POD_IP}" if bind_all else None, instance_id="${POD_NAME}",
                proxy_host=names.proxy, shared_secret=f"${{{SECRET_ENV}}}",
                config_file=f"{CONFIG_DIR}/{{role}}.yaml", logging_file=f"{CONFIG_DIR}/logging.json",
                python=args.python, env=env, sample_env=SAMPLE_POD_ENV)


def role_specs(args: argparse.Namespace, site: Site) -> dict[str, InstanceSpec]:
    """The instance every pod of a role runs: the plan's first of that role."""
    first = {"prefiller": Instance("prefiller", 0, args.prefill_port, tp_size=tp_sizes(args).prefill),
             "decoder": decoder_instance(args, 0)}
    specs = {}
    for role, inst in first.items():
        gpu = None
        if args.device == "cuda":
            gpu = GpuAssignment((), instance_utilization(inst, args, int(args.gpu_memory_gib * 2**30)))
        specs[role] = instance_spec(inst, args.model, args, site, gpu, base={})
    return specs


def render(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every object of the deployment, in apply order."""
    names = Names(args.name)
    site = pod_site(args, names)
    specs = role_specs(args, site)
    config = config_map(args, names, specs)
    checksum = hashlib.sha256(json.dumps(config["data"], sort_keys=True).encode()).hexdigest()
    objects: list[dict[str, Any]] = []
    if args.shared_secret:
        objects.append(_meta("v1", "Secret", names.secret, args, "secret") | {
            "type": "Opaque", "stringData": {SECRET_KEY: args.shared_secret}})
    objects.append(config)
    objects += proxy_objects(args, names, checksum)
    for role, replicas in (("prefiller", args.prefill), ("decoder", args.decode)):
        objects += role_objects(args, names, specs[role], replicas, checksum)
    return objects


def config_map(args: argparse.Namespace, names: Names, specs: dict[str, InstanceSpec]) -> dict[str, Any]:
    data = {f"{role}.yaml": yaml.safe_dump(spec.lmcache_config, sort_keys=False) for role, spec in specs.items()}
    data["logging.json"] = logging_config_text()
    return _meta("v1", "ConfigMap", names.config, args, "config") | {"data": data}


def proxy_objects(args: argparse.Namespace, names: Names, checksum: str) -> list[dict[str, Any]]:
    """The proxy: one pod (one coordinator holds the registry), its relay workers inside it."""
    ports = [{"name": "http", "containerPort": args.proxy_port},
             {"name": "registry", "containerPort": args.proxy_control_port}]
    site = Site(bind_host="0.0.0.0" if getattr(args, "bind_all", False) else "$(POD_IP)", python=args.python)
    # Instances dial the registry through the Service: its name is what their frames are addressed to.
    command = proxy_command(args, site, tokenizer=str(args.model) if args.proxy_workers > 1 else None,
                            advertise_host=names.proxy)
    container = {
        "name": "proxy", "image": args.image, "command": command,
        "env": _pod_env(names),
        "ports": ports,
        "resources": {"requests": {"cpu": str(args.proxy_workers + 1)}},  # a core per relay worker, one to route
        **_probes(args, startup_s=60.0),
        **({"volumeMounts": _model_mounts(args)} if args.model_pvc else {}),
    }
    pod = {"containers": [container], **({"volumes": _model_volumes(args)} if args.model_pvc else {})}
    labels = _labels(args, "proxy")
    service = _meta("v1", "Service", names.proxy, args, "proxy") | {"spec": {
        "type": "ClusterIP", "selector": labels,
        "ports": [{"name": p["name"], "port": p["containerPort"], "targetPort": p["name"]} for p in ports]}}
    deployment = _meta("apps/v1", "Deployment", names.proxy, args, "proxy") | {"spec": {
        "replicas": 1, "strategy": {"type": "Recreate"},  # never two coordinators, each with half the registry
        "selector": {"matchLabels": labels},
        "template": {"metadata": {"labels": labels, "annotations": {"lmcache-p2p/config-sha256": checksum}},
                     "spec": pod}}}
    return [service, deployment]


def role_objects(args: argparse.Namespace, names: Names, spec: InstanceSpec, replicas: int,
                 checksum: str) -> list[dict[str, Any]]:
    """A role's headless Service (the StatefulSet's pod names in DNS) and its StatefulSet."""
    role = spec.instance.role
    labels = _labels(args, role)
    ports = container_ports(spec, args)
    service = _meta("v1", "Service", names.role(role), args, role) | {"spec": {
        "clusterIP": "None", "selector": labels,
        "ports": [{"name": p["name"], "port": p["containerPort"], "targetPort": p["name"]} for p in ports]}}
    pod: dict[str, Any] = {
        "terminationGracePeriodSeconds": int(args.drain_timeout_s) + 30,
        "containers": [instance_container(args, names, spec, ports)],
        "volumes": [{"name": "config", "configMap": {"name": names.config}},
                    {"name": "dshm", "emptyDir": {"medium": "Memory"}}, *_model_volumes(args)],
    }
    if role == "decoder":
        pod["affinity"] = _spread(args, labels)
    statefulset = _meta("apps/v1", "StatefulSet", names.role(role), args, role) | {"spec": {
        "serviceName": names.role(role), "replicas": replicas,
        "podManagementPolicy": "Parallel",  # instances join the registry independently: no start order
        "selector": {"matchLabels": labels},
        "template": {"metadata": {"labels": labels, "annotations": {"lmcache-p2p/config-sha256": checksum}},
                     "spec": pod}}}
    return [service, statefulset]


def instance_container(args: argparse.Namespace, names: Names, spec: InstanceSpec,
                       ports: list[dict[str, Any]]) -> dict[str, Any]:
    limits: dict[str, Any] = {}
    if args.device == "cuda":
        limits[args.gpu_resource] = spec.tp_size  # one GPU per TP rank
    if args.rdma:
        limits[args.rdma_resource] = 1
    drain = (f'exec {args.python} -m lmcache_p2p.cli.main drain "$POD_NAME" '
             f'--proxy http://{names.proxy}:{args.proxy_port} --timeout-s {args.drain_timeout_s:g}')
    container: dict[str, Any] = {
        "name": "vllm", "image": args.image, "command": spec.argv,
        "env": _pod_env(names) + [{"name": k, "value": v} for k, v in spec.env.items()],
        "ports": ports,
        **_probes(args, startup_s=args.startup_timeout_s),
        "lifecycle": {"preStop": {"exec": {"command": ["sh", "-c", drain]}}},
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                         {"name": "dshm", "mountPath": "/dev/shm"}, *_model_mounts(args)],
    }
    if limits:
        container["resources"] = {"limits": limits}
    if args.rdma:  # UCX pins (registers) the buffers it sends from and into
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    return container


def container_ports(spec: InstanceSpec, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The instance's ports (layout.instance_ports), named: http, kv-R (control, rank R), nccl-R (store)."""
    inst = spec.instance
    out = []
    for use in instance_ports(inst, args):
        if use.port == inst.http_port:
            name = "http"
        elif inst.control_port <= use.port < inst.control_port + spec.tp_size:
            name = f"kv-{use.port - inst.control_port}"
        else:
            name = f"nccl-{use.port - inst.transport_port}"
        out.append({"name": name, "containerPort": use.port})
    return out


def _pod_env(names: Names) -> list[dict[str, Any]]:
    """What a pod learns when it runs: its address, its name, the secret (never written in the spec)."""
    return [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": SECRET_ENV, "valueFrom": {"secretKeyRef": {"name": names.secret, "key": SECRET_KEY}}}]


def _probes(args: argparse.Namespace, startup_s: float) -> dict[str, Any]:
    """/health: the start (loading the model) may take ``startup_s``; then ready and live on /health."""
    get = {"httpGet": {"path": "/health", "port": "http"}}
    return {"startupProbe": {**get, "periodSeconds": PROBE_PERIOD_S,
                             "failureThreshold": max(1, math.ceil(startup_s / PROBE_PERIOD_S))},
            "readinessProbe": {**get, "periodSeconds": 5, "failureThreshold": 2},
            "livenessProbe": {**get, "periodSeconds": PROBE_PERIOD_S, "timeoutSeconds": 5, "failureThreshold": 6}}


def _spread(args: argparse.Namespace, labels: dict[str, str]) -> dict[str, Any]:
    """Decoders on different nodes: one node lost takes one decoder's buffer and streams, not several."""
    term = {"labelSelector": {"matchLabels": labels}, "topologyKey": "kubernetes.io/hostname"}
    if args.decoder_spread == "required":
        return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    return {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 100, "podAffinityTerm": term}]}}


def _model_volumes(args: argparse.Namespace) -> list[dict[str, Any]]:
    if not args.model_pvc:
        return []
    return [{"name": "model", "persistentVolumeClaim": {"claimName": args.model_pvc, "readOnly": True}}]


def _model_mounts(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [{"name": "model", "mountPath": MODEL_DIR, "readOnly": True}] if args.model_pvc else []


def _labels(args: argparse.Namespace, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "lmcache-p2p", "app.kubernetes.io/instance": args.name,
            "app.kubernetes.io/component": component}


def _meta(api: str, kind: str, name: str, args: argparse.Namespace, component: str) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "labels": _labels(args, component)}
    if args.namespace:
        metadata["namespace"] = args.namespace
    return {"apiVersion": api, "kind": kind, "metadata": metadata}
