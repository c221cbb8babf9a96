"""Child processes the launcher owns: start with a log file, wait until healthy, stop for sure.

Healthy means the child itself answers: its health URL returns 200 and the socket listening on
that port belongs to the child's own session (:mod:`lmcache_p2p.cli.ports`). A server left over
from another deployment that answers on the same port is never counted as this child; seeing one
fails the start at once, naming its pid.

Each child runs in its own session (process group). Stopping sends SIGTERM to the child, which
shuts down what it spawned (vLLM's engine core) in order; after a grace period, SIGKILL to the
whole group, so nothing outlives the launcher.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from lmcache_p2p.cli import ports
from lmcache_p2p.errors import StartupError

logger = logging.getLogger(__name__)

__all__ = ["Child", "StartupError", "startup_waves", "stop_all", "wait_healthy"]

@dataclasses.dataclass
class Child:
    name: str
    argv: Sequence[str]
    env: Mapping[str, str]
    log_path: Path
    health_url: str
    proc: subprocess.Popen | None = None
    # CPUs the child and everything it spawns may run on (set before it execs; None: the launcher's own)
    cpus: frozenset[int] | None = None
    gpus: tuple[int, ...] = ()  # the GPUs it runs on, one per TP rank (children sharing one start one after another)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        pin = None if self.cpus is None else functools.partial(os.sched_setaffinity, 0, sorted(self.cpus))
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(list(self.argv), env=dict(self.env), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=pin)
        logger.info("started %s (pid %d)%s, log %s", self.name, self.proc.pid,
                    "" if self.cpus is None else f" on CPUs {sorted(self.cpus)}", self.log_path)

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    @property
    def port(self) -> int:
        return int(urllib.parse.urlsplit(self.health_url).port or 80)

    def healthy(self) -> bool:
        """Whether the health URL answers 200 and the answer comes from this child (see the module doc)."""
        return self.answers() and self.impostor() is None

    def answers(self) -> bool:
        """Whether anything answers the health URL with 200."""
        try:
            with urllib.request.urlopen(self.health_url, timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, TimeoutError):
            return False

    def impostor(self) -> str | None:
        """Who listens on the child's port when it is not the child itself; None when it is (or /proc
        cannot tell: then the answer is taken as the child's)."""
        if self.proc is None:
            return "no child started"
        if ports.session_listens(self.proc.pid, self.port) is not False:
            return None
        return ", ".join(map(str, ports.holders_of(self.port))) or "a process this user cannot inspect"

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 15.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is not None:
            _signal_group(self.proc.pid, signal.SIGKILL)  # orphans of a child that died
            return
        self.proc.send_signal(signal.SIGTERM)  # the leader shuts its own children down in order
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop within %.0fs; killing it", self.name, grace_s)
            _signal_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        _signal_group(self.proc.pid, signal.SIGKILL)  # leftovers of the group, if any


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_healthy(children: Sequence[Child], timeout_s: float, progress_every_s: float = 5.0) -> None:
    """Wait until every child answers its health URL; raise StartupError naming the first failure."""
    deadline = time.monotonic() + timeout_s
    started = time.monotonic()
    next_progress = started + progress_every_s
    pending = list(children)
    while pending:
        for child in list(pending):
            code = child.exited()
            if code is not None:
                raise StartupError(f"{child.name} exited with code {code} during start-up; see {child.log_path}:\n"
                                   f"{child.log_tail()}")
            if child.answers():
                impostor = child.impostor()
                if impostor is not None:
                    raise StartupError(f"{child.name}: port {child.port} is answered by {impostor}, not by the "
                                       f"child the launcher started (pid {child.proc.pid if child.proc else '-'}); "
                                       f"see {child.log_path}")
                logger.info("%s is up (%.0fs)", child.name, time.monotonic() - started)
                pending.remove(child)
        if not pending:
            return
        now = time.monotonic()
        if now > deadline:
            names = ", ".join(c.name for c in pending)
            raise StartupError(f"not healthy after {timeout_s:.0f}s: {names}; see their logs in "
                               f"{pending[0].log_path.parent}")
        if now >= next_progress:
            logger.info("waiting for %s ... %.0fs", ", ".join(c.name for c in pending), now - started)
            next_progress = now + progress_every_s
        time.sleep(0.5)


def startup_waves(children: Sequence[Child]) -> list[list[Child]]:
    """The children in the groups they start in, in order: every child without a GPU and the first on
    each GPU at once, then the next on each GPU once those are healthy, and so on (a child on several
    GPUs waits for the latest of them).

    vLLM sizes its KV cache from what its memory profiling sees: a second instance starting on the
    same GPU at the same moment counts the first one's allocations as its own and fails ("No
    available memory for the cache blocks", seen with ``--share-gpus``).
    """
    waves: list[list[Child]] = []
    seen: dict[int, int] = {}
    for child in children:
        at = max((seen.get(g, 0) for g in child.gpus), default=0)
        for g in child.gpus:
            seen[g] = at + 1
        while len(waves) <= at:
            waves.append([])
        waves[at].append(child)
    return waves


def stop_all(children: Sequence[Child], grace_s: float = 15.0) -> None:
    """SIGTERM every child at once, then wait for each (SIGKILL after ``grace_s``)."""
    for child in children:
        if child.proc is not None and child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
    for child in reversed(children):
        child.stop(grace_s)
