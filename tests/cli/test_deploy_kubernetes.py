"""``lmcache-p2p deploy kubernetes``: valid objects, the launcher's instances, the checked-in examples.

No cluster: every object is validated offline against the Kubernetes schemas (kubernetes-validate,
strict: an unknown field fails too), and each rendered instance is compared with what
``launch`` itself makes for it (its own code: plan_gpus, vllm_child, proxy_child).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from lmcache_p2p.cli import deploy, launch
from lmcache_p2p.cli.gpu import GpuSlot
from lmcache_p2p.cli.main import build_parser, main
from lmcache_p2p.config import P2PConfig

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
K8S_VERSIONS = ("1.27.0", "1.37.0")  # an old cluster and the newest schemas the package bundles
GIB = 2**30
SECRET = "s3cr3t-value-for-tests"
POD_ENV = {"POD_IP": "127.0.0.1", "LMCACHE_P2P_SECRET": SECRET}
# What only the place an instance runs decides (files, a host's core or GPU index, UCX's devices).
SITE_KEYS = {"LMCACHE_CONFIG_FILE", "VLLM_LOGGING_CONFIG_PATH", "UCX_NET_DEVICES", "CUDA_VISIBLE_DEVICES",
             "VLLM_CPU_OMP_THREADS_BIND", "UCX_TCP_PORT_RANGE", "HOME"}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LMCACHE_P2P_SECRET", "UCX_TLS", "UCX_NET_DEVICES", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)


def render(*argv: str) -> list[dict]:
    args = build_parser().parse_args(["deploy", "kubernetes", *argv])
    return list(yaml.safe_load_all(deploy.render_text(args)))


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def container(objects: list[dict], role: str) -> dict:
    return by_kind(objects, "StatefulSet")[f"lmcache-p2p-{role}"]["spec"]["template"]["spec"]["containers"][0]


def config_of(objects: list[dict], role: str) -> dict[str, str]:
    """The data of the ConfigMap the role's pods mount."""
    pod = by_kind(objects, "StatefulSet")[f"{objects_name(objects)}-{role}"]["spec"]["template"]["spec"]
    name = next(v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v)
    return by_kind(objects, "ConfigMap")[name]["data"]


def objects_name(objects: list[dict]) -> str:
    return objects[0]["metadata"]["labels"]["app.kubernetes.io/instance"]


def expand(value: str, pod_env: dict[str, str]) -> str:
    for name, sub in pod_env.items():
        value = value.replace(f"$({name})", sub)
    return value


SHAPES = {
    "1p1d-cpu": ["--prefill", "1", "--decode", "1", "--model", "/models/tiny"],
    "2p2d-gpu": ["--prefill", "2", "--decode", "2", "--model", "/models/m", "--device", "cuda"],
    "2p2d-gpu-tp2-nccl": ["--prefill", "2", "--decode", "2", "--model", "/models/m", "--device", "cuda",
                          "--transport", "nccl", "--vllm-arg=--tensor-parallel-size=2"],
    "1p3d-gpu-rdma": ["--prefill", "1", "--decode", "3", "--model", "/models/m", "--device", "cuda", "--rdma",
                      "--decoder-spread", "required", "--model-pvc", "models", "--proxy-workers", "4"],
    "2p1d-bind-all-secret": ["--prefill", "2", "--decode", "1", "--model", "/models/m", "--bind-all",
                             "--shared-secret", SECRET, "--namespace", "serving", "--name", "pd"],
    # vLLM's own connectors: plain vLLM pods with a registration sidecar (test_deploy_kubernetes_connector.py)
    "2p2d-gpu-nixl": ["--prefill", "2", "--decode", "2", "--model", "/models/m", "--device", "cuda",
                      "--connector", "nixl"],
    "1p2d-cpu-nixl-push-bind-all": ["--prefill", "1", "--decode", "2", "--model", "/models/tiny", "--connector",
                                    "nixl-push", "--bind-all", "--vllm-arg=--tensor-parallel-size=2"],
}


@pytest.mark.parametrize("shape", SHAPES)
def test_every_rendered_object_validates_against_the_kubernetes_schemas(shape: str) -> None:
    objects = render(*SHAPES[shape])
    assert {o["kind"] for o in objects} >= {"ConfigMap", "Service", "Deployment", "StatefulSet"}
    for obj in objects:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def test_the_validation_refuses_a_broken_object() -> None:
    statefulset = by_kind(render(*SHAPES["2p2d-gpu"]), "StatefulSet")["lmcache-p2p-decoder"]
    statefulset["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(statefulset, K8S_VERSIONS[-1], strict=True)
    statefulset["spec"]["template"]["spec"]["containers"][0]["ports"][0] = {"containerPort": 7200, "hostPrt": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(statefulset, K8S_VERSIONS[-1], strict=True)


def test_pods_get_a_gpu_per_tp_rank_and_ports_per_rank() -> None:
    objects = render(*SHAPES["2p2d-gpu-tp2-nccl"])
    sets = by_kind(objects, "StatefulSet")
    assert {name: s["spec"]["replicas"] for name, s in sets.items()} == {"lmcache-p2p-prefiller": 2,
                                                                         "lmcache-p2p-decoder": 2}
    for role in ("prefiller", "decoder"):
        resources = container(objects, role)["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == 2
        assert {k: v for k, v in resources["limits"].items() if k != "nvidia.com/gpu"} == resources["requests"]
    assert {p["name"]: p["containerPort"] for p in container(objects, "decoder")["ports"]} == {
        "http": 7200, "kv-0": 7300, "kv-1": 7301, "nccl-0": 7400, "nccl-1": 7401}
    assert [p["name"] for p in container(objects, "prefiller")["ports"]] == ["http"]
    headless = by_kind(objects, "Service")["lmcache-p2p-decoder"]["spec"]
    assert headless["clusterIP"] == "None" and [p["port"] for p in headless["ports"]] == [7200, 7300, 7301, 7400, 7401]


def test_proxy_service_and_deployment_carry_the_http_and_registry_ports() -> None:
    objects = render(*SHAPES["1p3d-gpu-rdma"])
    service = by_kind(objects, "Service")["lmcache-p2p-proxy"]["spec"]
    assert {p["name"]: p["port"] for p in service["ports"]} == {"http": 9100, "registry": 9101}
    proxy = by_kind(objects, "Deployment")["lmcache-p2p-proxy"]["spec"]
    assert proxy["replicas"] == 1 and proxy["strategy"] == {"type": "Recreate"}
    pod = proxy["template"]["spec"]["containers"][0]
    assert pod["command"][pod["command"].index("--workers") + 1] == "4"
    assert pod["resources"]["requests"]["cpu"] == "5"
    assert pod["command"][pod["command"].index("--tokenizer") + 1] == "/models/m"  # relay workers load it first
    for role in ("prefiller", "decoder"):
        p2p = yaml.safe_load(config_of(objects, role)[f"{role}.yaml"])
        assert p2p["extra_config"]["p2p"]["proxy_url"] == "tcp://lmcache-p2p-proxy:9101"


def test_instances_bind_and_advertise_the_pod_ip_and_drain_before_they_stop() -> None:
    objects = render(*SHAPES["2p2d-gpu"])
    decoder = yaml.safe_load(config_of(objects, "decoder")["decoder.yaml"])["extra_config"]["p2p"]
    assert (decoder["host"], decoder["http_url"], decoder["instance_id"]) == (
        "${POD_IP}", "http://${POD_IP}:7200", "${POD_NAME}")
    for role in ("prefiller", "decoder"):
        c = container(objects, role)
        env = {e["name"]: e for e in c["env"]}
        assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert c["command"][c["command"].index("--host") + 1] == "$(POD_IP)"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
        stop = c["lifecycle"]["preStop"]["exec"]["command"]
        assert stop[:2] == ["sh", "-c"] and "lmcache_p2p.cli.main drain \"$POD_NAME\" --proxy " \
            "http://lmcache-p2p-proxy:9100" in stop[2]
    bind_all = yaml.safe_load(config_of(render(*SHAPES["2p1d-bind-all-secret"]), "decoder")
                              ["decoder.yaml"])["extra_config"]["p2p"]
    assert (bind_all["host"], bind_all["advertise_host"]) == ("0.0.0.0", "${POD_IP}")


def test_decoders_spread_over_nodes_and_prefillers_are_not_constrained() -> None:
    preferred = by_kind(render(*SHAPES["2p2d-gpu"]), "StatefulSet")
    anti = preferred["lmcache-p2p-decoder"]["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    term = anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "decoder"
    assert "affinity" not in preferred["lmcache-p2p-prefiller"]["spec"]["template"]["spec"]
    required = by_kind(render(*SHAPES["1p3d-gpu-rdma"]), "StatefulSet")["lmcache-p2p-decoder"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" in \
        required["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]


def test_rdma_is_an_option_that_sets_ucx_and_asks_for_the_device() -> None:
    plain, rdma = render(*SHAPES["2p2d-gpu"]), render(*SHAPES["1p3d-gpu-rdma"])
    for role in ("prefiller", "decoder"):
        env = {e["name"]: e.get("value") for e in container(plain, role)["env"]}
        assert env["UCX_TLS"] == "cuda_ipc,cuda_copy,tcp,self"
        assert container(plain, role)["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        c = container(rdma, role)
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["UCX_TLS"].split(",")[:2] == ["rc", "ud"] and env["UCX_NET_DEVICES"] == "all"
        assert (c["resources"]["limits"]["nvidia.com/gpu"], c["resources"]["limits"]["rdma/rdma_shared_device_a"]) == (1, 1)
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}


def test_the_secret_is_a_secret_and_never_inline_in_a_pod_spec() -> None:
    args = build_parser().parse_args(["deploy", "kubernetes", *SHAPES["2p1d-bind-all-secret"]])
    args.argv = ["deploy", "kubernetes", *SHAPES["2p1d-bind-all-secret"]]
    text = deploy.render_text(args)
    objects = list(yaml.safe_load_all(text))
    secret = by_kind(objects, "Secret")["pd-secret"]
    assert secret["stringData"] == {"shared-secret": SECRET} and secret["metadata"]["namespace"] == "serving"
    assert text.count(SECRET) == 1  # in the Secret only: not in the header, the pods or the ConfigMap
    for obj in objects:
        if obj["kind"] in ("StatefulSet", "Deployment"):
            env = {e["name"]: e for e in obj["spec"]["template"]["spec"]["containers"][0]["env"]}
            assert env["LMCACHE_P2P_SECRET"]["valueFrom"] == {"secretKeyRef": {"name": "pd-secret",
                                                                                "key": "shared-secret"}}
    assert "Secret" not in {o["kind"] for o in render(*SHAPES["2p2d-gpu"])}  # no value given: none rendered


def launcher(tmp_path: Path, argv: list[str]) -> dict:
    """What ``launch`` makes with the same flags: each instance's Child, and the proxy's."""
    args = build_parser().parse_args(["launch", *argv])
    instances = launch.plan(args)
    gpus = launch.plan_gpus(instances, args, [GpuSlot(i, 80 * GIB) for i in range(8)]) if args.device == "cuda" \
        else {}
    made = {i.name: launch.vllm_child(i, Path(args.model), args, tmp_path, gpus.get(i.name)) for i in instances}
    made["proxy"] = launch.proxy_child(args, tmp_path)
    return made


@pytest.mark.parametrize("shape", ["1p1d-cpu", "2p2d-gpu", "2p2d-gpu-tp2-nccl", "1p3d-gpu-rdma"])
def test_a_rendered_instance_gets_the_flags_environment_and_config_launch_gives_it(
        tmp_path: Path, shape: str) -> None:
    argv = [*SHAPES[shape], "--shared-secret", SECRET, "--p2p", "alloc_timeout_s=20", "--buffer-size", "2GB"]
    kube_only = {"--rdma", "--decoder-spread", "required", "--model-pvc", "models"}
    launched = launcher(tmp_path, [a for a in argv if a not in kube_only])
    objects = render(*argv)
    for name in ("prefiller-0", "decoder-0"):
        role, child = name.split("-")[0], launched[name]
        c = container(objects, role)
        assert [expand(a, POD_ENV) for a in c["command"][1:]] == child.argv[1:]
        rendered = {e["name"]: expand(e["value"], POD_ENV) for e in c["env"] if "value" in e}
        differs = SITE_KEYS | ({"UCX_TLS"} if "--rdma" in argv else set())
        assert {k: v for k, v in rendered.items() if k not in differs} == \
            {k: child.env.get(k) for k in rendered if k not in differs}
        added = {k for k in child.env if k not in os.environ}  # what launch sets beyond its own environment
        assert added - differs <= set(rendered)
        pod_env = {**POD_ENV, "POD_NAME": name}
        mine = yaml.safe_load(config_of(objects, role)[f"{role}.yaml"])
        theirs = yaml.safe_load(Path(child.env["LMCACHE_CONFIG_FILE"]).read_text())
        assert {k: v for k, v in mine.items() if k != "extra_config"} == \
            {k: v for k, v in theirs.items() if k != "extra_config"}
        pod_cfg = P2PConfig.from_mapping(mine["extra_config"]["p2p"], environ=pod_env)
        assert pod_cfg.proxy_url == "tcp://lmcache-p2p-proxy:9101"  # the proxy's Service, not loopback
        assert dataclasses.replace(pod_cfg, proxy_url="tcp://127.0.0.1:9101") == \
            P2PConfig.from_mapping(theirs["extra_config"]["p2p"], environ={})
    proxy = by_kind(objects, "Deployment")["lmcache-p2p-proxy"]["spec"]["template"]["spec"]["containers"][0]
    launched_proxy = [a for a in launched["proxy"].argv[1:]]
    rendered_proxy = [expand(a, POD_ENV) for a in proxy["command"][1:]]
    if "--tokenizer" in rendered_proxy:  # launch names the folder only when it exists on this host
        at = rendered_proxy.index("--tokenizer")
        del rendered_proxy[at:at + 2]
    # pods dial the registry by the Service's name, which the proxy must answer to; launch's by its bind address
    at = rendered_proxy.index("--advertise-host")
    assert rendered_proxy[at + 1] == "lmcache-p2p-proxy"
    del rendered_proxy[at:at + 2]
    assert rendered_proxy == launched_proxy


def test_every_pod_of_a_role_runs_the_instance_launch_makes_first(tmp_path: Path) -> None:
    """A pod has its own address, so decoder-1's pod uses decoder-0's ports; all else is decoder-1's."""
    argv = SHAPES["2p2d-gpu"]
    launched = launcher(tmp_path, argv)
    c = container(render(*argv), "decoder")
    first, second = launched["decoder-0"].argv, launched["decoder-1"].argv
    assert [a for a, b in zip(first, second) if a != b] == ["7200"]  # the only difference on one host
    assert [expand(a, POD_ENV) for a in c["command"][1:]] == first[1:]


@pytest.mark.parametrize(("argv", "flag"), [
    (["--prefill", "-1"], "--prefill"),
    (["--decode", "-2"], "--decode"),
    (["--prefill", "0", "--decode", "0"], "--decode"),
    (["--proxy-workers", "0"], "--proxy-workers"),
    (["--kv-port", "70000"], "--kv-port"),
    (["--name", "Bad_Name"], "--name"),
    (["--namespace", "has space"], "--namespace"),
    (["--gpu-memory-gib", "0"], "--gpu-memory-gib"),
    (["--drain-timeout-s", "-1"], "--drain-timeout-s"),
    (["--image", " "], "--image"),
    (["--p2p", "alloc_timeout=20"], "p2p.alloc_timeout"),
    (["--p2p", "alloc_timeout_s"], "--p2p"),
    (["--device", "cuda", "--buffer-size", "79GB"], "--buffer-size"),
])
def test_bad_input_is_refused_with_an_error_naming_the_flag(argv: list[str], flag: str, capsys) -> None:
    assert main(["deploy", "kubernetes", "--model", "/models/m", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "error: " in err and flag in err


def test_a_missing_model_is_refused_naming_the_flag(capsys) -> None:
    assert main(["deploy", "kubernetes", "--prefill", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "error: --model: required" in err


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_checked_in_example_equals_a_fresh_render(example: Path, capsys) -> None:
    first = example.read_text().splitlines()[0]
    prefix = "# Rendered by: lmcache-p2p "
    assert first.startswith(prefix), f"{example}: the first line must say how it was rendered"
    assert main(shlex.split(first.removeprefix(prefix))) == 0
    out, _ = capsys.readouterr()
    assert out == example.read_text(), (f"{example.relative_to(ROOT)} is stale: render it again with "
                                        f"{first.removeprefix('# Rendered by: ')} > {example.relative_to(ROOT)}")
    # schemas, checkov: tests/cli/test_deploy_helm.py (every variant, the chart's render too)


def test_there_is_a_checked_in_example() -> None:
    assert [p.name for p in EXAMPLES if "2p2d" in p.name], "deploy/kubernetes/ holds no 2P2D example"


def pod_containers(objects: list[dict]) -> list[dict]:
    """Every container of every workload (vLLM, a registration sidecar, the proxy)."""
    return [c for o in objects if o["kind"] in ("StatefulSet", "Deployment")
            for c in o["spec"]["template"]["spec"]["containers"]]


@pytest.mark.parametrize("shape", SHAPES)
def test_every_reference_a_pod_makes_is_defined_in_its_environment(shape: str) -> None:
    """The kubelet leaves an unknown $(X) as it is and P2PConfig refuses an unknown ${X}: neither may slip in."""
    import re

    objects = render(*SHAPES[shape])
    for c in pod_containers(objects):
        names = [e["name"] for e in c["env"]]
        for arg in c["command"]:
            for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                assert ref in names, f"{c['name']}: {arg!r} refers to $({ref}), which its env does not define"
        for e in c["env"]:
            assert "$(" not in e.get("value", ""), e
        for hook in (c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command") or [])[2:]:
            for ref in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", hook):  # the shell fills these in
                assert ref in names, f"{c['name']}: its preStop refers to ${ref}, which its env does not define"
        config_file = next((e["value"] for e in c["env"] if e["name"] == "LMCACHE_CONFIG_FILE"), None)
        if config_file is not None:  # none with a vLLM connector
            role = Path(config_file).name
            config = config_of(objects, role.removesuffix(".yaml"))
            for ref in re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", config[role]):
                assert ref in names, f"{role} refers to ${{{ref}}}, which the pod's env does not define"


def test_the_proxy_pod_command_parses_and_refuses_to_run_beyond_loopback_without_the_secret(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from lmcache_p2p.errors import ConfigError
    from lmcache_p2p.proxy.settings import ProxySettings

    objects = render(*SHAPES["1p3d-gpu-rdma"])
    command = [expand(a, {"POD_IP": "10.0.0.7"}) for a in by_kind(objects, "Deployment")["lmcache-p2p-proxy"]
               ["spec"]["template"]["spec"]["containers"][0]["command"]]
    assert command[:4] == ["python3", "-m", "lmcache_p2p.cli.main", "proxy"]
    args = build_parser().parse_args(command[3:])
    with pytest.raises(ConfigError, match="--shared-secret"):
        ProxySettings.from_args(args)  # the pod's env without LMCACHE_P2P_SECRET (its Secret missing)
    monkeypatch.setenv("LMCACHE_P2P_SECRET", SECRET)  # what its secretKeyRef gives it
    settings = ProxySettings.from_args(args)
    assert (settings.host, settings.control_host, settings.port, settings.control_port, settings.workers) == (
        "10.0.0.7", "10.0.0.7", 9100, 9101, 4)
    # instances address the registry by the Service name they dial (p2p.proxy_url): the proxy answers to it
    assert settings.control_name_hosts[0] == "lmcache-p2p-proxy"


def test_the_prestop_hook_is_a_drain_command_that_parses() -> None:
    c = container(render(*SHAPES["2p2d-gpu"]), "decoder")
    words = shlex.split(c["lifecycle"]["preStop"]["exec"]["command"][2].replace('"$POD_NAME"', "lmcache-p2p-decoder-1"))
    assert words[:4] == ["exec", "python3", "-m", "lmcache_p2p.cli.main"]
    args = build_parser().parse_args(words[4:])
    assert (args.command, args.instance, args.proxy, args.timeout_s) == (
        "drain", "lmcache-p2p-decoder-1", "http://lmcache-p2p-proxy:9100", 120.0)
