"""What a newcomer reads first: ``launch --help``, the warnings of a launch, the demo's output."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from lmcache_p2p.cli import demo, launch
from lmcache_p2p.cli.main import build_parser


def launch_parser():
    sub = build_parser()._subparsers._group_actions[0]  # noqa: SLF001 (argparse keeps subparsers there)
    return sub.choices["launch"]


def test_launch_help_has_no_rest_markup_and_a_text_for_every_flag() -> None:
    parser = launch_parser()
    text = parser.format_help()
    assert "``" not in text
    assert "--policy {round_robin,least_loaded,prefix}" in text
    undocumented = [a.option_strings for a in parser._actions if a.option_strings and not a.help]
    assert undocumented == []
    kv_help = next(a.help for a in parser._actions if "--kv-port" in a.option_strings)
    assert "7400 + 10*i" in kv_help and "7500" not in text


def test_a_launch_without_prefillers_says_nothing_is_disaggregated(caplog) -> None:
    caplog.set_level(logging.WARNING)
    launch.warn_not_disaggregated(build_parser().parse_args(["launch", "--prefill", "0", "--decode", "1"]))
    assert "0P1D: no prefillers, so nothing is disaggregated" in caplog.text
    caplog.clear()
    launch.warn_not_disaggregated(build_parser().parse_args(["launch", "--prefill", "1", "--decode", "1"]))
    assert caplog.text == ""


@pytest.fixture
def fake_proxy(stub_server):
    return stub_server({
        ("POST", "/v1/completions"): json.dumps({"choices": [{"text": "C\ufffdba mabw"}],
                                                 "usage": {"prompt_tokens": 201}}),
        ("GET", "/stats"): json.dumps({"handover_ms": {"p50": 12.5}}),
        ("GET", "/metrics"): "# HELP x\nlmcache_p2p_proxy_kv_bytes_total 4096.0\n",
    })


def test_the_demo_says_what_its_text_is_and_what_proves_the_disaggregation(fake_proxy, tmp_path: Path) -> None:
    (tmp_path / "decoder-0.log").write_text(
        "INFO Reqid: x, Total tokens 202, Inference Engine computed tokens: 0, LMCache hit tokens: 201\n")
    lines = demo.demo_request(fake_proxy, Path("/m"), tmp_path, tiny_model=True)
    text = "\n".join(lines)
    assert "demo completion through the proxy: 'C\ufffdba mabw'" in text
    assert "random weights: gibberish text is expected" in text
    assert "what proves the disaggregation:" in text
    assert "decoder-0 loaded 201 of the 202 tokens it looked up from the prefiller's KV" in text
    assert "KV moved prefiller -> decoder: 4096 bytes" in text and "12.5 ms" in text
    real = "\n".join(demo.demo_request(fake_proxy, Path("/m"), tmp_path, tiny_model=False))
    assert "gibberish" not in real
