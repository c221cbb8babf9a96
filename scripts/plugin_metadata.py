"""Write lmcache_p2p's package metadata, its entry points above all, into a folder on ``sys.path``.

For a machine that runs this project from a copy put on ``PYTHONPATH`` instead of installing it (the GPU
pass: ``scripts/gpu_pass.sh``). vLLM loads general plugins only through installed entry points
(``vllm.general_plugins``), so without this metadata vLLM never runs ``lmcache_p2p.vllm_plugin.register``
and the instances serve without it (``lmcache_p2p.vllm_plugin.check_registered`` logs that). What it
writes comes from ``pyproject.toml``: name, version, ``[project.entry-points.*]`` and ``[project.scripts]``.

    python3 scripts/plugin_metadata.py SITE_DIR        prints the .dist-info folder it wrote
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write(site: Path, pyproject: Path = ROOT / "pyproject.toml") -> Path:
    project = tomllib.loads(pyproject.read_text())["project"]
    name, version = project["name"], project["version"]
    groups = {**project.get("entry-points", {}), "console_scripts": project.get("scripts", {})}
    dist = site / f"{name.replace('-', '_')}-{version}.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (dist / "entry_points.txt").write_text(
        "".join(f"[{group}]\n" + "".join(f"{key} = {value}\n" for key, value in entries.items()) + "\n"
                for group, entries in groups.items() if entries))
    (dist / "top_level.txt").write_text("lmcache_p2p\n")
    (dist / "RECORD").write_text("")
    return dist


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: plugin_metadata.py SITE_DIR")
    print(write(Path(sys.argv[1])))
