"""Supervision of the launcher's children: restart what exits, with bounded backoff.

``lmcache-p2p launch`` hands its children (the proxy and every vLLM instance) to a
:class:`Supervisor` and calls :meth:`Supervisor.step` about once a second. A child that exits is
logged with its exit code; with ``--on-exit restart`` (the default) it is started again after an
exponential backoff (``--restart-backoff-s`` doubling up to ``--restart-backoff-max-s``) while
the others keep serving; more than ``--max-restarts`` restarts of one child within
``--restart-window-s`` raise :class:`RestartLimitError` (a crash loop is a fault to look at, not
to hide). With ``--on-exit stop`` the first exit raises :class:`ChildExitedError` and the
launcher stops everything (the behaviour before supervision).

A restarted vLLM instance announces itself to the proxy's registry again on start; a restarted
proxy is re-announced to by every instance's heartbeat. Nothing here blocks: a restart is
scheduled and started on a later ``step``.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

from lmcache_p2p.cli.processes import Child
from lmcache_p2p.errors import ChildExitedError, RestartLimitError, SupervisionError  # noqa: F401 (importers)

logger = logging.getLogger(__name__)


class OnExit(enum.Enum):
    RESTART = "restart"
    STOP = "stop"


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    on_exit: OnExit = OnExit.RESTART
    max_restarts: int = 5  # per child, within window_s
    window_s: float = 600.0
    backoff_s: float = 2.0  # first restart's delay; doubles per recent restart
    backoff_max_s: float = 60.0

    def backoff_for(self, recent_restarts: int) -> float:
        """Delay before the next restart of a child restarted ``recent_restarts`` times in the window."""
        return min(self.backoff_s * (2 ** recent_restarts), self.backoff_max_s)


@dataclasses.dataclass
class _Track:
    child: Child
    restarts_s: deque[float] = dataclasses.field(default_factory=deque)  # monotonic times of restarts
    restart_at_s: float | None = None  # a restart is scheduled for then
    awaiting_health: bool = False  # restarted, not yet healthy again
    total_restarts: int = 0


class Supervisor:
    """Watches children; restarts the ones that exit (see the module docstring)."""

    def __init__(self, children: Sequence[Child], policy: RestartPolicy,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._tracks = {c.name: _Track(c) for c in children}
        self._policy = policy
        self._clock = clock

    def restarts(self, name: str) -> int:
        """How many times the named child was restarted since the launcher started."""
        return self._tracks[name].total_restarts

    def step(self) -> None:
        """Check every child once: log exits, schedule and start restarts, raise when the launcher must stop."""
        now = self._clock()
        for track in self._tracks.values():
            if track.restart_at_s is not None:
                if now >= track.restart_at_s:
                    self._restart(track, now)
                continue
            code = track.child.exited()
            if code is None:
                self._note_health(track)
                continue
            self._on_exit(track, code, now)

    def _on_exit(self, track: _Track, code: int, now: float) -> None:
        child, policy = track.child, self._policy
        track.awaiting_health = False
        if policy.on_exit is OnExit.STOP:
            logger.error("%s exited with code %s; stopping everything (--on-exit stop). Log: %s",
                         child.name, code, child.log_path)
            raise ChildExitedError(f"{child.name} exited with code {code} (--on-exit stop); see {child.log_path}")
        while track.restarts_s and now - track.restarts_s[0] > policy.window_s:
            track.restarts_s.popleft()
        recent = len(track.restarts_s)
        if recent >= policy.max_restarts:
            logger.error("%s exited with code %s; it was restarted %d times in the last %.0fs (limit "
                         "--max-restarts %d per --restart-window-s %.0f): giving up. Log: %s",
                         child.name, code, recent, policy.window_s, policy.max_restarts, policy.window_s,
                         child.log_path)
            raise RestartLimitError(
                f"{child.name} exited with code {code} after {recent} restarts within {policy.window_s:.0f}s "
                f"(limit --max-restarts {policy.max_restarts} per --restart-window-s {policy.window_s:.0f}); "
                f"see {child.log_path}:\n{child.log_tail(15)}")
        delay_s = policy.backoff_for(recent)
        track.restart_at_s = now + delay_s
        logger.warning("%s exited with code %s; restarting it in %.1fs (restart %d of at most %d per %.0fs). "
                       "Log: %s", child.name, code, delay_s, recent + 1, policy.max_restarts, policy.window_s,
                       child.log_path)

    def _restart(self, track: _Track, now: float) -> None:
        child = track.child
        child.stop()  # reaps it and kills what is left of its process group
        child.start()
        track.restart_at_s = None
        track.restarts_s.append(now)
        track.total_restarts += 1
        track.awaiting_health = True
        logger.warning("restarted %s (pid %d; restart %d in the last %.0fs)", child.name,
                       child.proc.pid if child.proc else -1, len(track.restarts_s), self._policy.window_s)

    @staticmethod
    def _note_health(track: _Track) -> None:
        if track.awaiting_health and track.child.healthy():
            track.awaiting_health = False
            logger.info("%s is serving again after its restart", track.child.name)
