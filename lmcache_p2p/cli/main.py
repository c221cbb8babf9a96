"""Entry point of ``lmcache-p2p``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    from lmcache_p2p.cli import bench, deploy, drain, launch, register, tiny_model
    from lmcache_p2p.proxy import server as proxy_server

    parser = argparse.ArgumentParser(prog="lmcache-p2p", description="Prefill/decode disaggregation for vLLM")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)
    launch.add_parser(sub)
    deploy.add_parser(sub)
    tiny_model.add_parser(sub)
    drain.add_parser(sub)
    register.add_parser(sub)
    bench.add_parser(sub)
    proxy = sub.add_parser("proxy", help="run the OpenAI-compatible PD proxy alone")
    proxy_server.add_arguments(proxy)
    proxy.set_defaults(func=proxy_server.run)
    return parser


def split_passthrough(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``launch ... -- --enforce-eager --load-format dummy``: what follows ``--`` goes to every vLLM server."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    at = argv.index("--")
    return argv[:at], argv[at + 1:]


def main(argv: Sequence[str] | None = None) -> int:
    own, passthrough = split_passthrough(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(own)
    if args.command == "bench":  # every flag it does not know is vllm bench serve's
        args.vllm_args = [*unknown, *passthrough]
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    elif passthrough:
        if args.command not in ("launch", "deploy"):
            parser.error(f"arguments after -- are vLLM's and only `launch`, `deploy` and `bench` take them: "
                         f"{passthrough}")
        args.vllm_arg = [*args.vllm_arg, *passthrough]
    args.argv = [*own, *(["--", *passthrough] if passthrough else [])]  # as given (deploy prints it)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore"):  # a line per prefill request or health probe: plumbing, not news
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(args.log_level)))
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
