"""A multi-host test rig on one machine: each "host" a network namespace of its own.

    with NetRig(["proxy", "prefiller-0", "decoder-0", "client"]) as rig:
        argv = rig.argv("decoder-0", [sys.executable, "-m", "..."])   # runs inside that host
        with rig.inside("client"):                                    # this thread on the client host
            httpx.get(f"http://{rig.addr('proxy')}:9100/health")
        rig.impair(delay_ms=10)                                       # 20 ms added round trip
        rig.cut("decoder-0"); rig.restore("decoder-0")                # the host's link down, up

Topology: one router namespace and one namespace per host, each host on its own veth link to the
router: host k has ``198.18.k.2/24`` (the benchmarking range, RFC 2544) on ``eth0``, the router
``198.18.k.1`` on ``h<k>``, and the host's default route points at the router. The router forwards
between the links in its kernel; while an impairment is set (:meth:`NetRig.impair`) policy routing
sends every packet through a TUN device served by ``netem.py`` (a userspace emulator: this
machine's kernel has no netem qdisc), which delays, drops or blocks it and hands it back. Nothing
is routed to or from the machine's own namespace: the test process reaches a host only by moving
one of its threads into that host's namespace (:meth:`NetRig.inside`, ``setns``).

Everything the rig creates is deleted by :meth:`NetRig.close` (also on an exception inside the
``with``): the emulator, every process still running in one of its namespaces, the namespaces
(their links go with them). A rig whose test process died without closing is deleted by the next
rig that starts (namespace names carry the creating pid).

Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN), ``ip`` (iproute2) and ``/dev/net/tun``;
:func:`unavailable` says why a rig cannot be built here, for a test's skip reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

NETNS_DIR = Path("/run/netns")
PREFIX = "lp2p"
CLONE_NEWNET = 0x40000000
IMPAIR_TABLE = 100
EMULATOR = Path(__file__).with_name("netem.py")
SUBNET = "198.18.{k}.0/24"
_counter = itertools.count()
_libc = ctypes.CDLL(None, use_errno=True)


class RigError(RuntimeError):
    """The rig could not be built or changed (the failing command and its output)."""


def unavailable() -> str | None:
    """Why no rig can be built on this machine, or None when one can."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN, CAP_NET_ADMIN); run the multi-host tests as root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) to create network namespaces and veth links"
    if not Path("/dev/net/tun").exists():
        return "no /dev/net/tun for the rig's network emulator"
    name = f"{PREFIX}-{os.getpid()}-probe"
    try:
        _ip("netns", "add", name)
    except RigError as exc:
        return f"this machine refuses network namespaces: {exc}"
    _ip("netns", "del", name, check=False)
    return None


def _run(argv: Sequence[str], check: bool = True) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RigError(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def _ip(*args: str, ns: str | None = None, check: bool = True) -> str:
    return _run(["ip", *(["-n", ns] if ns else []), *args], check)


def _sysctl(ns: str, key: str, value: str) -> None:
    _run(["ip", "netns", "exec", ns, "sh", "-c", f"echo {value} > /proc/sys/{key.replace('.', '/')}"])


def _setns(path: Path | str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise RigError(f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def remove_stale() -> None:
    """Delete rigs whose creating process is gone (a test killed before its cleanup ran)."""
    if not NETNS_DIR.is_dir():
        return
    for entry in NETNS_DIR.iterdir():
        m = re.fullmatch(rf"{PREFIX}-(\d+)-.*", entry.name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            _delete_namespace(entry.name)


def _delete_namespace(name: str) -> None:
    for pid in _run(["ip", "netns", "pids", name], check=False).split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _ip("netns", "del", name, check=False)


class NetRig:
    """Hosts in namespaces behind one router; see the module docstring."""

    def __init__(self, hosts: Sequence[str], *, mtu: int = 9000) -> None:
        if len(set(hosts)) != len(hosts) or not hosts or len(hosts) > 250:
            raise ValueError(f"hosts must be 1..250 distinct names, got {list(hosts)}")
        self.hosts = list(hosts)
        self.mtu = mtu  # of every link and the emulator's TUN device (jumbo frames by default)
        self.tag = f"{PREFIX}-{os.getpid()}-{next(_counter)}"
        self.router = f"{self.tag}-r"
        self._index = {h: k for k, h in enumerate(self.hosts, start=1)}
        self._emulator: subprocess.Popen | None = None
        self._emu_lock = threading.Lock()
        self._impaired = False
        self._state: dict[str, object] = {"delay_ms": 0.0, "loss": 0.0, "block": []}
        self._created: list[str] = []

    # ---- names and addresses ----------------------------------------------------------------

    def ns(self, host: str) -> str:
        return f"{self.tag}-h{self._index[host]}"

    def addr(self, host: str) -> str:
        return f"198.18.{self._index[host]}.2"

    def argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace (``ip netns exec`` execs it: the pid stays the same)."""
        return ["ip", "netns", "exec", self.ns(host), *argv]

    # ---- life -------------------------------------------------------------------------------

    def __enter__(self) -> NetRig:
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def build(self) -> None:
        remove_stale()
        self._add_ns(self.router)
        _sysctl(self.router, "net.ipv4.ip_forward", "1")
        for key in ("net.ipv4.conf.all.rp_filter", "net.ipv4.conf.default.rp_filter"):
            _sysctl(self.router, key, "0")
        for host, k in self._index.items():
            ns = self.ns(host)
            self._add_ns(ns)
            _ip("link", "add", "eth0", "netns", ns, "mtu", str(self.mtu), "type", "veth", "peer", "name", f"h{k}",
                "netns", self.router, "mtu", str(self.mtu))
            _ip("addr", "add", f"198.18.{k}.1/24", "dev", f"h{k}", ns=self.router)
            _ip("link", "set", f"h{k}", "up", ns=self.router)
            _ip("addr", "add", f"{self.addr(host)}/24", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            _ip("route", "add", "default", "via", f"198.18.{k}.1", ns=ns)
        self._start_emulator()
        logger.info("rig %s: %s", self.tag, ", ".join(f"{h}={self.addr(h)}" for h in self.hosts))

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)
        _ip("link", "set", "lo", "up", ns=name)

    def _start_emulator(self) -> None:
        self._emulator = subprocess.Popen(
            ["ip", "netns", "exec", self.router, sys.executable, str(EMULATOR), "--tun", "tun0"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        line = self._emulator.stdout.readline() if self._emulator.stdout else ""
        if line.strip() != "ready":
            raise RigError(f"the network emulator did not start (said {line!r})")
        _sysctl(self.router, "net.ipv4.conf.tun0.rp_filter", "0")
        _ip("link", "set", "tun0", "mtu", str(self.mtu), "up", ns=self.router)
        _ip("route", "add", "default", "dev", "tun0", "table", str(IMPAIR_TABLE), ns=self.router)

    def close(self) -> None:
        """Delete everything the rig made; idempotent, safe after a failed build."""
        if self._emulator is not None:
            with contextlib.suppress(OSError, ValueError):
                self._emulator.stdin.close()
            try:
                self._emulator.wait(5)
            except subprocess.TimeoutExpired:
                self._emulator.kill()
                self._emulator.wait(5)
            self._emulator = None
        for name in reversed(self._created):
            _delete_namespace(name)
        self._created.clear()

    # ---- the test process on a host -----------------------------------------------------------

    @contextlib.contextmanager
    def inside(self, host: str) -> Iterator[None]:
        """Run the calling thread (and the threads and processes it starts meanwhile) on ``host``."""
        home = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY)
        try:
            _setns(NETNS_DIR / self.ns(host))
            try:
                yield
            finally:
                if _libc.setns(home, CLONE_NEWNET) != 0:
                    raise RigError(f"could not return to the original namespace: {os.strerror(ctypes.get_errno())}")
        finally:
            os.close(home)

    # ---- faults -----------------------------------------------------------------------------

    def impair(self, *, delay_ms: float | None = None, loss: float | None = None,
               block: Sequence[tuple[str, str]] | None = None) -> None:
        """Set the emulator's one-way delay per router crossing (a round trip gets twice it), its loss
        probability per packet and the (source host, destination host) pairs it drops; None keeps one."""
        cmd: dict[str, object] = {}
        if delay_ms is not None:
            cmd["delay_ms"] = float(delay_ms)
        if loss is not None:
            cmd["loss"] = float(loss)
        if block is not None:
            cmd["block"] = [[self.addr(a), self.addr(b)] for a, b in block]
        self._state.update(cmd)
        self._command(cmd)
        wanted = bool(self._state["delay_ms"] or self._state["loss"] or self._state["block"])
        if wanted != self._impaired:
            self._route_through_emulator(wanted)

    def partition(self, a: str, b: str) -> None:
        """``a`` and ``b`` no longer reach each other (both directions dropped); every other pair does."""
        pairs = [tuple(p) for p in self._state["block"]]  # type: ignore[union-attr]
        self.impair(block=[*self._hosts_of(pairs), (a, b), (b, a)])

    def heal(self) -> None:
        self.impair(delay_ms=0, loss=0, block=[])

    def _hosts_of(self, pairs: list[tuple]) -> list[tuple[str, str]]:
        by_addr = {self.addr(h): h for h in self.hosts}
        return [(by_addr[a], by_addr[b]) for a, b in pairs]

    def _route_through_emulator(self, on: bool) -> None:
        for host, k in self._index.items():
            _ip("rule", "add" if on else "del", "iif", f"h{k}", "lookup", str(IMPAIR_TABLE), "pref", str(1000 + k),
                ns=self.router)
        self._impaired = on

    def _command(self, cmd: dict) -> str:
        with self._emu_lock:
            emu = self._emulator
            if emu is None or emu.stdin is None or emu.stdout is None:
                raise RigError("the rig is closed")
            emu.stdin.write(json.dumps(cmd) + "\n")
            emu.stdin.flush()
            return emu.stdout.readline().strip()

    def emulator_counts(self) -> dict[str, int]:
        return json.loads(self._command({"stats": True}))

    def cut(self, host: str) -> None:
        """Pull ``host``'s cable: its link goes down (nothing in or out; its processes keep running)."""
        _ip("link", "set", "eth0", "down", ns=self.ns(host))

    def restore(self, host: str) -> None:
        """Plug it back: the link comes up with the same address and default route."""
        ns = self.ns(host)
        _ip("link", "set", "eth0", "up", ns=ns)
        k = self._index[host]
        _ip("route", "replace", "default", "via", f"198.18.{k}.1", ns=ns)
        # Neighbour entries that failed while the link was down would hold packets back for a while.
        _ip("neigh", "flush", "dev", f"h{k}", ns=self.router, check=False)
        _ip("neigh", "flush", "dev", "eth0", ns=ns, check=False)
