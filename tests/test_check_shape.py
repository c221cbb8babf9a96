"""scripts/check_shape.py on synthetic packages: an import circle (a lazy one too) and a two-way tie between
the parts of a layered package fail it; a package whose parts form layers passes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_shape.py"


@pytest.fixture(scope="module")
def check_shape():
    spec = importlib.util.spec_from_file_location("check_shape", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _package(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _check(check_shape, root: Path, capsys) -> tuple[int, str]:
    code = check_shape.main(["--root", str(root), "--package", "pkg", "--layered", "pkg.svc"])
    return code, capsys.readouterr().out


_LAYERS = {
    "__init__.py": "",
    "svc/__init__.py": "",
    "svc/top.py": "from pkg.svc.low import helper\n",
    "svc/flow/__init__.py": "",
    "svc/flow/run.py": "from pkg.svc.router import pick\n",
    "svc/router/__init__.py": "",
    "svc/router/pick.py": "from pkg.svc.low import helper\n",
    "svc/low.py": "def helper():\n    return 1\n",
}


def test_a_package_whose_parts_form_layers_passes(check_shape, tmp_path, capsys):
    _package(tmp_path, _LAYERS)
    code, out = _check(check_shape, tmp_path, capsys)
    assert code == 0, out
    assert out.startswith("0 over the limits")


def test_two_parts_that_import_each_other_are_a_tie(check_shape, tmp_path, capsys):
    _package(tmp_path, {**_LAYERS, "svc/router/back.py": "from pkg.svc.flow import run\n"})
    code, out = _check(check_shape, tmp_path, capsys)
    assert code == 1
    tie, = [line for line in out.splitlines() if line.startswith("tie")]
    assert "pkg.svc: flow <-> router" in tie
    assert "pkg.svc.flow.run -> pkg.svc.router" in tie and "pkg.svc.router.back -> pkg.svc.flow" in tie
    assert not [line for line in out.splitlines() if line.startswith("cycle")]  # back.py -> run.py -> router/__init__: folders tied, no module circle


def test_an_import_circle_fails_even_when_one_import_is_lazy(check_shape, tmp_path, capsys):
    lazy = "def later():\n    from pkg.svc.top import x\n    return x\n"
    _package(tmp_path, {**_LAYERS, "svc/low.py": lazy, "svc/top.py": "from pkg.svc.low import later\nx = 1\n"})
    code, out = _check(check_shape, tmp_path, capsys)
    assert code == 1
    assert "cycle    pkg.svc.low -> pkg.svc.top -> pkg.svc.low" in out
    assert "tie      pkg.svc: low <-> top" in out  # modules are parts too


def test_an_import_only_for_type_checking_is_no_circle(check_shape, tmp_path, capsys):
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.svc.top import x\n"
    _package(tmp_path, {**_LAYERS, "svc/low.py": typed, "svc/top.py": "from pkg.svc import low\nx = 1\n"})
    code, out = _check(check_shape, tmp_path, capsys)
    assert code == 0, out
