"""What a deployment's pods may do and who may reach them: security contexts, NetworkPolicies,
disruption budgets, the ServiceMonitor, and the checkov checks the objects do not meet (with why).

Ports, peer by peer (every other ingress is refused once a NetworkPolicy selects a pod):
- the proxy's ``http``: anyone (clients; the instances' preStop drain and registration); its ``registry``: the
  instances;
- an instance's ``http``: the proxy (and Prometheus, pods labelled ``app.kubernetes.io/name: prometheus``);
- a decoder's ``kv-R``: the prefillers (allocations) and the proxy (cancellations);
- a vLLM connector's ``side-channel`` (its NIXL handshake): the other role;
- UCX's TCP listeners, on ``--ucx-port-range`` (``UCX_TCP_PORT_RANGE``): prefillers and decoders both
  ways; with ``--transport nccl`` every port between them (NCCL's own sockets take any port).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from lmcache_p2p.cli.kube_meta import Deployment, container_ports, labels_of, meta
from lmcache_p2p.cli.layout import SIDE_CHANNEL
from lmcache_p2p.errors import ConfigError

PROMETHEUS = {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
SCRAPE_INTERVAL = "30s"
def container_security(args: argparse.Namespace, capabilities: Sequence[str]) -> dict[str, Any]:
    """Non-root, no privilege escalation, every capability dropped but ``capabilities``, a read-only root."""
    caps: dict[str, Any] = {"drop": ["ALL"]}
    if capabilities:
        caps["add"] = list(capabilities)
    return {"allowPrivilegeEscalation": False, "privileged": False, "readOnlyRootFilesystem": True,
            "runAsNonRoot": True, "capabilities": caps}


def parse_port_range(value: str) -> tuple[int, int]:
    low, sep, high = str(value).partition("-")
    try:
        first, last = int(low), int(high)
    except ValueError:
        first = last = 0
    if not sep or not 1024 <= first <= last <= 65535:
        raise ConfigError("--ucx-port-range", f"must be LOW-HIGH with 1024 <= LOW <= HIGH <= 65535, got {value!r}")
    return first, last


def check_port_range(args: argparse.Namespace, planned: Sequence[int]) -> None:
    """UCX's range must not hold a port the pods listen on (it would take it first, at random)."""
    first, last = parse_port_range(args.ucx_port_range)
    taken = sorted(p for p in planned if first <= p <= last)
    if taken:
        raise ConfigError("--ucx-port-range", f"{args.ucx_port_range} holds port {taken[0]}, which a pod listens on: "
                                              "move the range or the port flags")


def _peer(d: Deployment, component: str) -> dict[str, Any]:
    return {"podSelector": {"matchLabels": labels_of(d.args.name, component)}}


def _tcp(port: int | str) -> dict[str, Any]:
    return {"protocol": "TCP", "port": port}


def _between_instances(d: Deployment, other: str) -> dict[str, Any]:
    """UCX's listeners (nixl) or, with NCCL, every port: what the other role dials in this one."""
    if d.args.transport == "nccl":
        return {"from": [_peer(d, other)]}
    first, last = parse_port_range(d.args.ucx_port_range)
    return {"from": [_peer(d, other)], "ports": [{"protocol": "TCP", "port": first, "endPort": last}]}


def _dialed_ports(d: Deployment, role: str, other: str) -> list[dict[str, Any]]:
    """A role's own listeners, each open to who dials it: a decoder's ``kv-R`` to the prefillers and the proxy,
    a vLLM connector's ``side-channel`` (its NIXL handshake) to the other role. A rule without ports would
    open every port, so a role without such a listener gets no rule."""
    names = [p["name"] for p in container_ports(d.specs[role], d.args)]
    dialers = [([n for n in names if n.startswith("kv-")], [other, "proxy"]),
               ([n for n in names if n == SIDE_CHANNEL], [other])]
    return [{"from": [_peer(d, c) for c in who], "ports": [_tcp(n) for n in ports]} for ports, who in dialers if ports]


def network_policies(d: Deployment) -> list[dict[str, Any]]:
    """One Ingress policy per component (module docstring); egress is left open (DNS, the registry)."""
    http = {"from": [_peer(d, "proxy"), PROMETHEUS], "ports": [_tcp("http")]}
    rules = {
        "proxy": [{"ports": [_tcp("http")]},
                  {"from": [_peer(d, "prefiller"), _peer(d, "decoder")], "ports": [_tcp("registry")]}],
        "prefiller": [http, *_dialed_ports(d, "prefiller", "decoder"), _between_instances(d, "decoder")],
        "decoder": [http, *_dialed_ports(d, "decoder", "prefiller"), _between_instances(d, "prefiller")],
    }
    names = {"proxy": d.names.proxy, "prefiller": d.names.role("prefiller"), "decoder": d.names.role("decoder")}
    return [meta(d, "networking.k8s.io/v1", "NetworkPolicy", names[c], c) | {"spec": {
        "podSelector": {"matchLabels": labels_of(d.args.name, c)}, "policyTypes": ["Ingress"], "ingress": rules[c]}}
        for c in ("proxy", "prefiller", "decoder")]


def disruption_budget(d: Deployment, role: str, labels: dict[str, str]) -> dict[str, Any]:
    """A node drain takes one instance of a role at a time (each drains its requests in its preStop)."""
    return meta(d, "policy/v1", "PodDisruptionBudget", d.names.role(role), role) | {"spec": {
        "maxUnavailable": 1, "selector": {"matchLabels": labels}}}


def service_monitor(d: Deployment) -> dict[str, Any]:
    """Prometheus Operator: /metrics of every Service of the deployment (the proxy's and each role's pods)."""
    selector = {"app.kubernetes.io/name": "lmcache-p2p", "app.kubernetes.io/instance": d.args.name}
    return meta(d, "monitoring.coreos.com/v1", "ServiceMonitor", d.args.name, "metrics") | {"spec": {
        "selector": {"matchLabels": selector},
        "endpoints": [{"port": "http", "path": "/metrics", "interval": SCRAPE_INTERVAL}]}}
