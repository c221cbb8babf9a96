"""Supervisor: restarts what exits (backoff, bounded), leaves the rest alone, or stops on request."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import pytest

from lmcache_p2p.cli.processes import Child, wait_healthy
from lmcache_p2p.cli.supervise import ChildExitedError, OnExit, RestartLimitError, RestartPolicy, Supervisor

STEP_DEADLINE_S = 30.0


def step_until(supervisor: Supervisor, done, deadline_s: float = STEP_DEADLINE_S) -> None:
    deadline = time.monotonic() + deadline_s
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {deadline_s}s")
        supervisor.step()
        time.sleep(0.05)


def test_killed_child_is_restarted_and_the_others_are_untouched(make_child, caplog) -> None:
    caplog.set_level(logging.INFO, logger="lmcache_p2p.cli.supervise")
    proxy, prefiller, decoder = make_child("proxy"), make_child("prefiller-0"), make_child("decoder-0")
    children = [proxy, prefiller, decoder]
    for child in children:
        child.start()
    wait_healthy(children, timeout_s=30)
    before = {c.name: c.proc.pid for c in children}
    supervisor = Supervisor(children, RestartPolicy(backoff_s=0.05, backoff_max_s=0.1))

    os.kill(decoder.proc.pid, signal.SIGKILL)
    step_until(supervisor, lambda: supervisor.restarts("decoder-0") == 1 and decoder.healthy())

    assert decoder.proc.pid != before["decoder-0"]
    assert (proxy.proc.pid, prefiller.proc.pid) == (before["proxy"], before["prefiller-0"])
    assert proxy.exited() is None and prefiller.exited() is None
    assert supervisor.restarts("proxy") == supervisor.restarts("prefiller-0") == 0
    log = caplog.text
    assert f"decoder-0 exited with code -{int(signal.SIGKILL)}" in log
    assert "restarted decoder-0" in log


def test_the_proxy_is_restarted_too(make_child) -> None:
    proxy, decoder = make_child("proxy"), make_child("decoder-0")
    for child in (proxy, decoder):
        child.start()
    wait_healthy([proxy, decoder], timeout_s=30)
    supervisor = Supervisor([proxy, decoder], RestartPolicy(backoff_s=0.05, backoff_max_s=0.1))
    old = proxy.proc.pid
    os.kill(old, signal.SIGKILL)
    step_until(supervisor, lambda: supervisor.restarts("proxy") == 1 and proxy.healthy())
    assert proxy.proc.pid != old and supervisor.restarts("decoder-0") == 0


def test_restart_limit_gives_a_clear_error(make_child) -> None:
    crashing = make_child("decoder-0", "--exit-code", "3", "--exit-after-s", "0.1")
    steady = make_child("prefiller-0")
    for child in (crashing, steady):
        child.start()
    supervisor = Supervisor([crashing, steady], RestartPolicy(max_restarts=2, window_s=600, backoff_s=0.05,
                                                              backoff_max_s=0.1))
    with pytest.raises(RestartLimitError) as err:
        step_until(supervisor, lambda: False)
    message = str(err.value)
    assert "decoder-0 exited with code 3 after 2 restarts within 600s" in message
    assert "--max-restarts 2" in message and "--restart-window-s" in message
    assert str(crashing.log_path) in message
    assert supervisor.restarts("decoder-0") == 2
    assert steady.exited() is None  # the supervisor stops nothing itself; the launcher does


def test_on_exit_stop_raises_at_the_first_exit(make_child) -> None:
    child = make_child("decoder-0", "--exit-code", "7", "--exit-after-s", "0.1")
    child.start()
    supervisor = Supervisor([child], RestartPolicy(on_exit=OnExit.STOP))
    with pytest.raises(ChildExitedError, match=r"decoder-0 exited with code 7 \(--on-exit stop\)"):
        step_until(supervisor, lambda: False)
    assert supervisor.restarts("decoder-0") == 0


class FakeChild:
    """What the Supervisor uses of a Child, driven by the test (no process)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.log_path = Path(f"/nonexistent/{name}.log")
        self.code: int | None = None
        self.starts = 0
        self.proc = None

    def exited(self) -> int | None:
        return self.code

    def start(self) -> None:
        self.starts += 1
        self.code = None

    def stop(self) -> None:
        pass

    def healthy(self) -> bool:
        return True

    def log_tail(self, lines: int = 30) -> str:
        return ""


def test_backoff_doubles_up_to_its_cap_and_the_window_forgets_old_restarts() -> None:
    now = [0.0]
    child = FakeChild("decoder-0")
    policy = RestartPolicy(max_restarts=3, window_s=100, backoff_s=2, backoff_max_s=5)
    supervisor = Supervisor([child], policy, clock=lambda: now[0])  # type: ignore[list-item]
    delays = []
    for _ in range(3):
        child.code = 1
        supervisor.step()  # sees the exit, schedules the restart
        started_at = now[0]
        while child.starts == len(delays):
            now[0] += 0.5
            supervisor.step()
        delays.append(now[0] - started_at)
    assert delays == [2.0, 4.0, 5.0]  # 2, 4, then capped at 5
    child.code = 1
    with pytest.raises(RestartLimitError):
        supervisor.step()  # a 4th restart within 100 s is refused
    # Restarts older than the window no longer count: the next exit restarts after the first delay.
    child2 = FakeChild("prefiller-0")
    supervisor2 = Supervisor([child2], policy, clock=lambda: now[0])  # type: ignore[list-item]
    for _ in range(3):
        child2.code = 1
        supervisor2.step()
        now[0] += 10
        supervisor2.step()
    now[0] += 200
    child2.code = 1
    supervisor2.step()  # no RestartLimitError: the earlier three fell out of the window
    now[0] += 2
    supervisor2.step()
    assert child2.starts == 4


def test_policy_backoff_for() -> None:
    policy = RestartPolicy(backoff_s=1, backoff_max_s=8)
    assert [policy.backoff_for(k) for k in range(6)] == [1, 2, 4, 8, 8, 8]
