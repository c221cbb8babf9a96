"""``deploy kubernetes --connector nixl-lmcache-mp | nixl-push-lmcache-mp``: LMCache's multi-process PD recipe in
pods. Each instance pod runs vLLM, its LMCache server (a container of its own, on 127.0.0.1) and the registration
sidecar; vLLM starts once the server answers and the server stops after vLLM.

Offline, as the other deploy tests: the objects against the schemas, the server's and vLLM's commands against what
``launch`` makes for the same instance, the wait and the probes run for real against a local HTTP server, the
chart rendered by Helm's engine, and the refusals.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from lmcache_p2p.cli import connectors, deploy, http_wait, instance, kube_meta, kube_values, kubernetes, launch
from lmcache_p2p.cli import lmcache_servers
from lmcache_p2p.cli.main import build_parser, main

from .conftest import free_port
from .test_deploy_helm import k8s_checks
from .test_deploy_kubernetes_connector import _clean_env, pod  # noqa: F401 (_clean_env: an autouse fixture)
from .test_deploy_kubernetes import K8S_VERSIONS, POD_ENV, by_kind, expand, render

MP = ["--prefill", "2", "--decode", "2", "--model", "/models/tiny", "--connector", "nixl-lmcache-mp"]
ROOT = Path(__file__).resolve().parents[2]


def named(objects: list[dict], role: str) -> dict[str, dict]:
    return {c["name"]: c for c in pod(objects, role)["containers"]}


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def kv_config(argv: list[str]) -> dict:
    return json.loads(flag(argv, "--kv-transfer-config"))


def wrapped(command: list[str]) -> tuple[list[str], list[str]]:
    """vLLM's container command split into the wait's arguments and the command it execs."""
    assert command[:3] == ["python3", "-m", "lmcache_p2p.cli.http_wait"]
    at = command.index("--")
    return command[3:at], command[at + 1:]


@pytest.mark.parametrize("argv", [MP, [*MP[:-1], "nixl-push-lmcache-mp", "--bind-all", "--tp", "2",
                                       "--namespace", "serving", "--cpu-limit", "none", "--service-monitor"]],
                         ids=["nixl-lmcache-mp", "nixl-push-lmcache-mp-tp2-bind-all"])
def test_every_object_validates_against_the_schemas(argv: list[str]) -> None:
    for obj in render(*argv):
        for version in K8S_VERSIONS:
            if obj["kind"] != "ServiceMonitor":  # no bundled schema
                kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("connector", ["nixl-lmcache-mp", "nixl-push-lmcache-mp"])
def test_each_pod_runs_vllm_its_lmcache_server_and_the_registrar(tmp_path: Path, connector: str) -> None:
    argv = [*MP[:-1], connector, "--lmcache-l1-size", "8GB", "--max-model-len", "4096"]
    objects = render(*argv)
    launched = launch_args(argv)
    for role, http_port in (("prefiller", 7100), ("decoder", 7200)):
        c = named(objects, role)
        assert list(c) == ["vllm", "lmcache-server", "registrar"]
        server = c["lmcache-server"]["command"]
        # launch's server for the instance first in its launch order (every pod is first in its own)
        theirs = lmcache_servers.child(launch.plan(launched)[0], launched, tmp_path).argv
        assert [a for a in server[1:] if a != "$(POD_NAME)"] == [a for a in theirs[1:] if a != "prefiller-0"]
        assert flag(server, "--instance-id") == "$(POD_NAME)" and flag(server, "--l1-size-gb") == "8"
        assert (flag(server, "--host"), flag(server, "--http-host"), flag(server, "--port"),
                flag(server, "--http-port"), flag(server, "--supported-transfer-mode")) == (
            "127.0.0.1", "127.0.0.1", "7600", "7601", "auto")
        # vLLM dials it on loopback: the recipe's MultiConnector, as launch builds it for that server
        _, vllm = wrapped(c["vllm"]["command"])
        nixl = connectors.Connector(connector).vllm_name
        assert kv_config(vllm) == {
            "kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": [
                {"kv_connector": nixl, "kv_role": "kv_both", "kv_buffer_device": "cpu"},
                {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
                    "lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 7600}}]}}
        inst = kube_meta.pod_instances(launched)[role]
        assert kv_config(vllm) == instance.transfer_config(inst, launched)
        # its ports stay on loopback: in no Service, no NetworkPolicy, not among vLLM's
        assert {p["name"]: p["containerPort"] for p in c["lmcache-server"]["ports"]} == {
            "lmcache": 7600, "lmcache-http": 7601}
        assert [p["name"] for p in c["vllm"]["ports"]] == ["http", "side-channel"]
        service = by_kind(objects, "Service")[f"lmcache-p2p-{role}"]["spec"]["ports"]
        assert [p["name"] for p in service] == ["http", "side-channel"]
        rules = by_kind(objects, "NetworkPolicy")[f"lmcache-p2p-{role}"]["spec"]["ingress"]
        assert not {7600, 7601, "lmcache", "lmcache-http"} & {p["port"] for r in rules for p in r.get("ports", [])}
        # the registrar as with --connector nixl: vLLM's URL in this pod
        registrar = build_parser().parse_args([expand(a, POD_ENV) for a in c["registrar"]["command"][3:]])
        assert (registrar.command, registrar.role, registrar.url) == ("register", role, f"http://127.0.0.1:{http_port}")


def launch_args(argv: list[str]):
    """``launch``'s namespace for the flags the pods were rendered from (the launcher's plan code reads it)."""
    return build_parser().parse_args(["launch", *argv])


def test_vllm_is_the_instance_launch_makes_first_started_behind_a_wait_for_its_server(tmp_path: Path) -> None:
    objects = render(*MP)
    args = launch_args(MP)
    first = launch.vllm_child(launch.plan(args)[0], Path("/models/tiny"), args, tmp_path)
    c = named(objects, "prefiller")
    wait, vllm = wrapped(c["vllm"]["command"])
    assert [expand(a, POD_ENV) for a in vllm[1:]] == first.argv[1:]
    waited, rest = http_wait.parse_args(wait)
    server = c["lmcache-server"]["command"]
    assert (waited.url, waited.until, waited.timeout_s, waited.timeout_flag, rest) == (
        f"http://{flag(server, '--http-host')}:{flag(server, '--http-port')}/healthcheck", "up", 600.0,
        "--startup-timeout-s", [])
    # vLLM's start may take the wait and its own load: each --startup-timeout-s, as the launcher's waves
    startup = c["vllm"]["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 2 * 600


def test_the_wait_execs_vllm_only_once_the_server_answers_200(health) -> None:
    handler, port = health
    objects = render(*MP, "--lmcache-server-port", str(port - 1), "--startup-timeout-s", "3")
    command = named(objects, "decoder")["vllm"]["command"]
    wait, vllm = wrapped(command)
    execed: list[list[str]] = []
    # 503 (LMCache's engine not up yet) throughout: no exec, and the failure names the setting to raise
    assert http_wait.main(command[3:], execvp=lambda f, a: execed.append(a)) == 1 and execed == []
    threading.Timer(1.0, lambda: setattr(handler, "status", 200)).start()
    assert http_wait.main(command[3:], execvp=lambda f, a: execed.append(a)) == 0
    assert execed == [vllm] and "--kv-transfer-config" in vllm


def test_the_wait_names_the_timeout_setting_when_the_server_never_answers(capsys) -> None:
    port = free_port()
    objects = render(*MP, "--lmcache-server-port", str(port - 1), "--startup-timeout-s", "0")
    assert http_wait.main(wrapped(named(objects, "prefiller")["vllm"]["command"])[0] + ["--"],
                          execvp=lambda f, a: pytest.fail("exec'd without a server")) == 1
    err = capsys.readouterr().err
    assert f"the pod's LMCache server at http://127.0.0.1:{port}/healthcheck did not answer 200" in err
    assert "raise --startup-timeout-s" in err


def test_the_servers_probes_pass_only_while_its_healthcheck_answers_200(health) -> None:
    handler, port = health
    c = named(render(*MP, "--lmcache-server-port", str(port - 1)), "decoder")["lmcache-server"]
    probes = {k: c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    commands = {json.dumps(p["exec"]["command"]) for p in probes.values()}
    assert len(commands) == 1 and all(p["timeoutSeconds"] > http_wait.ATTEMPT_TIMEOUT_S for p in probes.values())
    command = json.loads(commands.pop())
    assert command[0] == "python3"

    def probe() -> int:
        return subprocess.run([sys.executable, *command[1:]], capture_output=True, timeout=30,
                              env={"PYTHONPATH": str(ROOT)}).returncode

    assert probe() == 1  # 503: LMCache's engine not initialized
    handler.status = 200
    assert probe() == 0


def test_the_server_outlives_vllm_its_prestop_waits_until_vllm_stops_answering(health) -> None:
    handler, port = health
    objects = render(*MP, "--prefill-port", str(port), "--drain-timeout-s", "60")
    spec = pod(objects, "prefiller")
    hook = named(objects, "prefiller")["lmcache-server"]["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[:2] == ["sh", "-c"]
    words = shlex.split(hook[2].replace("$POD_IP", "127.0.0.1"))
    assert words[:4] == ["exec", "python3", "-m", "lmcache_p2p.cli.http_wait"]
    waited, rest = http_wait.parse_args(words[4:])
    assert (waited.url, waited.until, waited.timeout_s, rest) == (
        f"http://127.0.0.1:{port}/health", "down", spec["terminationGracePeriodSeconds"], [])
    handler.status = 200  # vLLM still serves (draining): the server must not stop yet
    assert not http_wait.wait(waited.url, http_wait.Until.DOWN, timeout_s=1.5, every_s=0.5)
    handler.status = 503
    assert http_wait.wait(waited.url, http_wait.Until.DOWN, timeout_s=1.5, every_s=0.5)
    # vLLM's own preStop drains it through the proxy, as with --connector nixl
    assert "drain" in named(objects, "prefiller")["vllm"]["lifecycle"]["preStop"]["exec"]["command"][2]


def test_the_server_runs_as_the_other_containers_with_resources_for_its_l1() -> None:
    objects = render(*MP, "--lmcache-l1-size", "8GB", "--cpu-limit", "none")
    c = named(objects, "decoder")
    server, vllm = c["lmcache-server"], c["vllm"]
    assert server["securityContext"] == vllm["securityContext"] == {
        "allowPrivilegeEscalation": False, "privileged": False, "readOnlyRootFilesystem": True,
        "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}
    assert server["resources"] == {"requests": {"cpu": "1", "memory": "10Gi"}, "limits": {"memory": "10Gi"}}
    assert (server["image"], server["imagePullPolicy"]) == (vllm["image"], vllm["imagePullPolicy"])
    # the pod's /dev/shm, as the launcher's server and instance share the host's; no secret, no model
    assert {m["name"]: m["mountPath"] for m in server["volumeMounts"]} == {
        "dshm": "/dev/shm", "home": "/home/lmcache", "tmp": "/tmp"}
    env = {e["name"] for e in server["env"]}
    assert "LMCACHE_P2P_SECRET" not in env and {"POD_NAME", "POD_IP"} <= env
    assert {e["name"]: e.get("value") for e in server["env"]}["LMCACHE_TRACK_USAGE"] == "false"


@pytest.mark.parametrize(("argv", "flag_name", "says"), [
    ([*MP, "--device", "cuda"], "--device", "CUDA IPC"),
    ([*MP, "--buffer-size", "2GB"], "--buffer-size", "their LMCache servers take --lmcache-l1-size"),
    ([*MP, "--transport", "nccl"], "--transport", "--connector nixl-lmcache-mp"),
    ([*MP, "--lmcache-server-port", "65535"], "--lmcache-server-port", "1-65534"),
    ([*MP, "--lmcache-server-port", "7199"], "--lmcache-server-port", "7200 is also the decoder pod's"),
    ([*MP, "--lmcache-server-port", "7300"], "--lmcache-server-port", "NIXL handshake"),
    ([*MP[:-1], "nixl", "--lmcache-l1-size", "4GB"], "--lmcache-l1-size", "--connector nixl starts none"),
    ([*MP[:-2], "--lmcache-server-port", "7700"], "--lmcache-server-port", "--connector lmcache_p2p starts none"),
])
@pytest.mark.parametrize("target", ["kubernetes", "helm"])
def test_what_a_pod_cannot_use_is_refused_naming_the_flag(argv: list[str], flag_name: str, says: str, target: str,
                                                          tmp_path: Path, capsys) -> None:
    out_dir = ["--out", str(tmp_path / "chart")] if target == "helm" else []
    assert main(["deploy", target, *out_dir, *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"error: {flag_name}: " in err and says in err
    assert not (tmp_path / "chart").exists()


def test_the_servers_flags_are_taken_with_an_lmcache_mp_connector_and_change_its_pods_alone() -> None:
    plain, tuned = render(*MP), render(*MP, "--lmcache-l1-size", "4GB", "--lmcache-server-port", "7700")
    server = named(tuned, "prefiller")["lmcache-server"]["command"]
    assert (flag(server, "--l1-size-gb"), flag(server, "--port"), flag(server, "--http-port")) == ("4", "7700", "7701")
    assert kv_config(wrapped(named(tuned, "decoder")["vllm"]["command"])[1])["kv_connector_extra_config"][
        "connectors"][1]["kv_connector_extra_config"]["lmcache.mp.port"] == 7700
    assert by_kind(plain, "Deployment") == by_kind(tuned, "Deployment")  # the proxy does not restart


def test_the_chart_renders_what_the_renderer_renders_for_an_lmcache_mp_connector(tmp_path: Path) -> None:
    argv = [*MP, "--name", "pd", "--namespace", "serving", "--lmcache-l1-size", "4GB"]
    assert main(["deploy", "helm", "--out", str(tmp_path / "chart"), *argv]) == 0
    args = build_parser().parse_args(["deploy", "kubernetes", *argv])
    mine = list(yaml.safe_load_all(deploy.render_text(args)))
    values = kube_values.to_chart(kubernetes.deployment(args).values)
    theirs = k8s_checks.render_chart(tmp_path / "chart", values, release="pd", namespace="serving")
    by_key = {(o["kind"], o["metadata"]["name"]): o for o in theirs}
    assert sorted(by_key) == sorted((o["kind"], o["metadata"]["name"]) for o in mine)
    for obj in mine:
        assert by_key[(obj["kind"], obj["metadata"]["name"])] == obj


def test_there_is_a_checked_in_lmcache_mp_example() -> None:
    example = ROOT / "deploy" / "kubernetes" / "pd-2p2d-nixl-lmcache-mp.yaml"
    assert "--connector nixl-lmcache-mp" in example.read_text().splitlines()[0]
    # fresh (test_deploy_kubernetes.py), schemas and checkov (test_deploy_helm.py, bench/k8s_checks.py)
