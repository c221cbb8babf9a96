"""``lmcache-p2p``'s entry point."""

from __future__ import annotations

import argparse
import logging

import pytest

from lmcache_p2p.cli import main as cli_main


@pytest.mark.parametrize("level, httpx_level", [("INFO", logging.WARNING), ("DEBUG", logging.WARNING),
                                                 ("ERROR", logging.ERROR)])
def test_http_client_request_lines_are_not_logged_at_info(monkeypatch, level, httpx_level) -> None:
    """The proxy's prefill calls and the launcher's health probes go through httpx, which logs one INFO
    line per request: that is plumbing, not news, so it is kept at WARNING (or the chosen level above)."""
    def parser() -> argparse.ArgumentParser:
        p = argparse.ArgumentParser()
        p.add_argument("--log-level", default="INFO")
        p.set_defaults(func=lambda args: 0, command="noop")
        return p

    monkeypatch.setattr(cli_main, "build_parser", parser)
    for name in ("httpx", "httpcore"):
        monkeypatch.setattr(logging.getLogger(name), "level", logging.NOTSET)
    root = logging.getLogger()
    monkeypatch.setattr(root, "level", root.level)
    assert cli_main.main(["--log-level", level]) == 0
    assert logging.getLogger("httpx").level == httpx_level
    assert logging.getLogger("httpcore").level == httpx_level
