"""The ports a launch listens on: checked before anything starts, and who answers on one.

Linux only where it says who: a listening socket is found in ``/proc/net/tcp`` / ``tcp6`` by its
port, and its owner by the ``socket:[inode]`` link among ``/proc/<pid>/fd``. Both checks degrade to
"cannot tell" (never to a wrong answer) where ``/proc`` is not readable.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Iterable, Sequence
from pathlib import Path

from lmcache_p2p.errors import StartupError

PROC = Path("/proc")
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's state column


@dataclasses.dataclass(frozen=True)
class PortUse:
    """One port the launch will listen on and what for (named in errors)."""

    port: int
    purpose: str  # e.g. "proxy HTTP (--proxy-port)"
    name: str = ""  # an instance's port as a pod names it: http, kv-R, nccl-R, side-channel


@dataclasses.dataclass(frozen=True)
class Holder:
    """A process that listens on a port."""

    pid: int
    command: str

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.command})"


def check_ports_free(uses: Sequence[PortUse], host: str = "127.0.0.1", proc: Path = PROC) -> None:
    """Raise StartupError naming the first port that two uses share or that something else holds."""
    seen: dict[int, PortUse] = {}
    for use in uses:
        if use.port in seen:
            raise StartupError(f"port {use.port} is planned twice: {seen[use.port].purpose} and {use.purpose}; "
                               "move one of the port flags")
        seen[use.port] = use
    for use in uses:
        if not bindable(use.port, host):
            holders = holders_of(use.port, proc)
            held = f" by {', '.join(map(str, holders))}" if holders else " (holder not visible)"
            raise StartupError(f"port {use.port} for {use.purpose} is in use{held}; nothing was started: stop "
                               "that process or choose other ports")


def bindable(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on ``host:port`` now (TIME_WAIT leftovers do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def listening_inodes(port: int, proc: Path = PROC) -> set[int] | None:
    """Inodes of the sockets listening on ``port`` (any address); None where /proc/net is unreadable."""
    found: set[int] = set()
    readable = False
    for name in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / name).read_text().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                found.add(int(fields[9]))
    return found if readable else None


def _socket_inodes(pid: int, proc: Path) -> set[int]:
    out: set[int] = set()
    try:
        fds = list((proc / str(pid) / "fd").iterdir())
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def _pids(proc: Path) -> Iterable[int]:
    try:
        return [int(p.name) for p in proc.iterdir() if p.name.isdigit()]
    except OSError:
        return []


def _command(pid: int, proc: Path) -> str:
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return "?"
    text = raw.replace(b"\0", b" ").decode(errors="replace").strip()
    return text[:160] + (" ..." if len(text) > 160 else "") or "?"


def holders_of(port: int, proc: Path = PROC) -> list[Holder]:
    """The processes listening on ``port`` that this user may inspect (empty when none is visible)."""
    inodes = listening_inodes(port, proc)
    if not inodes:
        return []
    return [Holder(pid, _command(pid, proc)) for pid in _pids(proc) if _socket_inodes(pid, proc) & inodes]


def _session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def session_listens(session_id: int, port: int, proc: Path = PROC) -> bool | None:
    """Whether a process of session ``session_id``, or a descendant of one that made its own session
    (the proxy's relay workers do), owns the socket listening on ``port``.

    True/False when /proc shows the listener; None when it cannot tell (no /proc/net, or nothing
    listed on the port).
    """
    inodes = listening_inodes(port, proc)
    if not inodes:
        return None
    return any(_socket_inodes(pid, proc) & inodes and _of_session(pid, session_id, proc) for pid in _pids(proc))


def _of_session(pid: int, session_id: int, proc: Path, depth: int = 32) -> bool:
    """``pid`` or one of its ancestors (``depth`` at most) is in session ``session_id``."""
    for _ in range(depth):
        if _session_of(pid) == session_id:
            return True
        parent = _parent_of(pid, proc)
        if parent is None or parent <= 1:
            return False
        pid = parent
    return False


def _parent_of(pid: int, proc: Path) -> int | None:
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # after "(comm)", which may hold spaces: state, ppid, ...
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None
