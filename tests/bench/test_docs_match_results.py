"""BENCHMARKS.md and README.md against bench/results: every table is a marked block that ``make figures``
renders from a results file, and each block as committed equals what its file renders."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = ("BENCHMARKS.md", "README.md")
OPEN = re.compile(r"^<!-- table:([\w.-]+) -->$")
CLOSE = re.compile(r"^<!-- /table:([\w.-]+) -->$")
# Tables of words, not of measurements: BENCHMARKS' index of commands and README's "why" against other stacks
# (each of its figures names its results file in the row).
WORD_TABLES = ("| table | command | machine | results file |", "| what goes wrong elsewhere | what lmcache_p2p does |")


def tables_outside_blocks(text: str) -> list[str]:
    """The header line of every markdown table not inside a ``<!-- table:NAME -->`` block."""
    out, inside, previous = [], None, ""
    for line in text.splitlines():
        if (m := OPEN.match(line)) is not None:
            inside = m.group(1)
        elif CLOSE.match(line):
            inside = None
        elif line.startswith("|") and not previous.startswith("|") and inside is None:
            out.append(line)
        previous = line
    return out


def test_every_table_of_the_docs_is_a_marked_block() -> None:
    for name in DOCS:
        stray = [h for h in tables_outside_blocks((REPO / name).read_text()) if h not in WORD_TABLES]
        assert stray == [], f"{name}: a table typed by hand; render it from its results file (bench/report.py)"


def test_tables_outside_blocks_finds_a_hand_table() -> None:
    text = "a\n<!-- table:x -->\n| a |\n|---|\n<!-- /table:x -->\n\n| b |\n|---|\n| 1 |\n"
    assert tables_outside_blocks(text) == ["| b |"]


def test_every_marked_block_equals_what_its_results_file_renders(report, tmp_path) -> None:
    copies = []
    for name in DOCS:
        shutil.copy(REPO / name, tmp_path / name)
        copies.append(tmp_path / name)
    assert report.main(["--markdown", *map(str, copies), "--docs", str(tmp_path / "docs"), "--no-plots"]) == 0
    for name, copy in zip(DOCS, copies):
        assert copy.read_text() == (REPO / name).read_text(), f"{name} differs from bench/results: run make figures"
        blocks = [m.group(1) for line in copy.read_text().splitlines() if (m := OPEN.match(line))]
        empty = [b for b in blocks if f"<!-- table:{b} -->\n<!-- /table:{b} -->" in copy.read_text()]
        assert empty == [], f"{name}: blocks no results file fills: {empty}"
