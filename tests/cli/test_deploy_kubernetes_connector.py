"""``deploy kubernetes --connector nixl | nixl-push``: plain vLLM pods running vLLM's own NIXL connector behind our
proxy, each registered with it by a sidecar (cli/register.py), and the LMCache-only flags refused.

Offline, as the other deploy tests: the rendered objects against the Kubernetes schemas, each pod's command and
environment against what ``launch --connector`` makes for the same instance, the sidecar's and the preStop's
commands parsed by our own CLI, the chart rendered by Helm's engine, the sidecar's probe run by ``sh``.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import threading
from pathlib import Path

import httpx
import kubernetes_validate
import pytest
import yaml

from lmcache_p2p.cli import connectors, deploy, kube_values, kubernetes
from lmcache_p2p.cli.main import build_parser, main

from .test_deploy_helm import k8s_checks  # bench/k8s_checks.py, as that module imports it
from .test_deploy_kubernetes import (
    K8S_VERSIONS, POD_ENV, SECRET, SHAPES, SITE_KEYS, by_kind, config_of, container, expand, launcher, render,
)

NIXL = SHAPES["2p2d-gpu-nixl"]
CPU_PUSH = ["--prefill", "1", "--decode", "2", "--model", "/models/tiny", "--connector", "nixl-push"]
POD_IP = "10.1.2.3"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LMCACHE_P2P_SECRET", "UCX_TLS", "UCX_NET_DEVICES", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)


def pod(objects: list[dict], role: str) -> dict:
    return by_kind(objects, "StatefulSet")[f"lmcache-p2p-{role}"]["spec"]["template"]["spec"]


def sidecar(objects: list[dict], role: str) -> dict:
    return next(c for c in pod(objects, role)["containers"] if c["name"] == "registrar")


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c["env"]}


@pytest.mark.parametrize("argv", [NIXL, CPU_PUSH, [*NIXL, "--rdma", "--namespace", "serving", "--shared-secret", SECRET,
                                                   "--service-monitor", "--cpu-limit", "none"]],
                         ids=["nixl-gpu", "nixl-push-cpu", "nixl-gpu-rdma-everything"])
def test_every_object_of_a_vllm_connector_deployment_validates_against_the_schemas(argv: list[str]) -> None:
    objects = render(*argv)
    for obj in objects:
        for version in K8S_VERSIONS:
            if obj["kind"] != "ServiceMonitor":  # no bundled schema
                kubernetes_validate.validate(obj, version, strict=True)
    assert [c["name"] for c in pod(objects, "decoder")["containers"]] == ["vllm", "registrar"]


@pytest.mark.parametrize(("argv", "expected"), [
    (NIXL, {"kv_connector": "NixlConnector", "kv_role": "kv_both"}),  # GPU: the KV stays in device memory
    (CPU_PUSH, {"kv_connector": "NixlPushConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}),
])
def test_pods_run_plain_vllm_with_the_connectors_transfer_config_and_nothing_of_lmcache(argv, expected) -> None:
    objects = render(*argv)
    for role in ("prefiller", "decoder"):
        c = container(objects, role)
        assert c["command"][1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
        assert json.loads(c["command"][c["command"].index("--kv-transfer-config") + 1]) == expected
        assert config_of(objects, role).keys() == {"logging.json"}  # vLLM's logging config; no LMCache YAML
        env = env_of(c)
        assert "LMCACHE_CONFIG_FILE" not in env
        assert env["VLLM_PLUGINS"]["value"] == ("lmcache_p2p" if "--device" not in argv else "")  # spin cap on CPU
        # the handshake listener: its port is the pod's and its Service's; its host, which peers dial, the pod IP
        side = next(p for p in c["ports"] if p["name"] == "side-channel")
        assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"]) == side["containerPort"]
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST",
                                                      "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
        headless = by_kind(objects, "Service")[f"lmcache-p2p-{role}"]["spec"]
        assert {"name": "side-channel", "port": side["containerPort"], "targetPort": "side-channel"} in \
            headless["ports"]
        assert not [p for p in c["ports"] if p["name"].startswith(("kv-", "nccl-"))]
    text = yaml.safe_dump_all(objects)
    assert "LMCacheConnectorV1" not in text and "storage_plugin" not in text


def test_the_side_channel_host_is_the_pod_ip_even_when_vllm_binds_every_interface() -> None:
    objects = render(*SHAPES["1p2d-cpu-nixl-push-bind-all"])
    c = container(objects, "decoder")
    assert c["command"][c["command"].index("--host") + 1] == "0.0.0.0"
    assert env_of(c)["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert "--tensor-parallel-size" in c["command"]  # its TP ranks share the one handshake port
    assert [p["name"] for p in c["ports"]] == ["http", "side-channel"]


@pytest.mark.parametrize("connector", ["nixl", "nixl-push"])
def test_a_rendered_instance_gets_the_flags_and_environment_launch_gives_it(tmp_path: Path, connector: str) -> None:
    argv = ["--prefill", "2", "--decode", "2", "--model", "/models/m", "--device", "cuda", "--connector", connector,
            "--max-model-len", "4096", "--vllm-arg=--enforce-eager", "--shared-secret", SECRET]
    launched = launcher(tmp_path, argv)
    objects = render(*argv)
    for name in ("prefiller-0", "decoder-0"):
        role, child = name.split("-")[0], launched[name]
        c = container(objects, role)
        assert [expand(a, POD_ENV) for a in c["command"][1:]] == child.argv[1:]
        rendered = {e["name"]: e["value"] for e in c["env"] if "value" in e}
        # a pod is alone at its address: its handshake port is --kv-port, where launch's decoders count on from
        # the prefillers (7300 + 2)
        port = connectors.SIDE_CHANNEL_PORT_ENV
        assert (rendered[port], child.env[port]) == ("7300", "7300" if role == "prefiller" else "7302")
        differs = SITE_KEYS | {port}
        assert {k: v for k, v in rendered.items() if k not in differs} == \
            {k: child.env.get(k) for k in rendered if k not in differs}
        # launch's host is loopback; a pod's is its own address (the downward API, above)
        assert connectors.SIDE_CHANNEL_HOST_ENV in child.env and connectors.SIDE_CHANNEL_HOST_ENV not in rendered
    # launch names its instances to the proxy by flags; a pod registers itself, so the proxy has none
    proxy = by_kind(objects, "Deployment")["lmcache-p2p-proxy"]["spec"]["template"]["spec"]["containers"][0]
    assert any(a.startswith("--nixl-") for a in launched["proxy"].argv)
    assert not any(a.startswith("--nixl-") for a in proxy["command"])


@pytest.mark.parametrize("flag", [["--buffer-size", "2GB"], ["--send-buffer-size", "1GB"],
                                  ["--p2p", "alloc_timeout_s=20"], ["--transport", "nccl"]])
@pytest.mark.parametrize("target", ["kubernetes", "helm"])
def test_flags_of_our_plugin_alone_are_refused_naming_the_flag(flag: list[str], target: str, tmp_path: Path,
                                                                capsys) -> None:
    out_dir = ["--out", str(tmp_path / "chart")] if target == "helm" else []
    assert main(["deploy", target, *out_dir, *NIXL, *flag]) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"error: {flag[0]}: " in err and "--connector nixl" in err
    assert not (tmp_path / "chart").exists()
    assert main(["deploy", target, *out_dir, *NIXL[:-2], *flag]) == 0  # ours takes them


def shell_words(command: list[str], pod_env: dict[str, str]) -> list[str]:
    """A ``sh -c`` hook's words once the shell has filled in ``pod_env`` (``$NAME`` inside double quotes)."""
    text = command[2]
    for name, value in pod_env.items():
        text = text.replace(f"${name}", value)
    return shlex.split(text)


def test_each_pod_registers_its_own_url_and_its_prestop_drains_the_id_it_registered() -> None:
    from lmcache_p2p.cli.register import Registration

    objects = render(*NIXL)
    pod_env = {"POD_IP": POD_IP, "POD_NAME": "lmcache-p2p-decoder-1"}
    for role, port in (("prefiller", 7100), ("decoder", 7200)):
        c = sidecar(objects, role)
        args = build_parser().parse_args([expand(a, pod_env) for a in c["command"][3:]])
        assert (args.command, args.proxy, args.role, args.url) == (
            "register", "http://lmcache-p2p-proxy:9100", role, f"http://{POD_IP}:{port}")
        # the proxy's admin calls need the secret: both containers read it from the Secret
        for each in (c, container(objects, role)):
            assert env_of(each)["LMCACHE_P2P_SECRET"]["valueFrom"] == {
                "secretKeyRef": {"name": "lmcache-p2p-secret", "key": "shared-secret"}}
        registered = Registration.of(args.proxy, args.role, args.url, args.backend)
        words = shell_words(container(objects, role)["lifecycle"]["preStop"]["exec"]["command"], pod_env)
        drain = build_parser().parse_args(words[4:])
        assert (drain.command, drain.instance, drain.proxy, drain.missing_ok) == (
            "drain", registered.instance_id, "http://lmcache-p2p-proxy:9100", True)


def test_scaling_changes_the_replicas_alone_and_never_the_proxy() -> None:
    """The proxy learns pods from their sidecars, not from flags, and a pod's ports are its role's whatever the
    counts: more or fewer pods of either role change the replicas and no pod template (no rollout, no restart)."""
    assert NIXL[:4] == ["--prefill", "2", "--decode", "2"]
    few, many = render(*NIXL), render("--prefill", "3", "--decode", "5", *NIXL[4:])
    sets = by_kind(many, "StatefulSet")
    assert (sets["lmcache-p2p-prefiller"]["spec"]["replicas"], sets["lmcache-p2p-decoder"]["spec"]["replicas"]) == (3, 5)
    for kind in ("Deployment", "StatefulSet", "ConfigMap", "Service", "NetworkPolicy"):
        for name, obj in by_kind(few, kind).items():
            if kind == "StatefulSet":
                obj, other = obj["spec"]["template"], by_kind(many, kind)[name]["spec"]["template"]
            else:
                other = by_kind(many, kind)[name]
            assert obj == other, (kind, name)


def test_network_policies_open_the_side_channel_between_the_roles_and_no_port_of_ours() -> None:
    objects = render(*NIXL)
    for role, other in (("prefiller", "decoder"), ("decoder", "prefiller")):
        rules = by_kind(objects, "NetworkPolicy")[f"lmcache-p2p-{role}"]["spec"]["ingress"]
        assert all(rule.get("ports") for rule in rules if "from" in rule)  # a rule without ports opens them all
        side = [r for r in rules if {"protocol": "TCP", "port": "side-channel"} in r["ports"]]
        assert len(side) == 1 and side[0]["from"] == [{"podSelector": {"matchLabels": {
            "app.kubernetes.io/name": "lmcache-p2p", "app.kubernetes.io/instance": "lmcache-p2p",
            "app.kubernetes.io/component": other}}}]
        named = {p["port"] for r in rules for p in r["ports"] if isinstance(p["port"], str)}
        assert named == {"http", "side-channel"}


@pytest.mark.parametrize("connector", ["nixl", "nixl-push"])
def test_the_chart_renders_what_the_renderer_renders_for_a_vllm_connector(tmp_path: Path, connector: str) -> None:
    argv = ["--prefill", "2", "--decode", "2", "--device", "cuda", "--model", "/models/m", "--connector", connector,
            "--name", "pd", "--namespace", "serving", "--decode-memory", "90Gi"]
    assert main(["deploy", "helm", "--out", str(tmp_path / "chart"), *argv]) == 0
    args = build_parser().parse_args(["deploy", "kubernetes", *argv])
    mine = list(yaml.safe_load_all(deploy.render_text(args)))
    values = kube_values.to_chart(kubernetes.deployment(args).values)
    theirs = k8s_checks.render_chart(tmp_path / "chart", values, release="pd", namespace="serving")
    assert sorted((o["kind"], o["metadata"]["name"]) for o in theirs) == \
        sorted((o["kind"], o["metadata"]["name"]) for o in mine)
    by_key = {(o["kind"], o["metadata"]["name"]): o for o in theirs}
    for obj in mine:
        assert by_key[(obj["kind"], obj["metadata"]["name"])] == obj


def test_the_sidecars_probe_passes_while_its_loop_runs_and_fails_once_it_is_overdue(tmp_path: Path) -> None:
    from lmcache_p2p.cli.register import Registration, keep_registered

    probe = sidecar(render(*NIXL), "decoder")["livenessProbe"]["exec"]["command"]
    assert probe == sidecar(render(*NIXL), "decoder")["readinessProbe"]["exec"]["command"]
    alive = Path(kubernetes.REGISTRAR_ALIVE_FILE)
    local = tmp_path / alive.name
    command = [probe[0], probe[1], probe[2].replace(str(alive), str(local))]

    def run_probe() -> int:
        return subprocess.run(command, capture_output=True, timeout=10).returncode

    assert run_probe() != 0  # no attempt made yet
    reg = Registration.of("http://proxy:9100", "decoder", f"http://{POD_IP}:7200", "vllm-nixl")
    stop = threading.Event()
    proxy = httpx.MockTransport(lambda request: (stop.set(), httpx.Response(200, json={}))[1])
    with httpx.Client(transport=proxy) as client:
        keep_registered(client, reg, stop, 10.0, {}, local, alive_for_s=60.0)
    assert run_probe() == 0
    keep_overdue = threading.Event()
    with httpx.Client(transport=httpx.MockTransport(lambda r: (keep_overdue.set(), httpx.Response(503))[1])) as client:
        keep_registered(client, reg, keep_overdue, 10.0, {}, local, alive_for_s=-5.0)  # a deadline already past
    assert run_probe() != 0
