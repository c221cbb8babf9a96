"""XpYd across hosts of a :class:`rig.NetRig`: the proxy, each prefiller and each decoder on a host of
its own, the client (this process, while it sends) on another.

The deployment is the fault suite's (``tests/faults/fault_cluster.FaultCluster``: the launcher's
YAML, flags and environment, kill and restart, the decoders' slots as the proxy sees them), with
what several hosts change:

- every instance's listeners bind its host's address and it announces that address (the
  launcher's instance spec over a ``Site`` per host, as ``deploy kubernetes`` uses one per pod);
  the proxy binds its host's address; instances dial the proxy's registry across the router;
- the shared secret is on (required beyond loopback: ``p2p.shared_secret`` on every instance,
  ``--shared-secret`` on the proxy), so the proxy's admin endpoints are called with its Bearer token;
- UCX (NIXL) runs over TCP on each host's ``eth0``;
- every process runs in its host's namespace (``ip netns exec``), and every HTTP call this harness
  makes goes out of the client host: construct, start and query the cluster inside
  ``rig.inside(CLIENT)``.

The plain reference instance (``single_child``) runs on a host of its own too, so that its outputs
and its latency are seen through the same links.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

import httpx

from lmcache_p2p.cli import launch
from lmcache_p2p.cli.instance import Site
from lmcache_p2p.cli.main import build_parser
from lmcache_p2p.cli.processes import Child, stop_all, wait_healthy
from lmcache_p2p.cli.vllm_env import vllm_argv, vllm_env, write_logging_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))

from fault_cluster import (  # noqa: E402
    apply_p2p_overrides,
    HTTP_TIMEOUT_S, SERVED_MODEL_NAME, STARTUP_TIMEOUT_S, ClusterSpec, FaultCluster, common_vllm_args,
)
from rig import NetRig  # noqa: E402

logger = logging.getLogger(__name__)

CLIENT = "client"
SINGLE = "single"
PROXY = "proxy"
SECRET = "multihost-rig-secret"
# Ports: each host has its own address, so every instance can use the launcher's defaults.
PROXY_PORT, CONTROL_PORT, PREFILL_PORT, DECODE_PORT, KV_PORT = 9100, 9101, 7100, 7200, 7300
SINGLE_PORT = 7000


def hosts_for(prefill: int, decode: int, single: bool = True) -> list[str]:
    """The rig's hosts for XpYd: the proxy, each instance, the client (and the reference's host)."""
    return [PROXY, *(f"prefiller-{i}" for i in range(prefill)), *(f"decoder-{i}" for i in range(decode)), CLIENT,
            *([SINGLE] if single else [])]


@dataclasses.dataclass(frozen=True)
class HostSpec:
    transport: str = "nixl"  # nixl (UCX over TCP) | nccl (Gloo on CPU)
    secret: str = SECRET


class MultiHostCluster(FaultCluster):
    """A :class:`FaultCluster` whose proxy and instances each run on their own rig host."""

    def __init__(self, rig: NetRig, model: Path, log_dir: Path, spec: ClusterSpec, hosts: HostSpec = HostSpec()
                 ) -> None:
        self.rig = rig
        self.model = Path(model)
        self.spec = spec
        self.hosts = hosts
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.ports = []  # each host's own: nothing on this machine's namespace to check
        argv = ["launch", "--model", str(self.model), "--prefill", str(spec.prefill), "--decode", str(spec.decode),
                "--proxy-port", str(PROXY_PORT), "--proxy-control-port", str(CONTROL_PORT),
                "--prefill-port", str(PREFILL_PORT), "--decode-port", str(DECODE_PORT), "--kv-port", str(KV_PORT),
                "--log-dir", str(self.log_dir), "--buffer-size", spec.buffer_size,
                "--max-model-len", str(spec.max_model_len), "--transport", hosts.transport,
                "--shared-secret", hosts.secret,
                *[f"--vllm-arg={a}" for a in ["--served-model-name", SERVED_MODEL_NAME, *spec.vllm_args]],
                *[f"--proxy-arg={a}" for a in spec.proxy_args]]
        self.args = build_parser().parse_args(argv)
        self.args.proxy_host = rig.addr(PROXY)
        write_logging_config(self.log_dir / "logging.json")
        self.instances = {inst.name: inst for inst in launch.plan(self.args)}
        proxy = launch.proxy_child(self.args, self.log_dir)
        self.children: dict[str, Child] = {PROXY: self._in_host(PROXY, proxy)}
        self.models: dict[str, Path] = {}
        for name in self.instances:
            self.children[name] = self._child(name, self.model)
        self.url = f"http://{rig.addr(PROXY)}:{PROXY_PORT}"
        self.recovery: dict[str, float | None] = {}  # seconds until routable after the network came back
        self.last_recovery: float | None = None  # of the last scenario's victim

    def _in_host(self, host: str, child: Child) -> Child:
        return dataclasses.replace(child, argv=self.rig.argv(host, child.argv))

    def site(self, name: str) -> Site:
        """Where instance ``name`` runs: its host's address, the proxy's host, UCX on the host's eth0."""
        return Site(bind_host=self.rig.addr(name), proxy_host=self.rig.addr(PROXY), shared_secret=self.hosts.secret,
                    config_file=str(self.log_dir / "{name}.yaml"), logging_file=str(self.log_dir / "logging.json"),
                    env={"UCX_NET_DEVICES": "eth0"})

    def _child(self, name: str, model: Path) -> Child:
        inst = self.instances[name]
        child = launch.vllm_child(inst, model, self.args, self.log_dir, site=self.site(name))
        apply_p2p_overrides(self.log_dir / f"{name}.yaml",
                            self.spec.receiver_p2p if inst.role == "decoder" else self.spec.sender_p2p)
        self.models[name] = Path(model)
        return self._in_host(name, child)

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.hosts.secret}"}

    def instances_info(self) -> list[dict]:
        try:
            resp = httpx.get(f"{self.url}/instances", params={"all": "1"}, headers=self.admin_headers,
                             timeout=HTTP_TIMEOUT_S, trust_env=False)
            return resp.json() if resp.status_code == 200 else []
        except (httpx.HTTPError, ValueError):
            return []

    def host_of(self, name: str) -> str:
        return self.rig.addr(name)


def single_child(rig: NetRig, model: Path, log_dir: Path, spec: ClusterSpec, *, cpu_core: int | None) -> Child:
    """A plain vLLM instance (no LMCache) with the deployment's vLLM flags, on the rig's ``single`` host."""
    log_dir.mkdir(parents=True, exist_ok=True)
    logging_config = write_logging_config(log_dir / "logging.json")
    host = rig.addr(SINGLE)
    argv = vllm_argv(model, SINGLE_PORT, *common_vllm_args(spec), host=host)
    env = vllm_env(cpu_core=cpu_core, logging_config=logging_config)
    env.pop("LMCACHE_CONFIG_FILE", None)
    return Child(SINGLE, rig.argv(SINGLE, argv), env, log_dir / "single.log", f"http://{host}:{SINGLE_PORT}/health")


def start_single(child: Child, timeout_s: float = STARTUP_TIMEOUT_S) -> str:
    """Start it (call inside the client host) and return its URL."""
    child.start()
    try:
        wait_healthy([child], timeout_s)
    except BaseException:
        stop_all([child])
        raise
    return child.health_url.removesuffix("/health")
