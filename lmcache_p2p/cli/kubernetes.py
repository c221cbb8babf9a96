"""The Kubernetes objects of an XpYd deployment, made from the launcher's plan (see deploy.py).

Every pod of a role runs the instance the plan makes first for that role (``prefiller-0``,
``decoder-0``: the same command, environment and LMCache config, built by ``instance.instance_spec``).
Pods have an address each, so every pod of a role uses that instance's ports; what differs
between them (address, name) comes from the downward API: ``$(POD_IP)`` in the command,
``${POD_IP}`` and ``${POD_NAME}`` in the LMCache YAML, the secret from a Secret as
``$LMCACHE_P2P_SECRET``. What a cluster sets (image, replicas, resources, scheduling) comes from
kube_values.Values, so that the Helm chart (helm_chart.py) is these objects with those values as
references. Objects are plain dicts, in the order ``kubectl apply`` should see them.

Each role reads its own ConfigMap, named after its content and immutable: a changed config is a
new ConfigMap and a changed pod template of that role only, so a rollout never mixes versions and
an instance's change never restarts the proxy.

With a vLLM connector (``--connector nixl``: connectors.py says what differs) a pod runs plain vLLM, whose
ConfigMap holds vLLM's logging config only, and beside it a registration sidecar (``registrar_container``):
such an instance cannot announce itself, so the sidecar registers it with the proxy by its pod's URL. With
LMCache's multi-process recipe (``--connector nixl-lmcache-mp``) the pod also runs the instance's LMCache server,
and vLLM starts once it answers (kube_lmcache.py).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import yaml

from lmcache_p2p.cli import connectors, kube_lmcache, kube_policy
from lmcache_p2p.cli.instance import (
    SECRET_ENV, GpuAssignment, InstanceSpec, Site, instance_spec, instance_utilization, proxy_command,
)
from lmcache_p2p.cli.kube_values import (
    PROXY_SCRATCH_SIZE, PodValues, registrar_resources, shm_size, values_from_args,
)
from lmcache_p2p.cli.kube_yaml import config_hash
from lmcache_p2p.cli.kube_meta import Deployment, Names, Part, container_ports, labels_of, meta, pod_instances
from lmcache_p2p.cli.vllm_env import logging_config_text

CONFIG_DIR = "/etc/lmcache-p2p"
MODEL_DIR = "/models"
HOME_DIR = "/home/lmcache"  # the Dockerfile's HOME; an emptyDir here holds ~/.cache, ~/.triton, ~/.config
SECRET_KEY = "shared-secret"
PROBE_PERIOD_S = 10
ROLES = ("prefiller", "decoder")
# The addresses a pod is told only once it runs (what the LMCache YAML is checked with when rendered).
SAMPLE_POD_ENV = {"POD_IP": "10.0.0.1", "POD_NAME": "decoder-0", SECRET_ENV: "sample"}
POD_IP_REFS = ("$(POD_IP)", "${POD_IP}")  # the pod's address as a Site spells it (kubelet's, P2PConfig's)
REGISTRAR_ALIVE_FILE = "/tmp/lmcache-p2p-registrar-alive"


def pod_site(args: argparse.Namespace, names: Names) -> Site:
    """A pod's instance: binds its pod IP (or every interface, --bind-all), advertises its pod IP, is named
    after its pod, finds the registry through the proxy's Service, reads the secret from its environment."""
    bind_all = getattr(args, "bind_all", False)
    env = {"UCX_NET_DEVICES": args.ucx_net_devices}
    if args.rdma:
        env["UCX_TLS"] = ("rc,ud,cuda_copy,cuda_ipc,tcp,self" if args.device == "cuda" else "rc,ud,sm,tcp,self")
    if args.transport == "nixl":  # UCX's TCP listeners on known ports, which the NetworkPolicy names
        env["UCX_TCP_PORT_RANGE"] = args.ucx_port_range
    return Site(bind_host="0.0.0.0" if bind_all else "$(POD_IP)", config_host="0.0.0.0" if bind_all else "${POD_IP}",
                advertise_host="${POD_IP}" if bind_all else None, instance_id="${POD_NAME}",
                proxy_host=names.proxy, shared_secret=f"${{{SECRET_ENV}}}",
                config_file=f"{CONFIG_DIR}/{{role}}.yaml", logging_file=f"{CONFIG_DIR}/logging.json",
                python=args.python, env=env, sample_env=SAMPLE_POD_ENV)


def role_specs(args: argparse.Namespace, site: Site) -> dict[str, InstanceSpec]:
    """The instance every pod of a role runs (kube_meta.pod_instances), as instance_spec makes it."""
    specs = {}
    for role, inst in pod_instances(args).items():
        gpu = None
        if args.device == "cuda":
            gpu = GpuAssignment((), instance_utilization(inst, args, int(args.gpu_memory_gib * 2**30)))
        specs[role] = instance_spec(inst, args.model, args, site, gpu, base={})
    return specs


def config_data(specs: dict[str, InstanceSpec], role: str) -> dict[str, str]:
    """A role's ConfigMap: its LMCache YAML (none with a vLLM connector) and vLLM's logging config."""
    lmcache = specs[role].lmcache_config
    data = {} if lmcache is None else {f"{role}.yaml": yaml.safe_dump(lmcache, sort_keys=False)}
    return data | {"logging.json": logging_config_text()}


def deployment(args: argparse.Namespace) -> Deployment:
    base = Names(args.name)
    specs = role_specs(args, pod_site(args, base))
    names = Names(args.name, {role: f"{base.role(role)}-{config_hash(config_data(specs, role))}" for role in ROLES})
    labels = {role: labels_of(args.name, role) for role in ROLES}
    return Deployment(args, names, specs, values_from_args(args, specs, labels), args.namespace)


def render(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every object of the deployment, in apply order."""
    d = deployment(args)
    return [p.obj for p in parts(d) if p.when is None or d.values.enabled(p.when)]


def parts(d: Deployment) -> list[Part]:
    """Every object the deployment may have, with the value each optional one is rendered under."""
    args, names, values = d.args, d.names, d.values
    out = [Part(meta(d, "v1", "Secret", names.secret, "secret") | {
        "type": "Opaque", "stringData": {SECRET_KEY: values.shared_secret}}, "secret.yaml", "sharedSecret")]
    for role in ROLES:
        out.append(Part(meta(d, "v1", "ConfigMap", names.configs[role], "config") | {
            "immutable": True, "data": config_data(d.specs, role)}, f"{role}-config.yaml"))
    out += [Part(obj, f"proxy-{obj['kind'].lower()}.yaml") for obj in proxy_objects(d)]
    for role in ROLES:
        out += [Part(obj, f"{role}-{obj['kind'].lower()}.yaml") for obj in role_objects(d, role)]
    out += [Part(obj, f"{obj['metadata']['labels']['app.kubernetes.io/component']}-networkpolicy.yaml",
                 "networkPolicy.enabled") for obj in kube_policy.network_policies(d)]
    out.append(Part(kube_policy.service_monitor(d), "servicemonitor.yaml", "serviceMonitor.enabled"))
    return out


def proxy_objects(d: Deployment) -> list[dict[str, Any]]:
    """The proxy: one pod (one coordinator holds the registry), its relay workers inside it."""
    args, names = d.args, d.names
    ports = [{"name": "http", "containerPort": args.proxy_port},
             {"name": "registry", "containerPort": args.proxy_control_port}]
    site = Site(bind_host="0.0.0.0" if getattr(args, "bind_all", False) else "$(POD_IP)", python=args.python)
    # Instances dial the registry through the Service: its name is what their frames are addressed to.
    command = proxy_command(args, site, tokenizer=str(args.model) if args.proxy_workers > 1 else None,
                            advertise_host=names.proxy)
    container = {
        "name": "proxy", **_image(d), "command": command,
        "env": _pod_env(names),
        "ports": ports,
        "resources": d.values.proxy.resources,
        **_probes(startup_s=60.0),
        "securityContext": kube_policy.container_security(args, capabilities=()),
        "volumeMounts": [*_scratch_mounts(), *_model_mounts(args)],
    }
    volumes = [*_scratch_volumes(PROXY_SCRATCH_SIZE), *_model_volumes(args)]
    labels = labels_of(args.name, "proxy")
    service = meta(d, "v1", "Service", names.proxy, "proxy") | {"spec": {
        "type": "ClusterIP", "selector": labels,
        "ports": [{"name": p["name"], "port": p["containerPort"], "targetPort": p["name"]} for p in ports]}}
    deployment_ = meta(d, "apps/v1", "Deployment", names.proxy, "proxy", workload=True) | {"spec": {
        "replicas": 1, "strategy": {"type": "Recreate"},  # never two coordinators, each with half the registry
        "selector": {"matchLabels": labels},
        "template": {"metadata": {"labels": labels},
                     "spec": pod_spec(d, d.values.proxy, [container], volumes)}}}
    return [service, deployment_]


def role_objects(d: Deployment, role: str) -> list[dict[str, Any]]:
    """A role's headless Service (the StatefulSet's pod names in DNS), its StatefulSet and its disruption budget."""
    args, names, spec = d.args, d.names, d.specs[role]
    labels = labels_of(args.name, role)
    ports = container_ports(spec, args)
    service = meta(d, "v1", "Service", names.role(role), role) | {"spec": {
        "clusterIP": "None", "selector": labels,
        "ports": [{"name": p["name"], "port": p["containerPort"], "targetPort": p["name"]} for p in ports]}}
    shm = {"medium": "Memory", "sizeLimit": shm_size(args, spec.tp_size)}
    volumes = [{"name": "config", "configMap": {"name": names.configs[role]}}, {"name": "dshm", "emptyDir": shm},
               *_scratch_volumes(args.scratch_size), *_model_volumes(args)]
    values = d.values.role(role)
    grace_s = int(args.drain_timeout_s) + 30
    server = kube_lmcache.server_container(args, spec, {
        **_image(d), "env": [e for e in _pod_env(names) if e["name"] != SECRET_ENV],  # it takes no secret
        "volumeMounts": _scratch_mounts()}, grace_s)
    sidecars = [c for c in (server, None if connectors.announces(args) else registrar_container(d, spec)) if c]
    pod = pod_spec(d, values, [instance_container(d, spec, ports), *sidecars], volumes,
                   terminationGracePeriodSeconds=grace_s)
    statefulset = meta(d, "apps/v1", "StatefulSet", names.role(role), role, workload=True) | {"spec": {
        "serviceName": names.role(role), "replicas": values.replicas,
        "podManagementPolicy": "Parallel",  # instances join the registry independently: no start order
        "selector": {"matchLabels": labels},
        "template": {"metadata": {"labels": labels}, "spec": pod}}}
    return [service, statefulset, kube_policy.disruption_budget(d, role, labels)]


def pod_spec(d: Deployment, values: PodValues, containers: list[dict[str, Any]], volumes: list[dict[str, Any]],
             **extra: Any) -> dict[str, Any]:
    """A pod: non-root, RuntimeDefault seccomp, no service-account token, placed as ``values`` says."""
    uid = d.args.run_as_user
    spec: dict[str, Any] = {
        **extra,
        "automountServiceAccountToken": False,  # nothing in the pod talks to the API server
        "enableServiceLinks": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid,
                            "seccompProfile": {"type": "RuntimeDefault"}},
    }
    for key, value in (("priorityClassName", values.priority_class_name),
                       ("runtimeClassName", values.runtime_class_name), ("nodeSelector", values.node_selector),
                       ("tolerations", values.tolerations), ("affinity", values.affinity),
                       ("topologySpreadConstraints", values.topology_spread_constraints),
                       ("imagePullSecrets", d.values.image.pull_secrets)):
        if value:
            spec[key] = value
    return spec | {"containers": containers, "volumes": volumes}


def instance_container(d: Deployment, spec: InstanceSpec, ports: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM (with LMCache MP started once its server answers: kube_lmcache.py); its preStop drains it through the
    proxy, by the id the proxy lists the pod under (its name, or its URL's registration: ``$POD_NAME`` and
    ``$POD_IP`` as the shell fills them in)."""
    args, names, inst = d.args, d.names, spec.instance
    instance_id = connectors.registry_id(args, inst.role, "$POD_NAME", f"http://$POD_IP:{inst.http_port}")
    drain = (f'exec {args.python} -m lmcache_p2p.cli.main drain "{instance_id}" '
             f'--proxy {_proxy_url(d)} --timeout-s {args.drain_timeout_s:g} --missing-ok')
    return {
        "name": "vllm", **_image(d), "command": kube_lmcache.vllm_command(args, spec),
        "env": _pod_env(names) + [_env_var(k, v) for k, v in spec.env.items()],
        "ports": ports,
        "resources": d.values.role(spec.instance.role).resources,
        **_probes(startup_s=kube_lmcache.startup_allowance_s(args, spec)),
        "lifecycle": {"preStop": {"exec": {"command": ["sh", "-c", drain]}}},
        # UCX pins (registers) the buffers it sends from and into
        "securityContext": kube_policy.container_security(args, capabilities=("IPC_LOCK",) if args.rdma else ()),
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                         {"name": "dshm", "mountPath": "/dev/shm"}, *_scratch_mounts(), *_model_mounts(args)],
    }


def registrar_container(d: Deployment, spec: InstanceSpec) -> dict[str, Any]:
    """The sidecar that keeps an instance of a vLLM connector (which cannot announce itself) registered with the
    proxy by its pod's URL, and drains it once the pod stops (cli/register.py). It is a plain container, not an
    init-container sidecar: those stop only after vLLM, and it must stop registering while vLLM's preStop drains."""
    args, inst = d.args, spec.instance
    command = [args.python, "-m", "lmcache_p2p.cli.main", "register", "--proxy", _proxy_url(d), "--role", inst.role,
               "--url", f"http://$(POD_IP):{inst.http_port}", "--alive-file", REGISTRAR_ALIVE_FILE]
    # alive while the time the register loop last wrote (when its next attempt is overdue) has not passed
    alive = {"exec": {"command": ["sh", "-c", f'test "$(date +%s)" -le "$(cat {REGISTRAR_ALIVE_FILE})"']},
             "periodSeconds": PROBE_PERIOD_S, "timeoutSeconds": 5}
    return {
        "name": "registrar", **_image(d), "command": command, "env": _pod_env(d.names),
        "resources": registrar_resources(args), "readinessProbe": alive, "livenessProbe": alive,
        "securityContext": kube_policy.container_security(args, capabilities=()),
        "volumeMounts": _scratch_mounts(),
    }


def _proxy_url(d: Deployment) -> str:
    """The proxy's HTTP port through its Service: the admin calls of the instances' drain and registration."""
    return f"http://{d.names.proxy}:{d.args.proxy_port}"


def _env_var(name: str, value: str) -> dict[str, Any]:
    """An environment variable; one that is the pod's address comes from the downward API (peers dial it)."""
    if value in POD_IP_REFS:
        return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    return {"name": name, "value": value}


def _image(d: Deployment) -> dict[str, Any]:
    return {"image": d.values.image.ref, "imagePullPolicy": d.values.image.pull_policy}


def _pod_env(names: Names) -> list[dict[str, Any]]:
    """What a pod learns when it runs: its address, its name, the secret (never written in the spec)."""
    return [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": SECRET_ENV, "valueFrom": {"secretKeyRef": {"name": names.secret, "key": SECRET_KEY}}},
            {"name": "HOME", "value": HOME_DIR}]


def _probes(startup_s: float) -> dict[str, Any]:
    """/health: the start (loading the model) may take ``startup_s``; then ready and live on /health."""
    get = {"httpGet": {"path": "/health", "port": "http"}}
    return {"startupProbe": {**get, "periodSeconds": PROBE_PERIOD_S,
                             "failureThreshold": max(1, math.ceil(startup_s / PROBE_PERIOD_S))},
            "readinessProbe": {**get, "periodSeconds": 5, "failureThreshold": 2},
            "livenessProbe": {**get, "periodSeconds": PROBE_PERIOD_S, "timeoutSeconds": 5, "failureThreshold": 6}}


def _scratch_volumes(size: str) -> list[dict[str, Any]]:
    """The only writable places of a read-only root filesystem: HOME (caches) and /tmp."""
    return [{"name": "home", "emptyDir": {"sizeLimit": size}}, {"name": "tmp", "emptyDir": {"sizeLimit": size}}]


def _scratch_mounts() -> list[dict[str, Any]]:
    return [{"name": "home", "mountPath": HOME_DIR}, {"name": "tmp", "mountPath": "/tmp"}]


def _model_volumes(args: argparse.Namespace) -> list[dict[str, Any]]:
    if not args.model_pvc:
        return []
    return [{"name": "model", "persistentVolumeClaim": {"claimName": args.model_pvc, "readOnly": True}}]


def _model_mounts(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [{"name": "model", "mountPath": MODEL_DIR, "readOnly": True}] if args.model_pvc else []
