"""bench/results holds what the docs cite, and the docs cite only what it holds.

- Every ``bench/results/PATH`` a doc names exists: a file or folder there, or a member ``STUDY/...`` of the
  study's archive ``bench/results/STUDY.tar.xz`` (a glob or ``{a,b}`` in the name must match one).
- bench/results holds at most MAX_FILES files, and each is cited somewhere (the docs, bench/, tests/,
  scripts/, the Makefile; a study's doc beside its archive counts).
- Every member of a study's archive is named in the doc that cites the archive (its index).
"""

from __future__ import annotations

import fnmatch
import re
import tarfile
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
MAX_FILES = 60
ARCHIVE_SUFFIX = ".tar.xz"
CITED_PATH = re.compile(r"bench/results/[\w./{},*-]*[\w*}]")
NAME = re.compile(r"[\w./{},*-]+")
PLACEHOLDER = re.compile(r"(^|/)[A-Z]+(\.|/|$)")  # bench/results/NAME.json: a name to fill in, not a file


def expand(token: str) -> list[str]:
    """``a_{x,y}.log`` -> ``a_x.log``, ``a_y.log`` (nested braces included)."""
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    return [x for alt in m.group(1).split(",") for x in expand(token[:m.start()] + alt + token[m.end():])]


def docs() -> dict[Path, str]:
    paths = [*REPO.glob("*.md"), *REPO.glob("docs/*.md"), *RESULTS.glob("*.md")]
    return {p: p.read_text() for p in paths}


def citing_texts() -> dict[Path, str]:
    paths = [*docs(), *REPO.glob("bench/*.py"), *REPO.glob("tests/**/*.py"), *REPO.glob("scripts/*"),
             REPO / "Makefile"]
    return {p: p.read_text(errors="replace") for p in paths if p.is_file() and p != Path(__file__)}


def results_files() -> list[Path]:
    return sorted(p for p in RESULTS.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


@cache
def archive_members(archive: Path) -> tuple[str, ...]:
    with tarfile.open(archive, "r:*") as tar:
        return tuple(m.name for m in tar.getmembers() if m.isfile())


def resolves(cited: str) -> bool:
    """``bench/results/REL`` names a file or folder there, or a member of REL's study archive."""
    rel = cited.removeprefix("bench/results/").rstrip("/")
    if not rel or any(fnmatch.fnmatch(str(p.relative_to(RESULTS)), rel) for p in RESULTS.rglob("*")):
        return True
    study = rel.split("/", 1)[0]
    archive = RESULTS / f"{study}{ARCHIVE_SUFFIX}"
    if not archive.is_file():
        return False
    return rel == study or any(fnmatch.fnmatch(m, rel) or m.startswith(rel + "/") for m in archive_members(archive))


def broken_citations(texts: dict[Path, str]) -> list[str]:
    broken = []
    for path, text in texts.items():
        for token in CITED_PATH.findall(text):
            for cited in expand(token):
                if not PLACEHOLDER.search(cited) and not resolves(cited):
                    broken.append(f"{path.relative_to(REPO)}: {cited}")
    return broken


def uncited(files: list[Path], texts: dict[Path, str]) -> list[str]:
    """Files whose path under bench/results (or a folder above it) no text but their own names."""
    tokens = {p: {e.strip(".") for tok in NAME.findall(t) for e in expand(tok)} for p, t in texts.items()}
    out = []
    for f in files:
        rel = str(f.relative_to(RESULTS))
        names = {rel, f"bench/results/{rel}"}
        for parent in list(f.relative_to(RESULTS).parents)[:-1]:  # a folder cited whole cites its files
            names |= {f"bench/results/{parent}", f"bench/results/{parent}/"}
        if not any(names & mine for p, mine in tokens.items() if p != f):
            out.append(rel)
    return out


def test_every_results_file_a_doc_cites_exists() -> None:
    assert broken_citations(docs()) == []


def test_bench_results_holds_at_most_60_files_each_cited() -> None:
    files = results_files()
    assert len(files) <= MAX_FILES, f"{len(files)} files in bench/results: pack a study's raw runs into one archive"
    assert uncited(files, citing_texts()) == []


def test_every_archive_member_is_in_the_index_of_the_doc_that_cites_it() -> None:
    texts = docs()
    for archive in RESULTS.glob(f"*{ARCHIVE_SUFFIX}"):
        citing = [t for t in texts.values() if f"{archive.name}" in t]
        assert citing, f"no doc cites {archive.name}"
        named = {e for t in citing for tok in re.findall(r"`([^`\n]+)`", t) for e in expand(tok)}
        for member in archive_members(archive):
            base = member.split("/", 1)[1] if "/" in member else member
            assert any(fnmatch.fnmatch(member, n) or fnmatch.fnmatch(base, n) or fnmatch.fnmatch(Path(member).name, n)
                       for n in named), f"{archive.name}: {member} is not named in the doc that cites it"


@pytest.mark.parametrize("text, ok", [
    ("see `bench/results/e2e_gpu.json`", True),
    ("see `bench/results/nothing_here.json`", False),
    ("logs `bench/results/device/e2e_gpu_s3_main_{A_nixl,C_single}_pass.log`", True),
    ("logs `bench/results/device/e2e_gpu_s3_main_{A_nixl,Z_none}_pass.log`", False),
    ("a member `bench/results/long_prompts/run13_async_store_p2p.json`", True),
    ("a member `bench/results/long_prompts/run99.json`", False),
])
def test_the_citation_check_itself(text: str, ok: bool) -> None:
    assert (broken_citations({REPO / "x.md": text}) == []) is ok


def test_an_uncited_file_is_found(tmp_path) -> None:
    f = RESULTS / "e2e_gpu.json"
    assert uncited([f], {tmp_path / "a.md": "nothing"}) == ["e2e_gpu.json"]
    assert uncited([f], {tmp_path / "a.md": "rows of `e2e_gpu.json`"}) == []
