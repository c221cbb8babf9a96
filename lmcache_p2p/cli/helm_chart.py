"""``lmcache-p2p deploy helm``: the Helm chart of a deployment, made from the objects ``deploy kubernetes`` renders.

The templates are the renderer's own objects built from marker values (``kube_values.markers``):
each value becomes a reference into values.yaml, the name the release's, the namespace the
release's, and each role's ConfigMap is named by the hash of its content as Helm computes it
(``sha256sum`` of the same text, kube_yaml.config_text). values.yaml holds what the flags gave.
So ``helm template`` with the values of a set of flags renders the objects ``deploy kubernetes``
renders with those flags (tests/cli/test_deploy_helm.py checks this with Helm's own engine). What
shapes the instances (model, TP, ports, buffers, transport) is fixed in the templates: render the
chart again to change it.
"""

from __future__ import annotations

import argparse
import copy
import re
import shutil
from pathlib import Path

from lmcache_p2p import __version__
from lmcache_p2p.cli import kube_values, kube_yaml, kubernetes
from lmcache_p2p.cli.kube_meta import Deployment, Names
from lmcache_p2p.errors import ConfigError

CHART = "lmcache-p2p"
NAME_SENTINEL = "zzreleasenamezz"  # a DNS label the flags' checks accept, replaced by the release's name
NAMESPACE_MARKER = "@@release:Namespace@@"
_LINE = re.compile(r"^(?P<indent> *)(?P<key>[^:\s'][^:]*): '?@@(?P<kind>scalar|optional|block|configdata):"
                   r"(?P<path>[\w.-]+)@@'?$")
# Annotations that hold only for some values: each line rendered under its condition.
CONDITIONAL_LINES = {"checkov.io/skip-CKV_K8S_15:": 'ne .Values.image.pullPolicy "Always"'}
_CONFIG_HASH = re.compile(r"@@confighash:(?P<role>\w+)@@")


def _define(role: str) -> str:
    return f"{CHART}.config.{role}"


def marked(args: argparse.Namespace) -> Deployment:
    """The deployment whose objects are the templates: every value a marker, the name the sentinel."""
    margs = copy.copy(args)
    margs.name = NAME_SENTINEL
    specs = kubernetes.role_specs(margs, kubernetes.pod_site(margs, Names(NAME_SENTINEL)))
    names = Names(NAME_SENTINEL, {r: f"{NAME_SENTINEL}-{r}-@@confighash:{r}@@" for r in kubernetes.ROLES})
    return Deployment(margs, names, specs, kube_values.markers(kube_values.Values), NAMESPACE_MARKER)


def template(text: str) -> str:
    """A dumped object with its markers turned into Helm's references."""
    lines = []
    for line in text.splitlines():
        m = _LINE.match(line)
        condition = next((c for start, c in CONDITIONAL_LINES.items() if line.lstrip().startswith(start)), None)
        if condition is not None:
            lines += [f"{{{{- if {condition} }}}}", line, "{{- end }}"]
            continue
        if m is None:
            lines.append(line)
            continue
        indent, key, kind, path = m["indent"], m["key"], m["kind"], m["path"]
        nested = len(indent) + 2
        if kind == "scalar":
            lines.append(f"{indent}{key}: {{{{ .Values.{path} | toJson }}}}")
        elif kind == "optional":
            lines += [f"{{{{- with .Values.{path} }}}}", f"{indent}{key}: {{{{ toJson . }}}}", "{{- end }}"]
        elif kind == "block":  # tpl: a value may name the release (the decoders' anti-affinity does)
            lines += [f"{{{{- with .Values.{path} }}}}", f"{indent}{key}:",
                      f"{{{{- tpl (toYaml .) $ | nindent {nested} }}}}", "{{- end }}"]
        else:
            lines += [f"{indent}{key}:", f'{{{{- include "{_define(path)}" . | nindent {nested} }}}}']
    out = "\n".join(lines) + "\n"
    out = _CONFIG_HASH.sub(lambda m: f'{{{{ include "{_define(m["role"])}" . | sha256sum | trunc '
                                     f'{kube_yaml.CONFIG_HASH_CHARS} }}}}', out)
    out = re.sub(f"'?{re.escape(NAMESPACE_MARKER)}'?", "{{ .Release.Namespace }}", out)
    return out.replace(NAME_SENTINEL, "{{ .Release.Name }}")


def values_text(args: argparse.Namespace, command: str) -> str:
    """values.yaml: what the flags gave (the secret never: set sharedSecret at install, or create the Secret)."""
    margs = copy.copy(args)
    margs.name, margs.shared_secret = NAME_SENTINEL, None
    values = kube_values.to_chart(kubernetes.deployment(margs).values)
    text = kube_yaml.dump(values)
    # A value that names the release is a template (the chart's blocks go through tpl).
    text = re.sub(rf"\b{NAME_SENTINEL}\b", "'{{ .Release.Name }}'", text)
    return (f"# Rendered by: {command}\n"
            "# What the flags gave. Resources, replicas, scheduling and the optional objects are yours to set;\n"
            "# the instances themselves (model, TP, ports, buffers) are in the templates: render the chart again.\n"
            + text)


def chart_files(args: argparse.Namespace, command: str) -> dict[str, str]:
    """Every file of the chart, by its path in the chart's folder."""
    kubernetes.deployment(args)  # the flags checked as the renderer checks them
    d = marked(args)
    files = {
        "Chart.yaml": f"# Rendered by: {command}\n" + kube_yaml.dump({
            "apiVersion": "v2", "name": CHART, "type": "application", "version": __version__,
            "appVersion": __version__,
            "description": "lmcache_p2p: prefill/decode disaggregated vLLM (prefillers, decoders, the proxy)"}),
        "values.yaml": values_text(args, command),
    }
    defines = []
    for part in kubernetes.parts(d):
        obj = part.obj
        if obj["kind"] == "ConfigMap":
            role = part.file.removesuffix("-config.yaml")
            defines.append(f'{{{{- define "{_define(role)}" -}}}}\n{kube_yaml.config_text(obj["data"])}\n'
                           "{{- end }}\n")
            obj = {**obj, "data": f"@@configdata:{role}@@"}
        text = template(kube_yaml.dump(obj))
        if part.when is not None:
            text = f"{{{{- if .Values.{part.when} }}}}\n{text}{{{{- end }}}}\n"
        files[f"templates/{part.file}"] = text
    files["templates/_config.tpl"] = "\n".join(defines).replace(NAME_SENTINEL, "{{ .Release.Name }}")
    return files


def write_chart(args: argparse.Namespace, out: Path, command: str) -> list[Path]:
    """The chart written into ``out``; its templates/ emptied first (a file the chart no longer has must not
    linger). A folder that holds anything but a chart is refused, never emptied."""
    files = chart_files(args, command)
    if out.exists() and any(out.iterdir()) and not (out / "Chart.yaml").is_file():
        raise ConfigError("--out", f"{out} is not empty and holds no Chart.yaml: name a new folder or a chart's")
    if (out / "templates").is_dir():
        shutil.rmtree(out / "templates")
    written = []
    for rel, text in files.items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written
