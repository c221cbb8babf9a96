"""Two real LMCache engines in two processes, with the plugin loaded from YAML files."""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ENGINE_PROC = Path(__file__).with_name("engine_proc.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(path: Path, base: str, **p2p) -> Path:
    cfg = yaml.safe_load((ROOT / "configs" / base).read_text())
    cfg["max_local_cpu_size"] = 0.25
    cfg["extra_config"]["p2p"].update(p2p)
    path.write_text(yaml.safe_dump(cfg))
    return path


class EngineProc:
    """A child process running engine_proc.py; ``call`` sends one command and waits for its reply."""

    def __init__(self, name: str, config: Path, log: Path) -> None:
        env = dict(os.environ, LMCACHE_CONFIG_FILE=str(config), PYTHONHASHSEED="0", LMCACHE_TRACK_USAGE="false",
                   UCX_TLS="tcp,self", UCX_NET_DEVICES="lo", PYTHONPATH=str(ROOT))
        self.log_path = log
        self._log = log.open("w")
        self.proc = subprocess.Popen([sys.executable, str(ENGINE_PROC), name], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        self._replies: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        hello = self._next(90)
        assert hello.get("ok"), f"engine {name} did not load the plugin: {hello}; see {log}"

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


@pytest.fixture
def engine_pair(tmp_path):
    """Start (receiver, sender); the receiver's buffer size can be chosen by the test."""
    procs: list[EngineProc] = []

    def start(buffer_size: str = "64MB", alloc_timeout_s: float = 5.0, **receiver_opts):
        port = free_port()
        rcfg = write_config(tmp_path / "decoder.yaml", "decoder.yaml", buffer_size=buffer_size,
                            control_ports=[port], transport_ports=[free_port()], **receiver_opts)
        scfg = write_config(tmp_path / "prefiller.yaml", "prefiller.yaml", alloc_timeout_s=alloc_timeout_s)
        receiver = EngineProc("decoder", rcfg, tmp_path / "decoder.log")
        procs.append(receiver)
        sender = EngineProc("prefiller", scfg, tmp_path / "prefiller.log")
        procs.append(sender)
        return receiver, sender, port

    yield start
    for p in reversed(procs):
        p.close()
