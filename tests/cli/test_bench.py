"""``lmcache-p2p bench``: vllm bench serve from the project's environment, the proxy's URL and model filled in."""

from __future__ import annotations

import json

import pytest

from lmcache_p2p.cli import bench
from lmcache_p2p.cli.main import main

pytest.importorskip("vllm")


@pytest.fixture
def models_server(stub_server):
    return stub_server({("GET", "/v1/models"): json.dumps({"object": "list", "data": [{"id": "/models/served"}]})})


def test_defaults_are_the_proxy_and_the_model_it_serves(models_server) -> None:
    args = bench.bench_args(["--base-url", models_server, "--num-prompts", "3"])
    assert (args.backend, args.endpoint, args.base_url) == ("vllm", "/v1/completions", models_server)
    assert args.model == "/models/served" and args.num_prompts == 3
    mine = bench.bench_args(["--base-url", models_server, "--model", "/other", "--backend", "openai"])
    assert (mine.model, mine.backend) == ("/other", "openai")  # the user's flags win


def test_no_deployment_is_a_clear_error() -> None:
    with pytest.raises(SystemExit, match=r"--model not given and http://127\.0\.0\.1:9/v1/models did not name one"):
        bench.bench_args(["--base-url", "http://127.0.0.1:9"])


def test_vllm_bench_flags_pass_through_the_cli(monkeypatch) -> None:
    seen = {}
    monkeypatch.setattr(bench, "run_bench", lambda vllm_args: seen.setdefault("args", list(vllm_args)) and {})
    assert main(["bench", "--num-prompts", "4", "--random-input-len", "32"]) == 0
    assert seen["args"] == ["--num-prompts", "4", "--random-input-len", "32"]
    with pytest.raises(SystemExit):
        main(["launch", "--num-prompts", "4"])  # unknown to launch: refused, not passed on


@pytest.mark.vllm
def test_bench_runs_against_a_real_server(plain_tiny) -> None:
    url = plain_tiny.get().health_url.removesuffix("/health")  # the shared plain instance (tests/conftest.py)
    result = bench.run_bench(["--base-url", url, "--dataset-name", "random", "--random-input-len", "32",
                              "--random-output-len", "4", "--num-prompts", "4", "--ignore-eos"])
    assert result["completed"] == 4 and result["failed"] == 0
