"""Entry point of ``lmcache-p2p``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    from lmcache_p2p.cli import drain, launch, tiny_model
    from lmcache_p2p.proxy import server as proxy_server

    parser = argparse.ArgumentParser(prog="lmcache-p2p", description="Prefill/decode disaggregation for vLLM")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)
    launch.add_parser(sub)
    tiny_model.add_parser(sub)
    drain.add_parser(sub)
    proxy = sub.add_parser("proxy", help="run the OpenAI-compatible PD proxy alone")
    proxy_server.add_arguments(proxy)
    proxy.set_defaults(func=proxy_server.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
