"""Two real LMCache engines in two processes, with the plugin loaded from YAML files."""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ENGINE_PROC = Path(__file__).with_name("engine_proc.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(path: Path, base: str, lmcache_overrides: dict | None = None, **p2p) -> Path:
    cfg = yaml.safe_load((ROOT / "configs" / base).read_text())
    cfg["max_local_cpu_size"] = 0.25
    cfg.update(lmcache_overrides or {})
    cfg["extra_config"]["p2p"].update(p2p)
    path.write_text(yaml.safe_dump(cfg))
    return path


class EngineProc:
    """A child process running engine_proc.py; ``call`` sends one command and waits for its reply."""

    def __init__(self, name: str, config: Path, log: Path, env_extra: dict[str, str] | None = None) -> None:
        env = dict(os.environ, LMCACHE_CONFIG_FILE=str(config), PYTHONHASHSEED="0", LMCACHE_TRACK_USAGE="false",
                   **(env_extra or {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}),
                   # keep a caller's PYTHONPATH (e.g. another lmcache version in a --target dir)
                   PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
        self.log_path = log
        self._log = log.open("w")
        self.proc = subprocess.Popen([sys.executable, str(ENGINE_PROC), name], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        self._replies: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        hello = self._next(90)
        assert hello.get("ok"), f"engine {name} did not load the plugin: {hello}; see {log}"
        self.lmcache_version = hello.get("lmcache", "?")

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("@@"):
                self._replies.put(json.loads(line[2:]))
            else:
                self._log.write(line)
        self._replies.put({"error": "process exited"})

    def _next(self, timeout_s: float) -> dict:
        try:
            return self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"no reply within {timeout_s}s; see {self.log_path}") from None

    def call(self, reply_timeout_s: float = 60, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._next(reply_timeout_s)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(reply_timeout_s=20, op="quit")
            except (AssertionError, BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


class Pair:
    """A decoder engine and a prefiller engine wired to it; either side can be restarted."""

    def __init__(self, tmp: Path, buffer_size: str, alloc_timeout_s: float, sender_opts: dict | None = None,
                 **receiver_opts) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.rcfg = write_config(tmp / "decoder.yaml", "decoder.yaml", buffer_size=buffer_size,
                                 control_ports=[self.port], transport_ports=[free_port()], **receiver_opts)
        self.scfg = write_config(tmp / "prefiller.yaml", "prefiller.yaml", alloc_timeout_s=alloc_timeout_s,
                                 **(sender_opts or {}))
        self.receiver = self.start_receiver()
        self.sender = self.start_sender()

    def start_receiver(self) -> EngineProc:
        return EngineProc("decoder", self.rcfg, self.tmp / f"decoder-{time.monotonic_ns()}.log")

    def start_sender(self) -> EngineProc:
        return EngineProc("prefiller", self.scfg, self.tmp / f"prefiller-{time.monotonic_ns()}.log")

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """One pair shared by the tests of a module: engines take ~20 s each to start on 2 cores."""
    p = Pair(tmp_path_factory.mktemp("pair"), buffer_size="64MB", alloc_timeout_s=5.0)
    yield p
    p.close()


@pytest.fixture
def make_pair(tmp_path):
    """A pair of the test's own, for tests that change settings or kill processes."""
    made: list[Pair] = []

    def make(buffer_size: str = "64MB", alloc_timeout_s: float = 5.0, sender_opts: dict | None = None,
             **receiver_opts) -> Pair:
        made.append(Pair(tmp_path, buffer_size, alloc_timeout_s, sender_opts, **receiver_opts))
        return made[-1]

    yield make
    for p in made:
        p.close()
