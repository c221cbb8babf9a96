"""Child processes the launcher owns: start with a log file, wait until healthy, stop for sure.

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
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)


class StartupError(RuntimeError):
    """A child exited or did not become healthy in time; the message names its log file."""


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
    gpu: int | None = None  # the GPU it runs on (children sharing one start one after another)

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

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, TimeoutError):
            return False

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
            if child.healthy():
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
    each GPU at once, then the next on each GPU once those are healthy, and so on.

    vLLM sizes its KV cache from what its memory profiling sees: a second instance starting on the
    same GPU at the same moment counts the first one's allocations as its own and fails ("No
    available memory for the cache blocks", seen with ``--share-gpus`` on one H200).
    """
    waves: list[list[Child]] = []
    seen: dict[int, int] = {}
    for child in children:
        at = 0
        if child.gpu is not None:
            at = seen.get(child.gpu, 0)
            seen[child.gpu] = at + 1
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
