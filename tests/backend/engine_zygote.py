"""Start engine processes by fork from one process that has already imported torch, LMCache and NIXL.

An engine process spends most of its start-up importing (torch, LMCache with transformers, NIXL:
~10 s of CPU, far more wall time on a busy 2-core machine), and the engine-level tests start dozens
of them. The zygote imports once; each engine is then a fork of it that sets its own environment,
takes its stdin/stdout/stderr from the test (file descriptors passed over a Unix socket) and runs
``engine_proc.py`` as ``__main__``, exactly as ``python engine_proc.py NAME`` would after its imports.

Used only where a fork is equivalent to a fresh interpreter: the child's import-time environment
(PYTHONPATH, PYTHONHASHSEED) equals the zygote's, no CUDA device (CUDA does not survive fork) and the
zygote has no thread but torch's own (``fork_safe``). ``EngineProc`` falls back to a plain subprocess otherwise.

    zygote = Zygote.shared(env)          # one per test session, started on first use
    child = zygote.spawn(argv, env, stdin_fd, stdout_fd, stderr_fd)  # -> ForkedChild (Popen-like)
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ENGINE_PROC = Path(__file__).with_name("engine_proc.py")
IMPORT_ENV = ("PYTHONPATH", "PYTHONHASHSEED")  # what a fork cannot change after the interpreter started
START_TIMEOUT_S = 300.0


class ForkedChild:
    """The parts of ``subprocess.Popen`` the engine harness uses, for a process that is not our child.

    The zygote reaps its children; exit is seen through a pidfd, and the exit status is not known
    (``returncode`` is -1 once the process is gone).
    """

    def __init__(self, pid: int, stdin, stdout) -> None:
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.returncode: int | None = None
        self._pidfd = os.pidfd_open(pid)

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._pidfd], [], [], 0)[0]:
            self._gone()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._pidfd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            self._gone()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            signal.pidfd_send_signal(self._pidfd, sig)

    def _gone(self) -> None:
        self.returncode = -1
        os.close(self._pidfd)


class Zygote:
    _shared: Zygote | None = None
    _lock = threading.Lock()

    @classmethod
    def shared(cls, env: dict[str, str]) -> Zygote:
        """The session's zygote, started on first use with ``env`` (the first engine's environment)."""
        with cls._lock:
            if cls._shared is None or cls._shared._proc.poll() is not None:
                cls._shared = cls(env)
                atexit.register(cls._shared.close)
            return cls._shared

    def __init__(self, env: dict[str, str]) -> None:
        self._dir = tempfile.mkdtemp(prefix="engine-zygote-")
        self.path = os.path.join(self._dir, "sock")
        self.import_env = {k: env.get(k, "") for k in IMPORT_ENV}
        self._proc = subprocess.Popen([sys.executable, __file__, self.path], env=env, stdout=subprocess.PIPE,
                                      text=True, start_new_session=True)
        ready, _, _ = select.select([self._proc.stdout], [], [], START_TIMEOUT_S)
        line = self._proc.stdout.readline() if ready else ""
        self.fork_safe = line.strip() == "ready"
        self._spawn_lock = threading.Lock()

    def usable_for(self, env: dict[str, str]) -> bool:
        return (self.fork_safe and self._proc.poll() is None and not env.get("P2P_ENGINE_DEVICE")
                and all(env.get(k, "") == v for k, v in self.import_env.items()))

    def spawn(self, argv: list[str], env: dict[str, str], stdin_fd: int, stdout_fd: int, stderr_fd: int) -> int:
        """Fork an engine running ``engine_proc.py argv...`` with ``env``; returns its pid."""
        with self._spawn_lock, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(self.path)
            socket.send_fds(sock, [json.dumps({"argv": argv, "env": env}).encode()], [stdin_fd, stdout_fd, stderr_fd])
            reply = sock.makefile().readline()
        return int(json.loads(reply)["pid"])

    def close(self) -> None:
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._proc.wait(30)


def _serve(path: str) -> None:
    """The zygote: import what every engine imports, then fork one engine per request."""
    import torch  # noqa: F401

    # torch starts one helper thread at import; forking beside it is what DataLoader workers do.
    torch_threads = len(os.listdir("/proc/self/task"))
    import lmcache.v1.cache_engine  # noqa: F401
    import msgspec  # noqa: F401
    import nixl._api  # noqa: F401

    import lmcache_p2p.backend  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the engines; the tests watch pidfds
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    threads = len(os.listdir("/proc/self/task"))  # native threads too: a fork keeps only the calling one
    print("ready" if threads <= torch_threads else f"not fork-safe: {threads} threads", flush=True)
    while True:
        conn, _ = server.accept()
        with conn:
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            req = json.loads(msg)
            pid = os.fork()
            if pid == 0:
                server.close()
                _become_engine(req, fds)
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def _become_engine(req: dict, fds: list[int]) -> None:
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", closefd=False)
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = [str(ENGINE_PROC), *req["argv"]]
        runpy.run_path(str(ENGINE_PROC), run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: engine_zygote.py SOCKET_PATH")
    _serve(sys.argv[1])
