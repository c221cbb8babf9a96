"""The LMCache server in a pod of LMCache's multi-process PD recipe (``deploy --connector nixl-lmcache-mp`` or
``nixl-push-lmcache-mp``), and the order between it and the pod's vLLM.

As with ``launch`` (cli/lmcache_servers.py), the server runs the recipe's command (``connectors.lmcache_server_argv``)
where the plan puts it (``layout.lmcache_server``: 127.0.0.1, --lmcache-server-port and the next port), and the
instance's vLLM gets the recipe's MultiConnector dialing it (``instance.transfer_config``). In a pod the server is
a second container: the pod's containers share its network namespace, so vLLM reaches it on loopback and nothing
outside the pod does (no Service port, no NetworkPolicy rule; it has no share of our secret), and they share the
pod's /dev/shm volume as the launcher's processes share the host's.

Why a plain container, ordered by a wait, and not a native sidecar (an init container with ``restartPolicy:
Always``, which the kubelet starts before vLLM and stops after it): our objects validate against Kubernetes 1.27,
whose pod spec has no such field, and the rest of our pods use plain containers. So the order is explicit:
- start: vLLM's container runs vLLM's command behind ``cli/http_wait.py``, which execs it once the server's
  ``/healthcheck`` answers 200 (LMCache's HTTP API answers only once its request server and engine are up) and
  exits 1 after --startup-timeout-s, naming it (the kubelet then restarts the container, which waits again);
- stop: the server's preStop waits until vLLM no longer answers ``/health`` (at most the pod's grace period), so
  the server outlives vLLM's drain instead of taking SIGTERM while vLLM still serves from it;
- probes: ``exec`` of the same wait, one attempt: the server listens on loopback, and the kubelet dials a probe's
  ``httpGet`` or ``tcpSocket`` at the pod's IP. A server the liveness probe restarts alone leaves vLLM serving
  without it meanwhile: LMCache's connector enters its degraded mode when the server stops answering its
  heartbeat, and registers vLLM's KV cache again once it answers (lmcache 0.5.6, ``HeartbeatThread``).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from lmcache_p2p.cli import connectors, kube_policy
from lmcache_p2p.cli.instance import InstanceSpec
from lmcache_p2p.cli.kube_meta import container_ports, pod_instances
from lmcache_p2p.cli.kube_values import lmcache_server_resources
from lmcache_p2p.cli.layout import LMCACHE_SERVER_PORTS, instance_ports, lmcache_server
from lmcache_p2p.config import parse_size_bytes
from lmcache_p2p.errors import ConfigError

CONTAINER = "lmcache-server"
WAIT_MODULE = "lmcache_p2p.cli.http_wait"
PROBE_PERIOD_S = 10
PROBE_TIMEOUT_S = 5  # a probe starts Python: more than the wait's own attempt limit (http_wait.ATTEMPT_TIMEOUT_S)


def vllm_command(args: argparse.Namespace, spec: InstanceSpec) -> list[str]:
    """The instance's command: with LMCache MP behind a wait for its server (module docstring); else as it is."""
    server = lmcache_server(spec.instance, args)
    if server is None:
        return spec.argv
    return [args.python, "-m", WAIT_MODULE, "--url", server.health_url, "--timeout-s", f"{args.startup_timeout_s:g}",
            "--what", "the pod's LMCache server", "--timeout-flag=--startup-timeout-s", "--", *spec.argv]


def startup_allowance_s(args: argparse.Namespace, spec: InstanceSpec) -> float:
    """How long vLLM's container may take until it answers: with LMCache MP the wait for its server too (each may
    take --startup-timeout-s, as each start-up wave of the launcher may)."""
    waves = 2 if lmcache_server(spec.instance, args) is not None else 1
    return args.startup_timeout_s * waves


def server_container(args: argparse.Namespace, spec: InstanceSpec, base: dict[str, Any],
                     grace_period_s: int) -> dict[str, Any] | None:
    """The pod's LMCache server (None without LMCache MP). ``base``: the image, pull policy, environment and
    scratch mounts every container of the pod has; ``grace_period_s``: the pod's, which bounds its preStop."""
    inst = spec.instance
    server = lmcache_server(inst, args)
    if server is None:
        return None
    l1_bytes = parse_size_bytes("--lmcache-l1-size", args.lmcache_l1_size)
    command = connectors.lmcache_server_argv(server, "$(POD_NAME)", l1_bytes, python=args.python)
    env = [{"name": k, "value": v} for k, v in connectors.lmcache_server_env(None, base={}).items()]
    check = [args.python, "-m", WAIT_MODULE, "--url", server.health_url, "--timeout-s", "0",
             "--what", "this pod's LMCache server"]
    # vLLM binds the pod's IP (or every interface with --bind-all): the pod's IP reaches it either way
    vllm_gone = (f'exec {args.python} -m {WAIT_MODULE} --url "http://$POD_IP:{inst.http_port}/health" --until down '
                 f'--timeout-s {grace_period_s} --what "this pod\'s vLLM" --timeout-flag=--drain-timeout-s')
    return {
        "name": CONTAINER, **{k: base[k] for k in ("image", "imagePullPolicy")}, "command": command,
        "env": base["env"] + env,
        "ports": container_ports(spec, args, server=True),
        "resources": lmcache_server_resources(args),
        **_probes(check, args.startup_timeout_s),
        "lifecycle": {"preStop": {"exec": {"command": ["sh", "-c", vllm_gone]}}},
        "securityContext": kube_policy.container_security(args, capabilities=()),
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, *base["volumeMounts"]],
    }


def _probes(check: list[str], startup_s: float) -> dict[str, Any]:
    """Ready and live while ``/healthcheck`` answers 200; its start (importing torch and LMCache) may take
    ``startup_s``."""
    probe = {"exec": {"command": check}, "timeoutSeconds": PROBE_TIMEOUT_S}
    return {"startupProbe": {**probe, "periodSeconds": 5, "failureThreshold": max(1, math.ceil(startup_s / 5))},
            "readinessProbe": {**probe, "periodSeconds": PROBE_PERIOD_S, "failureThreshold": 2},
            "livenessProbe": {**probe, "periodSeconds": PROBE_PERIOD_S, "failureThreshold": 6}}


def check_args(args: argparse.Namespace) -> None:
    """Refuse what a pod of LMCache MP cannot run, naming the flag."""
    connector = connectors.connector_of(args)
    if not connector.lmcache_mp:
        return
    if args.device == "cuda":
        raise ConfigError("--device", (
            f"cuda with --connector {connector.value}: on a GPU the LMCache server opens vLLM's KV cache through "
            "CUDA IPC, so it needs the instance's GPU, and a device plugin gives a GPU to one container of a pod "
            "only (the server's container would have none, or another one). Deploy it on vLLM-CPU (--device cpu), "
            "run it on GPUs with launch, or use --connector nixl / nixl-push (no LMCache server)"))
    if not 1 <= args.lmcache_server_port <= 65534:
        raise ConfigError("--lmcache-server-port", f"must be a TCP port (1-65534: the next one is the server's HTTP "
                                                   f"port), got {args.lmcache_server_port}")
    for role, inst in pod_instances(args).items():
        uses = instance_ports(inst, args)
        server = [u for u in uses if u.name in LMCACHE_SERVER_PORTS]
        clash = next((u for u in uses if u not in server and u.port in {s.port for s in server}), None)
        if clash is not None:
            raise ConfigError("--lmcache-server-port", f"{clash.port} is also the {role} pod's {clash.purpose}: "
                                                       "the server takes --lmcache-server-port and the next port")
