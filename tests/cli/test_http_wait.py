"""``python -m lmcache_p2p.cli.http_wait``: the order between a pod's containers, against a real local HTTP server
(the pods' own uses: tests/cli/test_deploy_kubernetes_lmcache_mp.py)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmcache_p2p.cli import http_wait

from .conftest import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_an_error_status_is_not_up_and_a_refused_connection_is_down(health) -> None:
    handler, port = health
    url = f"http://127.0.0.1:{port}/healthcheck"
    assert not http_wait.answers(url)  # 503
    handler.status = 200
    assert http_wait.answers(url)
    closed = f"http://127.0.0.1:{free_port()}/health"
    assert not http_wait.answers(closed)
    assert http_wait.wait(closed, http_wait.Until.DOWN, timeout_s=0)


def test_a_zero_timeout_makes_exactly_one_attempt_and_the_deadline_bounds_the_wait() -> None:
    seen: list[str] = []
    assert not http_wait.wait("u", http_wait.Until.UP, timeout_s=0,
                              probe=lambda u: seen.append(u) or http_wait.Answer.NOT_OK)
    assert seen == ["u"]
    start = time.monotonic()
    assert not http_wait.wait("u", http_wait.Until.UP, timeout_s=0.5, every_s=0.1,
                              probe=lambda u: http_wait.Answer.NOT_OK)
    assert time.monotonic() - start < 2.0


def test_an_answer_late_once_is_not_down_three_in_a_row_are(health) -> None:
    """A draining vLLM that answers /health late is still up: the LMCache server must outlive it."""
    handler, port = health
    handler.status, handler.delay_s = 200, 0.6
    url = f"http://127.0.0.1:{port}/health"
    assert http_wait.probe(url, timeout_s=0.2) is http_wait.Answer.SILENT
    Answer = http_wait.Answer
    answers = iter([Answer.SILENT, Answer.OK, Answer.SILENT, Answer.SILENT, Answer.OK])
    assert not http_wait.wait("u", http_wait.Until.DOWN, timeout_s=0.5, every_s=0.1, probe=lambda u: next(answers))
    answers = iter([Answer.SILENT, Answer.OK, Answer.SILENT, Answer.SILENT, Answer.SILENT])
    assert http_wait.wait("u", http_wait.Until.DOWN, timeout_s=5, every_s=0.01, probe=lambda u: next(answers))


def test_the_proxy_of_the_environment_is_not_used(health, monkeypatch: pytest.MonkeyPatch) -> None:
    handler, port = health
    handler.status = 200
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    assert http_wait.answers(f"http://127.0.0.1:{port}/")


def test_as_a_command_it_execs_what_follows_once_up_and_refuses_a_negative_timeout(health, tmp_path) -> None:
    handler, port = health
    handler.status = 200
    marker = tmp_path / "ran"
    done = subprocess.run([sys.executable, "-m", "lmcache_p2p.cli.http_wait", "--url", f"http://127.0.0.1:{port}/",
                           "--timeout-s", "5", "--", sys.executable, "-c", f"open({str(marker)!r}, 'w').write('x')"],
                          capture_output=True, text=True, timeout=30, env={"PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and marker.read_text() == "x"
    assert http_wait.main(["--url", "http://127.0.0.1:1/", "--timeout-s", "-1"]) == 2
