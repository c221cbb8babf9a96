"""Kubernetes-style YAML for the rendered objects, the same bytes wherever they are written.

No anchors (each object reads alone), multi-line strings as blocks, keys in the order made. A
ConfigMap's name holds a hash of its ``data`` written so (:func:`config_text`), and the Helm
chart hashes the very same text, so both name it alike.
"""

from __future__ import annotations

import hashlib
from typing import Any

import yaml

CONFIG_HASH_CHARS = 10


class Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: object) -> bool:
        return True


def _str_block(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


Dumper.add_representer(str, _str_block)


def dump(obj: Any) -> str:
    return yaml.dump(obj, Dumper=Dumper, sort_keys=False, width=4096)


def dump_all(objects: list[Any]) -> str:
    return yaml.dump_all(objects, Dumper=Dumper, sort_keys=False, width=4096)


def config_text(data: dict[str, str]) -> str:
    """A ConfigMap's ``data`` as the chart's template holds it (trimmed as Helm trims a ``define``)."""
    return dump(data).strip()


def config_hash(data: dict[str, str]) -> str:
    """What a content-named ConfigMap's name ends with (Helm: ``sha256sum | trunc 10``)."""
    return hashlib.sha256(config_text(data).encode()).hexdigest()[:CONFIG_HASH_CHARS]
