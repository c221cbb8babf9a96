"""Two real LMCache engines in two processes, with the plugin loaded from YAML files (helpers).

Test modules import these as ``from engines import ...`` (a conftest module cannot be imported by
name reliably: pytest loads every folder's ``conftest.py`` as the same module name). Harness
rules: a helper that fails to start its process kills it (and whatever it started before); every
wait has a generous, named deadline (a busy 2-core machine runs the engines at a fraction of
their speed).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from cluster import free_port as cluster_free_port
from engine_zygote import ForkedChild, Zygote

ROOT = Path(__file__).resolve().parents[2]
ENGINE_PROC = Path(__file__).with_name("engine_proc.py")

ENGINE_START_TIMEOUT_S = 180.0  # an engine loads torch + LMCache + NIXL: ~20 s alone, far more on a busy machine
REPLY_TIMEOUT_S = 120.0
QUIT_TIMEOUT_S = 30.0
CLEAN_TIMEOUT_S = 30.0  # a shared pair must be clean (every slot free, nothing pending) within this
USE_ZYGOTE = os.environ.get("P2P_ENGINE_ZYGOTE", "1") != "0"  # 0: every engine a fresh interpreter


def free_port() -> int:
    """A free port below the kernel's ephemeral range (engines bind theirs only after start-up)."""
    return cluster_free_port()


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports that were free a moment ago, below the ephemeral range."""
    ports: set[int] = set()
    while len(ports) < count:
        ports.add(cluster_free_port())
    return sorted(ports)


def write_config(path: Path, base: str, lmcache_overrides: dict | None = None, **p2p) -> Path:
    cfg = yaml.safe_load((ROOT / "configs" / base).read_text())
    cfg["max_local_cpu_size"] = 0.25
    cfg.update(lmcache_overrides or {})
    cfg["extra_config"]["p2p"].update({k: v for k, v in p2p.items() if v is not None})
    path.write_text(yaml.safe_dump(cfg))
    return path


class EngineStartError(AssertionError):
    """An engine process did not come up; it has been killed. The message names its log."""


def _start(name: str, env: dict[str, str], log) -> subprocess.Popen | ForkedChild:
    """``python engine_proc.py NAME``, forked from the session's zygote where that is equivalent."""
    zygote = Zygote.shared(env) if USE_ZYGOTE else None
    if zygote is None or not zygote.usable_for(env):
        return subprocess.Popen([sys.executable, str(ENGINE_PROC), name], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, text=True, env=env, start_new_session=True)
    stdin_r, stdin_w = os.pipe()
    stdout_r, stdout_w = os.pipe()
    try:
        pid = zygote.spawn([name], env, stdin_r, stdout_w, log.fileno())
    finally:
        os.close(stdin_r)
        os.close(stdout_w)
    return ForkedChild(pid, os.fdopen(stdin_w, "w"), os.fdopen(stdout_r, "r"))


class EngineProc:
    """A child process running engine_proc.py; ``call`` sends one command and waits for its reply.

    If the engine does not report a loaded plugin within ``start_timeout_s`` the process is
    killed before the error is raised: a failed start never leaves a process behind.
    """

    def __init__(self, name: str, config: Path, log: Path, env_extra: dict[str, str] | None = None,
                 start_timeout_s: float = ENGINE_START_TIMEOUT_S) -> None:
        env = dict(os.environ, LMCACHE_CONFIG_FILE=str(config), PYTHONHASHSEED="0", LMCACHE_TRACK_USAGE="false",
                   **(env_extra or {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}),
                   # keep a caller's PYTHONPATH (e.g. another lmcache version in a --target dir)
                   PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
        self.name = name
        self.log_path = log
        self._log = log.open("w")
        self.proc = _start(name, env, self._log)
        self._replies: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, name=f"engine-{name}-reader", daemon=True).start()
        try:
            hello = self._next(start_timeout_s)
            if not hello.get("ok"):
                raise EngineStartError(f"engine {name} did not load the plugin: {hello}; see {log}")
        except BaseException:
            self.kill()
            raise
        self.lmcache_version = hello.get("lmcache", "?")

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("@@"):
                self._replies.put(json.loads(line[2:]))
            elif not self._log.closed:
                self._log.write(line)
        self._replies.put({"error": "process exited"})

    def _next(self, timeout_s: float) -> dict:
        try:
            return self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"engine {self.name}: no reply within {timeout_s:.0f}s; see {self.log_path}") from None

    def call(self, reply_timeout_s: float = REPLY_TIMEOUT_S, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._next(reply_timeout_s)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the engine's process group now and reap it; idempotent."""
        try:
            os.killpg(self.proc.pid, 9)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(QUIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        if not self._log.closed:
            self._log.close()

    def close(self) -> None:
        """Ask the engine to quit; kill it if it does not within ``QUIT_TIMEOUT_S``. Idempotent."""
        if self.proc.poll() is None:
            try:
                self.call(reply_timeout_s=QUIT_TIMEOUT_S, op="quit")
                self.proc.wait(QUIT_TIMEOUT_S)
            except (AssertionError, BrokenPipeError, OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


class Pair:
    """A decoder engine and a prefiller engine wired to it; either side can be restarted.

    ``receiver_opts`` / ``sender_opts`` are extra ``p2p.*`` keys (None leaves a key out). If the
    second engine fails to start, the first is closed before the error propagates.
    """

    def __init__(self, tmp: Path, buffer_size: str, alloc_timeout_s: float, *, sender_opts: dict | None = None,
                 **receiver_opts) -> None:
        self.tmp = tmp
        self.port, transport_port = free_ports(2)
        self.rcfg = write_config(tmp / "decoder.yaml", "decoder.yaml", buffer_size=buffer_size,
                                 control_ports=[self.port], transport_ports=[transport_port], **receiver_opts)
        self.scfg = write_config(tmp / "prefiller.yaml", "prefiller.yaml", alloc_timeout_s=alloc_timeout_s,
                                 **(sender_opts or {}))
        self.receiver: EngineProc | None = None
        self.sender: EngineProc | None = None
        try:
            self.receiver = self.start_receiver()
            self.sender = self.start_sender()
        except BaseException:
            self.close()
            raise

    def start_receiver(self) -> EngineProc:
        return EngineProc("decoder", self.rcfg, self.tmp / f"decoder-{time.monotonic_ns()}.log")

    def start_sender(self) -> EngineProc:
        return EngineProc("prefiller", self.scfg, self.tmp / f"prefiller-{time.monotonic_ns()}.log")

    def alive(self) -> bool:
        return self.receiver is not None and self.sender is not None and self.receiver.alive() and self.sender.alive()

    def is_clean(self, timeout_s: float = CLEAN_TIMEOUT_S) -> bool:
        """Every receive slot free and nothing pending on the sender, within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.alive():
            try:
                slots = self.receiver.call(op="slots")
                sent = self.sender.call(op="slots")
            except AssertionError:
                return False
            if slots.get("free") == slots.get("capacity") and sent.get("pending") == 0:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return False

    def close(self) -> None:
        for engine in (self.sender, self.receiver):
            if engine is not None:
                engine.close()
