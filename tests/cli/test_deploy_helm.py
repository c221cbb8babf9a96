"""``deploy helm``: the chart renders, by Helm's own engine (helm-python-sdk), the objects ``deploy kubernetes``
renders for the same flags; the checked-in chart is fresh; checkov, the schemas and hadolint pass on every
variant (checkov runs once per session; the test skips where it is not installed).
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
import yaml

from lmcache_p2p.cli import deploy, helm_chart, kube_values, kubernetes
from lmcache_p2p.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench import k8s_checks  # noqa: E402  (bench/ scripts import as modules from the repository root)

CHART = k8s_checks.CHART
PREFIX = "# Rendered by: lmcache-p2p "
CHART_FLAGS = shlex.split(CHART.joinpath("Chart.yaml").read_text().splitlines()[0].removeprefix(PREFIX))[4:]
# What a cluster sets beside the plan the chart was made from (values, not templates).
KNOBS = {
    "defaults": [],
    "scheduled": ["--node-selector", "pool=gpu", "--toleration", "nvidia.com/gpu:NoSchedule", "--topology-spread",
                  "topology.kubernetes.io/zone", "--runtime-class", "nvidia", "--priority-class", "high",
                  "--proxy-node-selector", "pool=cpu", "--image", "reg.example/lmcache-p2p:9", "--image-pull-policy",
                  "IfNotPresent", "--image-pull-secret", "regcred", "--decode-memory", "90Gi", "--prefill-cpu", "6"],
    "optional-objects": ["--shared-secret", "s3cret", "--service-monitor", "--no-network-policy", "--decode", "5",
                         "--prefill", "0"],
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LMCACHE_P2P_SECRET", raising=False)


def key(obj: dict) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


@pytest.mark.parametrize("knobs", KNOBS)
@pytest.mark.parametrize(("release", "namespace"), [("pd", "serving"), ("lmcache-p2p", "llm")])
def test_the_chart_renders_the_objects_the_renderer_renders(knobs: str, release: str, namespace: str) -> None:
    argv = [*CHART_FLAGS, *KNOBS[knobs], "--name", release, "--namespace", namespace]
    args = build_parser().parse_args(["deploy", "kubernetes", *argv])
    mine = list(yaml.safe_load_all(deploy.render_text(args)))
    values = kube_values.to_chart(kubernetes.deployment(args).values)
    theirs = k8s_checks.render_chart(CHART, values, release=release, namespace=namespace)
    assert sorted(map(key, theirs)) == sorted(map(key, mine))
    by_key = {key(o): o for o in theirs}
    for obj in mine:
        assert by_key[key(obj)] == obj, key(obj)


def test_a_value_set_at_install_reaches_its_object_and_nothing_else() -> None:
    base = {key(o): o for o in k8s_checks.render_chart(CHART)}
    scaled = {key(o): o for o in k8s_checks.render_chart(CHART, {"decode": {"replicas": 7}})}
    decoder = ("StatefulSet", "lmcache-p2p-decoder")
    assert scaled[decoder]["spec"]["replicas"] == 7 and base[decoder]["spec"]["replicas"] == 2
    assert {k for k in base if base[k] != scaled[k]} == {decoder}


def test_the_chart_has_no_secret_unless_given_one_and_never_stores_it(tmp_path: Path) -> None:
    argv = ["deploy", "helm", "--out", str(tmp_path / "c"), *CHART_FLAGS, "--shared-secret", "t0p-s3cret"]
    assert main(argv) == 0
    assert not any("t0p-s3cret" in p.read_text() for p in (tmp_path / "c").rglob("*") if p.is_file())
    kinds = [o["kind"] for o in k8s_checks.render_chart(tmp_path / "c")]
    assert "Secret" not in kinds
    secret = [o for o in k8s_checks.render_chart(tmp_path / "c", {"sharedSecret": "x"}) if o["kind"] == "Secret"]
    assert secret[0]["stringData"] == {"shared-secret": "x"}


def test_the_checked_in_chart_equals_a_fresh_write(tmp_path: Path) -> None:
    first = CHART.joinpath("Chart.yaml").read_text().splitlines()[0]
    argv = shlex.split(first.removeprefix(PREFIX))
    out = argv.index("--out") + 1
    argv[out] = str(tmp_path / "chart")
    assert main(argv) == 0
    fresh = {p.relative_to(tmp_path / "chart"): p.read_text() for p in (tmp_path / "chart").rglob("*") if p.is_file()}
    fresh = {p: t.replace(str(tmp_path / "chart"), str(CHART.relative_to(ROOT))) for p, t in fresh.items()}
    checked_in = {p.relative_to(CHART): p.read_text() for p in CHART.rglob("*") if p.is_file()}
    assert fresh == checked_in, f"{CHART.relative_to(ROOT)} is stale: write it again with {first.removeprefix('# ')}"


def test_writing_a_chart_refuses_a_folder_that_holds_something_else(tmp_path: Path, capsys) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["deploy", "helm", "--out", str(tmp_path), "--model", "/models/m"]) == 2
    assert "error: --out" in capsys.readouterr().err and (tmp_path / "notes.txt").read_text() == "mine"


def test_a_template_marker_left_behind_fails_loudly() -> None:
    text = helm_chart.template("spec:\n  replicas: '@@scalar:decode.replicas@@'\n  name: zzreleasenamezz-x\n")
    assert text == "spec:\n  replicas: {{ .Values.decode.replicas | toJson }}\n  name: {{ .Release.Name }}-x\n"
    for path in CHART.rglob("*.yaml"):
        assert "@@" not in path.read_text() and helm_chart.NAME_SENTINEL not in path.read_text(), path


@pytest.fixture(scope="session")
def variants() -> dict[str, list[dict]]:
    return k8s_checks.variants()


@pytest.fixture(scope="session")
def checkov(variants: dict[str, list[dict]]) -> dict[str, dict]:
    if k8s_checks.checkov_command() is None:
        pytest.skip("checkov is not installed (scripts/setup_env.sh puts it in .venv/tools/checkov)")
    return k8s_checks.run_checkov(variants)


def test_every_variant_passes_checkov_with_only_annotated_skips(variants: dict, checkov: dict) -> None:
    assert set(variants) >= {"pd-2p2d", "pd-2p2d-rdma", "pd-1p1d-cpu", "pd-2p2d-tp2-nccl", "helm-chart"}
    for name in variants:
        result = checkov[name]
        assert result["failed"] == 0, (name, result["failed_checks"])
        assert result["passed"] > 200, name
        for skip in result["skipped_checks"]:
            check, _, why = skip.partition("=")
            assert why and why != "None" and check.startswith("CKV_K8S_"), skip


def test_every_variant_validates_against_the_schemas(variants: dict) -> None:
    for name, objects in variants.items():
        errors, unchecked = k8s_checks.schema_errors(objects, k8s_checks.K8S_VERSIONS[-1:])  # both: the results file
        assert errors == [] and set(unchecked) <= {"monitoring.coreos.com/v1/ServiceMonitor"}, name


def test_the_dockerfile_is_hadolint_clean_and_hadolint_does_flag_a_bad_one(tmp_path: Path) -> None:
    assert k8s_checks.hadolint() == []
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM vllm/vllm-openai:latest\nRUN pip install lmcache\n")
    assert {f["code"] for f in k8s_checks.hadolint(bad)} >= {"DL3007", "DL3013", "DL3042"}
    text = k8s_checks.DOCKERFILE.read_text()
    assert "USER ${UID}" in text and "lmcache==" in text and "nixl==" in text


def test_the_results_file_records_every_variant_with_no_failure(variants: dict) -> None:
    results = json.loads(k8s_checks.RESULTS.read_text())
    assert set(results["variants"]) == set(variants)
    for name, row in results["variants"].items():
        assert (row["schema_errors"], row["checkov"]["failed"]) == ([], 0), name
        assert row["checkov"]["passed"] > 200
    assert results["hadolint"]["findings"] == [] and results["meta"]["commit"]
