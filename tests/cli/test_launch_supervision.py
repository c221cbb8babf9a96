"""``lmcache-p2p launch`` with fake vLLM servers: supervision of the whole deployment, end to end.

vLLM and the proxy are replaced by ``fake_server.py`` (argv patched in); the launcher's own loop,
signal handling and stop-everything path are the real ones.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from lmcache_p2p.cli import launch
from .conftest import pids_of

WAIT_S = 60.0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def wait_for(condition, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s}s")
        time.sleep(0.1)


def serving(monkeypatch) -> threading.Event:
    """Set once the launcher says the whole deployment serves (its start-up ended): a child that exits
    before then is a start-up failure, which ends the launcher, not a restart."""
    up = threading.Event()

    def announce(*args, **kwargs) -> None:
        print(*args, **kwargs)
        if any("is serving" in str(a) for a in args):
            up.set()

    monkeypatch.setattr(launch, "print", announce, raising=False)
    return up


def kill_when_up(pid_dir: Path, port: int, then=None, after: threading.Event | None = None) -> threading.Thread:
    """In the background: SIGKILL the first server on ``port`` once it is up (and ``after`` is set), then
    call ``then()``."""
    def run() -> None:
        wait_for(lambda: pids_of(pid_dir, port), f"server on {port}")
        if after is not None:
            wait_for(after.is_set, "the deployment serving")
        time.sleep(0.5)
        os.kill(pids_of(pid_dir, port)[0], signal.SIGKILL)
        if then is not None:
            then()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_on_exit_stop_stops_everything(fake_launch, monkeypatch) -> None:
    build, pid_dir = fake_launch
    up = serving(monkeypatch)
    args = build("--on-exit", "stop")
    # once it serves: killed during start-up, the launcher stops a child that may not have started yet
    kill_when_up(pid_dir, args.decode_port, after=up)

    assert launch.run(args) == 1

    all_pids = [p for port in (args.proxy_port, args.prefill_port, args.decode_port) for p in pids_of(pid_dir, port)]
    assert len(all_pids) == 3  # nothing was restarted
    assert not any(alive(p) for p in all_pids)


def test_killed_decoder_is_restarted_while_the_rest_keeps_serving(fake_launch, monkeypatch) -> None:
    build, pid_dir = fake_launch
    up = serving(monkeypatch)
    args = build("--restart-backoff-s", "0.1", "--restart-backoff-max-s", "0.2")

    running = threading.Event()

    def after_kill() -> None:  # once the decoder is back, stop the launcher as Ctrl-C / SIGTERM would
        wait_for(lambda: len(pids_of(pid_dir, args.decode_port)) == 2, "decoder restart")
        log = Path(args.log_dir) / "decoder-0.log"  # the restarted server wrote its pid file before its line
        wait_for(lambda: log.read_text().count("fake server pid") == 2, "the restarted decoder's log line")
        if running.is_set():  # never signal pytest itself once the launcher has returned
            os.kill(os.getpid(), signal.SIGTERM)

    kill_when_up(pid_dir, args.decode_port, then=after_kill, after=up)

    running.set()
    try:
        code = launch.run(args)
    finally:
        running.clear()
    assert code == 0  # stopped by the signal, not by the decoder's exit

    assert len(pids_of(pid_dir, args.proxy_port)) == 1
    assert len(pids_of(pid_dir, args.prefill_port)) == 1
    assert len(pids_of(pid_dir, args.decode_port)) == 2
    all_pids = [p for port in (args.proxy_port, args.prefill_port, args.decode_port) for p in pids_of(pid_dir, port)]
    assert not any(alive(p) for p in all_pids)
    log = (Path(args.log_dir) / "decoder-0.log").read_text()
    assert log.count("fake server pid") == 2  # the restart appends to the same log


def test_restart_limit_stops_everything_with_a_clear_error(fake_launch, caplog, monkeypatch) -> None:
    build, pid_dir = fake_launch
    up = serving(monkeypatch)
    args = build("--max-restarts", "1", "--restart-backoff-s", "0.1", "--restart-backoff-max-s", "0.1")

    def kill_twice() -> None:
        wait_for(lambda: len(pids_of(pid_dir, args.decode_port)) == 2, "decoder restart")
        time.sleep(0.5)
        os.kill(_newest(pid_dir, args.decode_port), signal.SIGKILL)

    kill_when_up(pid_dir, args.decode_port, then=kill_twice, after=up)

    assert launch.run(args) == 1
    assert "decoder-0 exited with code -9 after 1 restarts within 600s (limit --max-restarts 1" in caplog.text
    all_pids = [p for port in (args.proxy_port, args.prefill_port, args.decode_port) for p in pids_of(pid_dir, port)]
    assert not any(alive(p) for p in all_pids)


def _newest(pid_dir: Path, port: int) -> int:
    files = sorted(pid_dir.glob(f"{port}.*"), key=lambda p: p.stat().st_mtime_ns)
    return int(files[-1].name.split(".")[1])


@pytest.mark.timeout(120)
def test_sigint_stops_a_launcher_that_inherited_it_ignored(fake_launch) -> None:
    """A launcher started in the background from a script inherits SIGINT ignored; Ctrl-C / kill -INT
    must still stop it and everything it started."""
    build, pid_dir = fake_launch
    args = build()
    old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    running = threading.Event()

    def interrupt_when_up() -> None:
        wait_for(lambda: all(pids_of(pid_dir, p) for p in (args.proxy_port, args.prefill_port, args.decode_port)),
                 "every child up")
        time.sleep(1.0)
        if running.is_set():
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_when_up, daemon=True).start()
    running.set()
    try:
        code = launch.run(args)
    finally:
        running.clear()
        signal.signal(signal.SIGINT, old_int)
    assert code == 0
    all_pids = [p for port in (args.proxy_port, args.prefill_port, args.decode_port) for p in pids_of(pid_dir, port)]
    assert len(all_pids) == 3 and not any(alive(p) for p in all_pids)
