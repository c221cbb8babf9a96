"""``--workers N``: N relay processes serve the proxy's HTTP port; this process coordinates them.

Every decoded token passes through the proxy (read the decoder's event, make the client's text,
render and write the client's event): one asyncio process saturates at some tokens per second,
and once its loop is busy every request's prefill and KV handover queues behind the relay
(BENCHMARKS.md has the figures). With ``--workers N`` the relay is spread over N processes while
the routing state stays in one place:

    client --HTTP--> worker i (of N; SO_REUSEPORT listeners, the kernel spreads connections)
                      |  Unix socket in a 0700 folder, msgspec JSON (relay/messages.py)
                      v
                   coordinator (this process): registry, routing, admission, KV waiters, control
                   socket, metrics; prefills; answers /health /metrics /stats and admin calls

The coordinator binds the public port (so ``--port 0`` and a busy port behave as in one process)
and never listens on it; each worker listens on it with its own socket (SO_REUSEPORT: the kernel
spreads new connections over the workers; a client's keep-alive connection stays on one). :class:`WorkerPool` starts the workers,
waits until each serves (its hello), restarts one that dies (the requests it held are closed on
the coordinator, so no load leaks) and gives up after ``_MAX_RESTARTS`` deaths within
``_RESTART_WINDOW_S``: then the proxy exits with an error rather than serve with fewer relays
than asked. Stop: SIGTERM to every worker (graceful: in-flight requests get
``--graceful-shutdown-s``), then SIGKILL for any still there after that.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import lmcache_p2p
from lmcache_p2p.proxy.http.tokenizer import NONE
from lmcache_p2p.proxy.relay.messages import PROTOCOL_VERSION, Hello
from lmcache_p2p.proxy.settings import ProxySettings

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 60.0  # one worker's start: Python, imports, first hello (its tokenizer's waits come on top)
_MAX_RESTARTS = 5
_RESTART_WINDOW_S = 60.0
_KILL_WAIT_S = 5.0


class WorkerFailure(RuntimeError):
    """Relay workers keep dying, or one never started: the proxy stops."""


def coordinator_call_timeout_s(s: ProxySettings) -> float:
    """The longest one worker -> coordinator call may take: an open covers the tokenizer wait, admission,
    a prefill that may be retried once; a plan covers two KV waits and a retry prefill."""
    return (s.tokenizer_wait_s + s.admission_timeout_s + 2 * s.prefill_timeout_s + 2 * s.kv_timeout_s
            + 2 * s.connect_timeout_s)


def worker_start_timeout_s(s: ProxySettings) -> float:
    """The longest a worker may take to say hello: its start, and what it waits for before it serves, each for up
    to --tokenizer-load-timeout-s: the tokenizer library's import (unless --tokenizer none), a --tokenizer folder's
    load."""
    waits = 0 if s.tokenizer == NONE else 2 if os.path.isdir(s.tokenizer) else 1
    return WORKER_START_TIMEOUT_S + waits * s.tokenizer_load_timeout_s


class WorkerPool:
    def __init__(self, settings: ProxySettings, port: int, uds_path: str,
                 on_dead: Callable[[int], None], on_give_up: Callable[[str], None]) -> None:
        self._settings = settings
        self._port = port
        self._uds = uds_path
        self._on_dead = on_dead
        self._on_give_up = on_give_up
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._ready: dict[int, asyncio.Event] = {}
        self._watches: set[asyncio.Task[None]] = set()
        self._deaths: collections.deque[float] = collections.deque()
        self._stopping = False

    @property
    def pids(self) -> dict[int, int]:
        return {i: p.pid for i, p in self._procs.items() if p.returncode is None}

    async def start(self) -> None:
        """Start every worker and wait until each serves (raises WorkerFailure, after stopping them, if not)."""
        try:
            await asyncio.gather(*(self._spawn(i) for i in range(self._settings.workers)))
        except BaseException:
            await self.stop(0.0)
            raise
        logger.info("%d relay workers serve the HTTP port (pids %s)", len(self._procs),
                    ", ".join(str(p) for p in self.pids.values()))

    def hello(self, msg: Hello) -> None:
        if msg.version != PROTOCOL_VERSION:
            logger.error("relay worker %d speaks relay protocol %d, the coordinator %d", msg.worker, msg.version,
                         PROTOCOL_VERSION)
            return
        event = self._ready.get(msg.worker)
        if event is not None:
            event.set()

    async def stop(self, graceful_s: float) -> None:
        """SIGTERM every worker, wait ``graceful_s`` (+ a margin) for them, SIGKILL the rest; idempotent."""
        self._stopping = True
        for proc in self._procs.values():
            _signal(proc, signal.SIGTERM)
        await self._reap(graceful_s + 1.0)
        for proc in self._procs.values():
            _signal(proc, signal.SIGKILL)
        await self._reap(_KILL_WAIT_S)
        for task in self._watches:
            task.cancel()
        if self._watches:
            await asyncio.wait(self._watches, timeout=_KILL_WAIT_S)

    def kill(self) -> None:
        """Stop now (a second shutdown request)."""
        for proc in self._procs.values():
            _signal(proc, signal.SIGKILL)

    async def _reap(self, timeout_s: float) -> None:
        waits = [asyncio.ensure_future(p.wait()) for p in self._procs.values() if p.returncode is None]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=timeout_s)
            for w in pending:
                w.cancel()

    async def _spawn(self, index: int) -> None:
        s = self._settings
        ready = self._ready[index] = asyncio.Event()
        package_root = str(Path(lmcache_p2p.__file__).resolve().parent.parent)  # the same code as this process
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH"))
                                                           if p)}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "lmcache_p2p.proxy.relay.worker", "--host", s.host, "--port", str(self._port),
            "--uds", self._uds,
            "--index", str(index), "--chars-per-token", str(s.chars_per_token),
            "--connect-timeout-s", str(s.connect_timeout_s), "--dead-peer-timeout-s", str(s.dead_peer_timeout_s),
            "--coordinator-timeout-s", str(coordinator_call_timeout_s(s)),
            "--graceful-shutdown-s", str(s.graceful_shutdown_s),
            "--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel()),
            "--tokenizer", s.tokenizer, "--tokenizer-load-timeout-s", str(s.tokenizer_load_timeout_s),
            start_new_session=True, env=env)  # own session: a terminal's ^C reaches us alone
        self._procs[index] = proc
        watch = asyncio.get_running_loop().create_task(self._watch(index, proc), name=f"relay-worker-{index}")
        self._watches.add(watch)
        watch.add_done_callback(self._watches.discard)
        timeout_s = worker_start_timeout_s(s)
        try:
            await asyncio.wait_for(ready.wait(), timeout_s)
        except TimeoutError:
            raise WorkerFailure(f"relay worker {index} (pid {proc.pid}) did not serve within {timeout_s:.0f} s "
                                f"(exit status {proc.returncode}); see its log lines above") from None

    async def _watch(self, index: int, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if self._stopping:
            return
        self._on_dead(index)
        now = time.monotonic()
        self._deaths.append(now)
        while self._deaths and self._deaths[0] < now - _RESTART_WINDOW_S:
            self._deaths.popleft()
        if len(self._deaths) > _MAX_RESTARTS:
            reason = (f"relay worker {index} (pid {proc.pid}) exited with status {code}: {len(self._deaths)} worker "
                      f"deaths within {_RESTART_WINDOW_S:.0f} s, more than {_MAX_RESTARTS}: stopping the proxy")
            logger.error("%s", reason)
            self._on_give_up(reason)
            return
        logger.error("relay worker %d (pid %d) exited with status %s: restarting it", index, proc.pid, code)
        try:
            await self._spawn(index)
        except (WorkerFailure, OSError) as exc:
            logger.error("%s", exc)
            self._on_give_up(str(exc))


def _signal(proc: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    if proc.returncode is None:
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass
