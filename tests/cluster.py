"""A running deployment started from Python with the launcher's own building blocks (a test and
bench harness, not part of the package).

Used by the end-to-end tests and by ``bench/e2e.py`` (which puts ``tests/`` on ``sys.path``):
:class:`Cluster` is the proxy plus X prefillers and Y decoders exactly as ``lmcache-p2p launch``
starts them (same YAML, flags and environment; each vLLM-CPU instance on core ``slot % cores``), on
a free port range;
:func:`plain_vllm_child` is one vLLM server with no LMCache and no KV transfer, the reference a
deployment is compared with. Nothing here configures logging.
"""

from __future__ import annotations

import argparse
import random
import re
import socket
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import httpx

from lmcache_p2p.cli import launch
from lmcache_p2p.cli.demo import HIT_RE, Lookup, lookups_in_log  # noqa: F401 (importers of this harness)
from lmcache_p2p.cli.main import build_parser
from lmcache_p2p.cli.processes import Child, StartupError, stop_all, wait_healthy
from lmcache_p2p.cli.vllm_env import vllm_argv, vllm_env, write_logging_config

# Logged by every TP rank's LMCache engine for each retrieve (LMCache's own log format names no rank or process:
# each worker process holds one engine and retrieves once per request, so a request's lines are its ranks').
RETRIEVED_RE = re.compile(r"\[req_id=(\S+)\] Retrieved (\d+) out of (\d+) required tokens")
LOOKUP_RE = re.compile(r"Reqid: (\S+), Total tokens (\d+), Inference Engine computed tokens: \d+, "
                       r"LMCache hit tokens: (\d+)")
RANKS_DIFFER = "differ across (TP and PP) ranks"  # LMCache's warning when the ranks' lookups disagree


def rank_retrievals(log_path: Path) -> dict[str, list[int]]:
    """Tokens retrieved from LMCache per request id, one entry per TP rank's retrieve, from an instance's log."""
    out: dict[str, list[int]] = {}
    for req_id, retrieved, _ in RETRIEVED_RE.findall(log_path.read_text(errors="replace")):
        out.setdefault(req_id, []).append(int(retrieved))
    return out


def lookups_by_request(log_path: Path) -> dict[str, Lookup]:
    """The scheduler's LMCache lookup per request id (the minimum over the TP ranks' own lookups)."""
    return {req: Lookup(int(total), int(hit))
            for req, total, hit in LOOKUP_RE.findall(log_path.read_text(errors="replace"))}


# Below the kernel's ephemeral range: a port the kernel may hand to any outgoing connection (vLLM's
# and LMCache's own sockets, the proxy's clients) between our check and the instance's bind was taken
# there once in CI ("Address already in use" on a decoder's control port).
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_BASE_PORT = 10000


def free_base_port(span: int = 400) -> int:
    """A port P with P..P+span likely free (every port a launch up to 8P8D uses below P+80 is checked,
    then a few beyond), below the ephemeral range so that no outgoing connection takes one meanwhile."""
    highest = ephemeral_low() - span - 1
    rng = random.Random()  # seeded from os.urandom: concurrent test processes pick different ranges
    for _ in range(100):
        port = rng.randrange(LOWEST_BASE_PORT, highest) if highest > LOWEST_BASE_PORT else _kernel_port()
        offsets = (*range(80), 150, 160, span // 2) if span else (0,)
        if port + span < 65000 and claim(port + d for d in offsets):
            return port
    raise RuntimeError("no free port range")


# Ports this process handed out: a vLLM server binds its port only after its start-up, so a deployment spawned
# beside another one (a reference instance) would otherwise find the first one's ports free.
_claimed: set[int] = set()


def claim(ports: Iterable[int]) -> bool:
    """Take ``ports`` if each one is free and none was handed out before in this process."""
    wanted = list(ports)
    if any(p in _claimed or not _free(p) for p in wanted):
        return False
    _claimed.update(wanted)
    return True


def free_port() -> int:
    """One free port below the ephemeral range (for a server that binds it only after start-up)."""
    return free_base_port(span=0)


def ephemeral_low(path: Path = EPHEMERAL_RANGE_FILE) -> int:
    """The first port of the kernel's ephemeral range (32768, Linux's default, when unreadable)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _kernel_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


class Cluster:
    """Proxy (or ``router``, see ``launch --router``) + prefillers + decoders; ``add_decoder`` joins one while the
    rest keeps serving; ``p2p``: ``KEY=VALUE`` settings of every instance (``launch --p2p``)."""

    def __init__(self, model: Path, log_dir: Path, *, prefill: int = 1, decode: int = 1,
                 proxy_args: tuple[str, ...] = (), buffer_size: str = "256MB", prefix_caching: bool = True,
                 prefill_tp: int = 1, decode_tp: int = 1, transport: str = "nixl",
                 vllm_args: tuple[str, ...] = (), router: str = "lmcache_p2p",
                 p2p: tuple[str, ...] = ()) -> None:
        base = free_base_port()
        argv = ["launch", "--model", str(model), "--prefill", str(prefill), "--decode", str(decode),
                "--proxy-port", str(base), "--proxy-control-port", str(base + 1), "--prefill-port", str(base + 10),
                "--decode-port", str(base + 30), "--kv-port", str(base + 50), "--log-dir", str(log_dir),
                "--buffer-size", buffer_size, *[f"--proxy-arg={a}" for a in proxy_args],
                *([] if prefix_caching else ["--no-prefix-caching"]), "--prefill-tp", str(prefill_tp),
                "--decode-tp", str(decode_tp), "--transport", transport, *[f"--vllm-arg={a}" for a in vllm_args],
                "--router", router, *[f"--p2p={kv}" for kv in p2p]]
        self.args: argparse.Namespace = build_parser().parse_args(argv)
        self.model = model
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        write_logging_config(log_dir / "logging.json")
        self.proxy = launch.proxy_child(self.args, log_dir)
        self.instances = launch.plan(self.args)
        self.children: dict[str, Child] = {"proxy": self.proxy}
        for inst in self.instances:
            self.children[inst.name] = launch.vllm_child(inst, model, self.args, log_dir)
        self.url = f"http://127.0.0.1:{self.args.proxy_port}"

    def start(self, timeout_s: float = 400) -> None:
        self.spawn()
        self.wait_ready(timeout_s)

    def spawn(self) -> None:
        """Start every process (non-blocking; :meth:`wait_ready` waits for them)."""
        for child in self.children.values():
            child.start()

    def wait_ready(self, timeout_s: float = 400) -> None:
        wait_healthy(list(self.children.values()), timeout_s)
        if self.args.router == "lmcache_p2p":  # a foreign router keeps no registry
            self.wait_registered(self.args.prefill, self.args.decode)

    def add_decoder(self, index: int) -> Child:
        inst = launch.decoder_instance(self.args, index)
        child = launch.vllm_child(inst, self.model, self.args, self.log_dir)
        self.children[inst.name] = child
        child.start()
        return child

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=5).json()

    def wait_registered(self, prefillers: int, decoders: int, timeout_s: float = 120) -> dict:
        return wait_registered(self.url, prefillers, decoders, timeout_s, self.proxy.log_path)

    def url_of(self, name: str) -> str:
        child = self.children[name]
        return child.health_url.removesuffix("/health")

    def decoder_names(self) -> list[str]:
        return [name for name in self.children if name.startswith("decoder-")]

    def lmcache_hits(self, name: str) -> list[Lookup]:
        """(total tokens, LMCache hit tokens) of every request the instance looked up."""
        return lookups_in_log(self.children[name].log_path)

    def stop(self) -> None:
        stop_all(list(self.children.values()))

    def wait_started(self, child: Child, timeout_s: float = 300) -> None:
        wait_healthy([child], timeout_s)


def wait_registered(url: str, prefillers: int, decoders: int, timeout_s: float, log_path: Path) -> dict:
    """Until our proxy at ``url`` routes to ``prefillers`` prefillers and ``decoders`` decoders (its /health). A probe
    that gets no answer is tried again until ``timeout_s``, as the launcher's own wait does: a loaded machine can
    hold the proxy's answer past one probe's timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            health = httpx.get(f"{url}/health", timeout=5).json()
        except httpx.HTTPError as exc:
            health = {"error": f"{type(exc).__name__}: {exc}"}
        else:
            if (health["prefillers"], health["decoders"]) == (prefillers, decoders):
                return health
        if time.monotonic() > deadline:
            raise StartupError(f"the proxy's registry never showed {prefillers}P{decoders}D within "
                               f"{timeout_s:.0f}s: {health}; see {log_path}")
        time.sleep(0.5)


def plain_vllm_child(model: Path, log_dir: Path, *, port: int, cpu_core: int | Sequence[int] | None,
                     name: str = "direct", max_model_len: int = 2048, prefix_caching: bool = True, tp_size: int = 1,
                     vllm_args: Sequence[str] = ()) -> Child:
    """One vLLM server without LMCache or a KV-transfer config, with the PD instances' other flags
    (the same prefix-caching setting and prompt-token details, context length, TP flag, environment and
    logging); ``cpu_core``: one core, or one per TP rank."""
    log_dir.mkdir(parents=True, exist_ok=True)
    logging_config = write_logging_config(log_dir / "logging.json")
    argv = vllm_argv(model, port, *launch.cache_flags(prefix_caching), "--max-model-len", str(max_model_len),
                     *launch.tp_flags(tp_size), *vllm_args)
    env = vllm_env(cpu_core=cpu_core, logging_config=logging_config)
    return Child(name, argv, env, log_dir / f"{name}.log", f"http://127.0.0.1:{port}/health")
