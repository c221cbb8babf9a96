#!/usr/bin/env python3
"""The test suite's figures from a pytest JUnit XML report: wall time, counts and the slowest tests.

    scripts/suite_report.py logs/junit.xml --wall-s 812 [--out bench/results/test_suite.json]

``make test`` writes the report and calls this with the wall time it measured around pytest;
README's test-suite sentence comes from ``bench/results/test_suite.json`` made this way on a fresh
clone (``make figures`` renders it).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

SLOWEST = 10


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def summarize(junit: Path, wall_s: float) -> dict:
    root = ET.parse(junit).getroot()
    cases = list(root.iter("testcase"))
    passed = skipped = failed = 0
    timed: list[tuple[float, str]] = []
    for case in cases:
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        timed.append((float(case.get("time") or 0.0), name))
        if case.find("skipped") is not None:
            skipped += 1
        elif case.find("failure") is not None or case.find("error") is not None:
            failed += 1
        else:
            passed += 1
    timed.sort(reverse=True)
    return {"commit": commit(), "wall_s": round(wall_s, 1), "passed": passed, "skipped": skipped,
            "failed": failed, "tests_s": round(sum(t for t, _ in timed), 1),
            "slowest": [{"test": name, "seconds": round(t, 1)} for t, name in timed[:SLOWEST]]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("junit", type=Path)
    parser.add_argument("--wall-s", type=float, required=True, help="wall time of the whole pytest run")
    parser.add_argument("--out", type=Path, help="write the JSON here too")
    args = parser.parse_args(argv)
    report = summarize(args.junit, args.wall_s)
    text = json.dumps(report, indent=2) + "\n"
    if args.out:
        args.out.write_text(text)
    print(f"make test: {report['passed']} passed, {report['skipped']} skipped, {report['failed']} failed "
          f"in {report['wall_s']:.0f} s of wall time ({report['wall_s'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
