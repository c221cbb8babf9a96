"""``deploy kubernetes`` as a platform team applies it: resources, scheduling, rollouts, security, policies.

Each test renders objects and asserts on what a cluster would do with them (which pod template
changes, what a pod may write, which ports a NetworkPolicy opens), plus one real check that UCX
listens inside ``UCX_TCP_PORT_RANGE`` as the rendered pod sets it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lmcache_p2p.cli.main import main
from .test_deploy_kubernetes import SHAPES, by_kind, container, render

GPU = SHAPES["2p2d-gpu"]
UCX_LISTEN_TIMEOUT_S = 120


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LMCACHE_P2P_SECRET", "UCX_TLS", "UCX_NET_DEVICES", "UCX_TCP_PORT_RANGE"):
        monkeypatch.delenv(name, raising=False)


def templates(objects: list[dict]) -> dict[str, dict]:
    """Each workload's pod template, by workload name."""
    return {o["metadata"]["name"]: o["spec"]["template"] for o in objects if o["kind"] in ("StatefulSet", "Deployment")}


def pod(objects: list[dict], name: str) -> dict:
    return templates(objects)[name]["spec"]


@pytest.mark.parametrize(("change", "changed"), [
    (["--buffer-size", "2GB"], {"lmcache-p2p-decoder"}),  # the decoder's buffer (and its vLLM share)
    (["--send-buffer-size", "1GB"], {"lmcache-p2p-prefiller"}),
    (["--p2p", "alloc_timeout_s=20"], {"lmcache-p2p-prefiller", "lmcache-p2p-decoder"}),
    (["--policy", "round_robin"], {"lmcache-p2p-proxy"}),
])
def test_a_config_change_of_one_role_changes_only_that_roles_pod_template(change: list[str], changed: set) -> None:
    before, after = render(*GPU), render(*GPU, *change)
    differs = {name for name, t in templates(before).items() if templates(after)[name] != t}
    assert differs == changed


def test_each_role_mounts_its_own_immutable_config_map_named_by_its_content() -> None:
    before, after = render(*GPU), render(*GPU, "--buffer-size", "2GB")
    for objects in (before, after):
        for role in ("prefiller", "decoder"):
            volumes = pod(objects, f"lmcache-p2p-{role}")["volumes"]
            name = next(v["configMap"]["name"] for v in volumes if "configMap" in v)
            config = by_kind(objects, "ConfigMap")[name]
            assert config["immutable"] is True and set(config["data"]) == {f"{role}.yaml", "logging.json"}
            assert name.startswith(f"lmcache-p2p-{role}-")
    old, new = set(by_kind(before, "ConfigMap")), set(by_kind(after, "ConfigMap"))
    assert len(old - new) == 1 and len(new - old) == 1 and next(iter(new - old)).startswith("lmcache-p2p-decoder-")
    assert "volumes" not in [k for k in pod(before, "lmcache-p2p-proxy") if k == "configMap"]


def test_requests_equal_limits_and_memory_counts_shm_the_host_buffers_and_the_relay_workers() -> None:
    objects = render(*GPU, "--vllm-arg=--tensor-parallel-size=2")
    for role, host_gib in (("prefiller", 2), ("decoder", 1)):  # LMCache's max_local_cpu_size per rank
        resources = container(objects, role)["resources"]
        assert resources["requests"] == {"cpu": "16", "memory": f"{2 * 32 + 2 * host_gib + 4}Gi"}
        assert resources["limits"] == {**resources["requests"], "nvidia.com/gpu": 2}
        dshm = next(v for v in pod(objects, f"lmcache-p2p-{role}")["volumes"] if v["name"] == "dshm")
        assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": "4Gi"}
    cpu = container(render(*SHAPES["1p1d-cpu"], "--buffer-size", "3GB"), "decoder")["resources"]["requests"]
    assert cpu == {"cpu": "2", "memory": f"{8 + 1 + 3 + 2}Gi"}  # vLLM-CPU: the receive buffer is host memory
    for workers, memory in ((1, "1Gi"), (4, "5Gi")):
        proxy = render(*GPU, "--proxy-workers", str(workers))
        resources = pod(proxy, "lmcache-p2p-proxy")["containers"][0]["resources"]
        assert resources["requests"] == resources["limits"] == {"cpu": str(workers + 1), "memory": memory}


def test_resource_flags_set_them_and_cpu_limit_none_drops_only_the_cpu_limit() -> None:
    objects = render(*GPU, "--decode-cpu", "12", "--decode-memory", "100Gi", "--shm-size", "8Gi",
                     "--proxy-memory", "6Gi", "--cpu-limit", "none")
    decoder = container(objects, "decoder")["resources"]
    assert decoder == {"requests": {"cpu": "12", "memory": "100Gi"}, "limits": {"memory": "100Gi", "nvidia.com/gpu": 1}}
    assert container(objects, "prefiller")["resources"]["requests"]["memory"] == f"{32 + 2 + 8}Gi"
    assert pod(objects, "lmcache-p2p-proxy")["containers"][0]["resources"]["limits"] == {"memory": "6Gi"}
    annotations = by_kind(objects, "StatefulSet")["lmcache-p2p-decoder"]["metadata"]["annotations"]
    assert annotations["checkov.io/skip-CKV_K8S_11"].startswith("CKV_K8S_11=--cpu-limit none")


def test_scheduling_flags_reach_the_instance_pods_and_the_proxy_flags_the_proxy(tmp_path: Path) -> None:
    affinity = tmp_path / "affinity.yaml"
    affinity.write_text(textwrap.dedent("""\
        nodeAffinity:
          requiredDuringSchedulingIgnoredDuringExecution:
            nodeSelectorTerms:
            - matchExpressions: [{key: pool, operator: In, values: [gpu]}]
        """))
    objects = render(*GPU, "--node-selector", "nvidia.com/gpu.product=H100", "--toleration", "nvidia.com/gpu:NoSchedule",
                     "--toleration", "dedicated=llm:NoExecute", "--affinity", str(affinity), "--topology-spread",
                     "topology.kubernetes.io/zone:DoNotSchedule", "--runtime-class", "nvidia", "--priority-class", "high",
                     "--proxy-node-selector", "pool=cpu", "--proxy-toleration", "spot", "--image-pull-secret", "regcred",
                     "--image-pull-policy", "IfNotPresent")
    for role in ("prefiller", "decoder"):
        spec = pod(objects, f"lmcache-p2p-{role}")
        assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "H100"}
        assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                                       {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoExecute"}]
        assert spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"][0]["matchExpressions"][0]["key"] == "pool"
        assert ("podAntiAffinity" in spec["affinity"]) == (role == "decoder")  # the file's, plus the decoders' spread
        assert spec["topologySpreadConstraints"] == [{
            "maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": by_kind(objects, "StatefulSet")[f"lmcache-p2p-{role}"]["spec"]["selector"]
                              ["matchLabels"]}}]
        assert (spec["runtimeClassName"], spec["priorityClassName"]) == ("nvidia", "high")
        assert spec["imagePullSecrets"] == [{"name": "regcred"}]
        assert spec["containers"][0]["imagePullPolicy"] == "IfNotPresent"
    proxy = pod(objects, "lmcache-p2p-proxy")
    assert proxy["nodeSelector"] == {"pool": "cpu"} and proxy["tolerations"] == [{"key": "spot", "operator": "Exists"}]
    assert proxy["priorityClassName"] == "high" and "runtimeClassName" not in proxy
    plain = pod(render(*GPU), "lmcache-p2p-prefiller")
    assert not {"nodeSelector", "tolerations", "affinity", "runtimeClassName", "imagePullSecrets"} & set(plain)


@pytest.mark.parametrize("shape", ["2p2d-gpu", "1p3d-gpu-rdma", "2p2d-gpu-nixl"])
def test_pods_are_non_root_with_a_read_only_root_and_write_only_to_empty_dirs(shape: str) -> None:
    objects = render(*SHAPES[shape])
    rdma = "--rdma" in SHAPES[shape]
    for name, template in templates(objects).items():
        spec = template["spec"]
        assert spec["automountServiceAccountToken"] is False
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] >= 10000
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in spec["containers"]:  # vLLM, a vLLM connector's registration sidecar, the proxy
            security = c["securityContext"]
            assert (security["allowPrivilegeEscalation"], security["privileged"],
                    security["readOnlyRootFilesystem"]) == (False, False, True)
            added = ["IPC_LOCK"] if rdma and c["name"] == "vllm" else []
            assert security["capabilities"] == {"drop": ["ALL"], **({"add": added} if added else {})}
            volumes = {v["name"]: v for v in spec["volumes"]}
            writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
            assert writable <= {"/dev/shm", "/tmp", "/home/lmcache"}
            for mount in c["volumeMounts"]:
                if not mount.get("readOnly"):
                    assert "emptyDir" in volumes[mount["name"]] and volumes[mount["name"]]["emptyDir"]["sizeLimit"]
            assert {e["name"]: e.get("value") for e in c["env"]}["HOME"] == "/home/lmcache"


def test_a_disruption_budget_per_role_lets_one_instance_go_at_a_time() -> None:
    objects = render(*GPU)
    budgets = by_kind(objects, "PodDisruptionBudget")
    sets = by_kind(objects, "StatefulSet")
    assert set(budgets) == {"lmcache-p2p-prefiller", "lmcache-p2p-decoder"}
    for name, budget in budgets.items():
        assert budget["spec"] == {"maxUnavailable": 1, "selector": sets[name]["spec"]["selector"]}


def _rules(objects: list[dict], name: str) -> list[dict]:
    return by_kind(objects, "NetworkPolicy")[name]["spec"]["ingress"]


def _from(rule: dict) -> set[str]:
    return {p["podSelector"]["matchLabels"].get("app.kubernetes.io/component", "prometheus") for p in rule["from"]}


def test_network_policies_open_each_port_to_its_peers_and_pin_ucx_to_its_range() -> None:
    objects = render(*GPU, "--ucx-port-range", "20000-20031")
    proxy = _rules(objects, "lmcache-p2p-proxy")
    assert proxy[0] == {"ports": [{"protocol": "TCP", "port": "http"}]}  # clients: anyone
    assert _from(proxy[1]) == {"prefiller", "decoder"} and proxy[1]["ports"] == [{"protocol": "TCP", "port": "registry"}]
    decoder = _rules(objects, "lmcache-p2p-decoder")
    assert _from(decoder[0]) == {"proxy", "prometheus"} and decoder[0]["ports"][0]["port"] == "http"
    assert _from(decoder[1]) == {"prefiller", "proxy"} and [p["port"] for p in decoder[1]["ports"]] == ["kv-0"]
    ucx = {"protocol": "TCP", "port": 20000, "endPort": 20031}
    assert _from(decoder[2]) == {"prefiller"} and decoder[2]["ports"] == [ucx]
    prefiller = _rules(objects, "lmcache-p2p-prefiller")
    assert _from(prefiller[1]) == {"decoder"} and prefiller[1]["ports"] == [ucx]
    for role in ("prefiller", "decoder"):
        env = {e["name"]: e.get("value") for e in container(objects, role)["env"]}
        assert env["UCX_TCP_PORT_RANGE"] == "20000-20031"
    nccl = render(*SHAPES["2p2d-gpu-tp2-nccl"])
    assert "ports" not in _rules(nccl, "lmcache-p2p-decoder")[2]  # NCCL's sockets take any port
    assert "UCX_TCP_PORT_RANGE" not in {e["name"] for e in container(nccl, "decoder")["env"]}
    assert "NetworkPolicy" not in {o["kind"] for o in render(*GPU, "--no-network-policy")}


def test_the_service_monitor_is_rendered_only_when_asked_and_scrapes_every_service() -> None:
    assert "ServiceMonitor" not in {o["kind"] for o in render(*GPU)}
    objects = render(*GPU, "--service-monitor")
    monitor = by_kind(objects, "ServiceMonitor")["lmcache-p2p"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    services = [s for s in by_kind(objects, "Service").values()
                if all(s["metadata"]["labels"].get(k) == v for k, v in selector.items())]
    assert len(services) == 3 and all("http" in [p["name"] for p in s["spec"]["ports"]] for s in services)
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "30s"}]


@pytest.mark.parametrize(("argv", "flag"), [
    (["--toleration", "key:Sometimes"], "--toleration"),
    (["--node-selector", "novalue"], "--node-selector"),
    (["--decode-memory", "lots"], "--decode-memory"),
    (["--decode-memory", "1Gi"], "--decode-memory"),  # not more than /dev/shm
    (["--prefill-cpu", "-1"], "--prefill-cpu"),
    (["--ucx-port-range", "7250-7350"], "--ucx-port-range"),  # holds the decoder's KV port 7300
    (["--ucx-port-range", "80-90"], "--ucx-port-range"),
    (["--run-as-user", "0"], "--run-as-user"),
    (["--topology-spread", "zone:Maybe"], "--topology-spread"),
    (["--affinity", "/nonexistent/affinity.yaml"], "--affinity"),
])
def test_bad_day_one_flags_are_refused_naming_the_flag(argv: list[str], flag: str, capsys) -> None:
    assert main(["deploy", "kubernetes", "--model", "/models/m", "--device", "cuda", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"error: {flag}" in err


_LISTEN = """
import os
from pathlib import Path
import nixl
agent = nixl.nixl_agent("probe", nixl.nixl_agent_config(enable_prog_thread=False, backends=[]))
agent.create_backend("UCX", {})  # its TCP interface listens from here on
inodes = {int(os.readlink(f)[8:-1]) for f in Path("/proc/self/fd").iterdir()
          if os.path.exists(f) and os.readlink(f).startswith("socket:[")}
for table in ("tcp", "tcp6"):
    for line in Path("/proc/net", table).read_text().splitlines()[1:]:
        f = line.split()
        if f[3] == "0A" and int(f[9]) in inodes:
            print("listening", int(f[1].rsplit(":", 1)[1], 16))
"""


def test_ucx_listens_inside_the_port_range_the_pod_is_given() -> None:
    """What makes the NetworkPolicy's UCX rule true: NIXL's UCX takes its TCP listener from the range."""
    pytest.importorskip("nixl")
    env = {e["name"]: e["value"] for e in container(render(*GPU, "--ucx-port-range", "23000-23019"), "decoder")["env"]
           if "value" in e}
    done = subprocess.run([sys.executable, "-c", _LISTEN], capture_output=True, text=True, timeout=UCX_LISTEN_TIMEOUT_S,
                          env={**os.environ, "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo",
                               "UCX_TCP_PORT_RANGE": env["UCX_TCP_PORT_RANGE"]})
    ports = [int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("listening ")]
    assert done.returncode == 0 and ports, done.stderr[-2000:]
    assert all(23000 <= p <= 23019 for p in ports), ports
