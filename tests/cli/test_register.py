"""``lmcache-p2p register`` (a vLLM connector's pod's sidecar) and ``drain --missing-ok``: against the real proxy
(its own process, with a shared secret) and, for the order of the calls, against a recording fake transport."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from lmcache_p2p.cli import drain, register
from lmcache_p2p.cli.main import build_parser, main
from lmcache_p2p.cli.register import Refused, Registration, keep_registered

from .conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
SECRET = "registrar-test-secret"
# generous: the machine's cores are shared, and each process imports the CLI first
START_TIMEOUT_S = 90.0
EVENTUALLY_TIMEOUT_S = 60.0
EXIT_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 30.0
INTERVAL_S = 0.2
REG = Registration.of("http://proxy:9100", "decoder", "http://10.0.0.9:7200", "vllm-nixl")


def eventually(condition: Callable[[], bool], timeout_s: float = EVENTUALLY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s"
        time.sleep(0.05)


class Proxy:
    """``lmcache-p2p proxy`` as the proxy pod runs it (the secret from its environment), on a fixed port."""

    def __init__(self, port: int, env: dict[str, str], log: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        with log.open("a") as out:  # printed when a test fails (pytest shows what it printed)
            # no tokenizer: its library's import (torch) would take most of a loaded machine's start-up deadline
            argv = [sys.executable, "-m", "lmcache_p2p.cli.main", "proxy", "--port", str(port),
                    "--control-port", str(free_port()), "--tokenizer", "none"]
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=out)
        try:
            eventually(self._up, START_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise

    def _up(self) -> bool:
        assert self.proc.poll() is None, f"the proxy exited with {self.proc.returncode}"
        try:
            return httpx.get(f"{self.url}/health", timeout=REQUEST_TIMEOUT_S).status_code == 200
        except httpx.HTTPError:
            return False

    def listed(self) -> list[str]:
        resp = httpx.get(f"{self.url}/instances", params={"all": "1"}, timeout=REQUEST_TIMEOUT_S,
                         headers={"authorization": f"Bearer {SECRET}"})
        assert resp.status_code == 200, resp.text
        return [i["instance_id"] for i in resp.json()]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(EXIT_TIMEOUT_S)


@pytest.fixture
def env() -> dict[str, str]:
    return {**os.environ, "LMCACHE_P2P_SECRET": SECRET, "PYTHONPATH": str(ROOT)}


def registrar(proxy_url: str, url: str, env: dict[str, str], log: Path, *extra: str) -> subprocess.Popen:
    with log.open("a") as out:
        return subprocess.Popen([sys.executable, "-m", "lmcache_p2p.cli.main", "register", "--proxy", proxy_url,
                                 "--role", "decoder", "--url", url, "--interval-s", str(INTERVAL_S), *extra],
                                env=env, stdout=out, stderr=out)


def print_logs(*logs: Path) -> None:
    for log in logs:
        print(f"---- {log.name}\n{log.read_text() if log.exists() else ''}")


def test_the_sidecar_keeps_a_restarted_proxy_told_and_drains_the_instance_when_stopped(env, tmp_path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: registered, never routable
    wanted = Registration.of("", "decoder", url, "vllm-nixl").instance_id
    logs = tmp_path / "proxy.log", tmp_path / "registrar.log"
    proxy = Proxy(port, env, logs[0])
    child = registrar(proxy.url, url, env, logs[1], "--alive-file", str(tmp_path / "alive"))
    try:
        eventually(lambda: wanted in proxy.listed())
        proxy.stop()
        proxy = Proxy(port, env, logs[0])  # a new proxy knows nothing
        eventually(lambda: wanted in proxy.listed())  # told again within the interval
        assert int((tmp_path / "alive").read_text()) > time.time()
        child.send_signal(signal.SIGTERM)
        assert child.wait(EXIT_TIMEOUT_S) == 0
        assert wanted not in proxy.listed()  # drained: idle, so forgotten at once
        time.sleep(5 * INTERVAL_S)
        assert wanted not in proxy.listed()  # and never registered again
        # the pod's preStop drains the same id: nothing is left to wait for
        assert drain.drain(proxy.url, wanted, timeout_s=5, secret=SECRET, missing_ok=True)
        with pytest.raises(SystemExit, match="no instance"):
            drain.drain(proxy.url, wanted, timeout_s=5, secret=SECRET)
    finally:
        child.kill()
        child.wait(EXIT_TIMEOUT_S)
        proxy.stop()
        print_logs(*logs)


@pytest.mark.parametrize(("secret", "status"), [("another-secret", "403"), (None, "401")])
def test_a_sidecar_without_the_proxys_secret_stops_with_an_error_that_says_where_the_secret_comes_from(
        env, secret, status, tmp_path) -> None:
    logs = tmp_path / "proxy.log", tmp_path / "registrar.log"
    proxy = Proxy(free_port(), env, logs[0])
    mine = {k: v for k, v in env.items() if k != "LMCACHE_P2P_SECRET"} | ({"LMCACHE_P2P_SECRET": secret} if secret
                                                                          else {})
    child = registrar(proxy.url, "http://127.0.0.1:1", mine, logs[1])
    try:
        assert child.wait(EXIT_TIMEOUT_S) == 2
        err = logs[1].read_text()
        assert f"({status})" in err and "$LMCACHE_P2P_SECRET" in err and "--shared-secret" in err
        assert proxy.listed() == []
    finally:
        child.kill()
        child.wait(EXIT_TIMEOUT_S)
        proxy.stop()
        print_logs(*logs)


class Recorder:
    """A proxy that records every call and answers ``statuses`` in turn (then 200); raises for ``None``."""

    def __init__(self, *statuses: int | None, stop_after: int = 3) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.statuses = list(statuses)
        self.stop = threading.Event()
        self.stop_after = stop_after

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls.append((request.url.path, json.loads(request.content)))
        if len([c for c in self.calls if c[0] == "/instances/register"]) >= self.stop_after:
            self.stop.set()  # as SIGTERM would, while this call is in flight
        status = self.statuses.pop(0) if self.statuses else 200
        if status is None:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(status, json={"error": {"message": "said no"}})


def run_loop(rec: Recorder) -> None:
    with httpx.Client(transport=httpx.MockTransport(rec)) as client:
        keep_registered(client, REG, rec.stop, 0.001, {"authorization": "Bearer x"})


def test_it_registers_until_stopped_then_drains_the_same_id_after_its_last_registration() -> None:
    rec = Recorder(None, 503, stop_after=4)  # unreachable, then failing: tried again each interval
    run_loop(rec)
    paths = [path for path, _ in rec.calls]
    assert paths == ["/instances/register"] * 4 + ["/instances/drain"]
    assert rec.calls[0][1] == {"role": "decoder", "url": "http://10.0.0.9:7200", "backend": "vllm-nixl"}
    assert rec.calls[-1][1] == {"instance_id": "vllm-nixl-decoder-http://10.0.0.9:7200"}


@pytest.mark.parametrize("status", [400, 401, 403, 404])
def test_an_answer_that_the_registration_is_wrong_ends_it(status: int) -> None:
    rec = Recorder(200, status, stop_after=99)
    with pytest.raises(Refused, match=f"refused the registration of http://10.0.0.9:7200 \\({status}\\): said no"):
        run_loop(rec)
    assert [path for path, _ in rec.calls] == ["/instances/register"] * 2


@pytest.mark.parametrize(("argv", "flag"), [
    (["--url", "10.0.0.9:7200"], "--url"),
    (["--url", "http://10.0.0.9:7200", "--interval-s", "0"], "--interval-s"),
    (["--url", "http://10.0.0.9:7200", "--request-timeout-s", "nan"], "--request-timeout-s"),
    (["--url", "http://10.0.0.9:7200", "--interval-s", "10", "--ttl-s", "10"], "--ttl-s"),
    (["--url", "http://10.0.0.9:7200", "--ttl-s", "-1"], "--ttl-s"),
    (["--url", "http://10.0.0.9:7200", "--ttl-s", "inf"], "--ttl-s"),
])
def test_bad_flags_are_refused_naming_the_flag(argv: list[str], flag: str, capsys) -> None:
    assert main(["register", "--proxy", "http://proxy:9100", "--role", "decoder", *argv]) == 2
    assert f"error: {flag}: " in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "ttl_s"), [([], 30.0), (["--interval-s", "2"], 6.0), (["--ttl-s", "12.5"], 12.5),
                                             (["--ttl-s", "0"], None)])
def test_it_sends_the_ttl_s_of_its_flags_three_intervals_by_default(argv: list[str], ttl_s: float | None) -> None:
    args = build_parser().parse_args(["register", "--proxy", "http://proxy:9100", "--role", "decoder", "--url",
                                      "http://10.0.0.9:7200", *argv])
    rec = Recorder(stop_after=1)
    with httpx.Client(transport=httpx.MockTransport(rec)) as client:
        keep_registered(client, register.check(args), rec.stop, 0.001, {})
    sent = rec.calls[0][1]
    assert sent.get("ttl_s") == ttl_s and ("ttl_s" in sent) is (ttl_s is not None)  # 0: sent without, never expires


def test_a_pod_killed_without_its_drain_leaves_the_proxy_within_its_ttl(env, tmp_path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    wanted = Registration.of("", "decoder", url, "vllm-nixl").instance_id
    logs = tmp_path / "proxy.log", tmp_path / "registrar.log"
    proxy = Proxy(free_port(), env, logs[0])
    child = registrar(proxy.url, url, env, logs[1], "--ttl-s", "3")
    try:
        eventually(lambda: wanted in proxy.listed())
        time.sleep(5 * INTERVAL_S)
        assert wanted in proxy.listed()  # each registration renews it
        child.kill()  # no SIGTERM: no drain (node lost, OOM kill)
        child.wait(EXIT_TIMEOUT_S)
        eventually(lambda: wanted not in proxy.listed())  # gone without a request, by the proxy's sweep
    finally:
        child.kill()
        child.wait(EXIT_TIMEOUT_S)
        proxy.stop()
        print_logs(*logs)


def test_the_id_it_drains_is_the_one_the_proxy_registers_it_under() -> None:
    from lmcache_p2p.proxy.router.registry import Registry
    from lmcache_p2p.proxy.settings import registration

    for role in register.ROLES:
        reg = Registration.of("http://proxy:9100", role, "http://10.0.0.9:7200/", "vllm-nixl")
        assert Registry(ttl_s=10).register(registration(role, reg.url, reg.backend)).instance_id == reg.instance_id
