"""A proxy with fake prefillers and decoders, all in this event loop on 127.0.0.1 ephemeral ports."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from lmcache_p2p.config import Role
from lmcache_p2p.protocol import Fingerprint
from lmcache_p2p.proxy.server import Proxy
from lmcache_p2p.proxy.settings import ProxySettings

from .fakes import FakeAgent, FakeVllm, KvNetwork

_ports = itertools.count(20000, 1000)  # fake receiver ports: identifiers only, never bound


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


WORKERS_ENV = "LMCACHE_P2P_TEST_PROXY_WORKERS"  # run the proxy suite with --workers N (default 1: one process)
EVENTUALLY_TIMEOUT_S = 10.0  # a deadline for conditions that normally hold within milliseconds (busy 2-core CI)
PROXY_START_TIMEOUT_S = 60.0
# Between the reads of an answer from the proxy (a busy 2-core CI machine stretches a 1 s test to 10 s and more);
# a request that hangs still fails its test
CLIENT_TIMEOUT_S = 30.0


async def eventually(condition: Callable[[], Any], timeout_s: float = EVENTUALLY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


@dataclasses.dataclass
class Node:
    vllm: FakeVllm
    agent: FakeAgent


@dataclasses.dataclass
class Cluster:
    proxy: Proxy
    client: httpx.AsyncClient
    network: KvNetwork
    prefillers: list[Node]
    decoders: list[Node]
    secret: str | None
    encode: Callable[[str], list[int]] | None = None  # the fakes' tokenizer (None: fakes.tokenize)
    setup_vllm: Callable[[FakeVllm], None] | None = None  # applied to each fake before it serves
    kv_before_answers: bool = False  # a prefill answers once the proxy heard its KvReady (kv_ready_then_answer)

    @property
    def control_address(self) -> str:
        return self.proxy.control.address

    async def add_node(self, role: Role, *, tp_size: int = 1, capacity_slots: int = 64, announce: bool = True,
                       secret: str | None = None, base_port: int | None = None, serve_http: bool = True,
                       chunk_tokens: int = 16, fingerprint: Fingerprint | None = None) -> Node:
        """A fake instance; announced (then routable) unless ``announce`` is False. ``serve_http=False``:
        its HTTP port refuses connections until ``node.vllm.server.start()`` (a vLLM still loading)."""
        vllm = FakeVllm(f"{role.value}-{len(self.prefillers) + len(self.decoders)}")
        if self.encode is not None:
            vllm.encode = self.encode
        if self.setup_vllm is not None:
            self.setup_vllm(vllm)
        if serve_http:
            await vllm.server.start()
        else:
            vllm.server.bind()
        if base_port is None:
            base_port = next(_ports) if role is Role.RECEIVER else 0
        agent = FakeAgent(self.control_address, role.value, vllm.url, tp_size=tp_size, base_port=base_port,
                          capacity_slots=capacity_slots, secret=secret if secret is not None else self.secret,
                          chunk_tokens=chunk_tokens, fingerprint=fingerprint)
        node = Node(vllm, agent)
        if role is Role.RECEIVER:
            vllm.kv_park = agent.parked
            self.network.add(agent)
            self.decoders.append(node)
        else:
            vllm.kv_sink = self.kv_ready_then_answer if self.kv_before_answers else self.network.deliver
            self.prefillers.append(node)
        if announce:
            await agent.announce()
            await eventually(lambda: any(i.instance_id == agent.instance_id and (i.routable or not serve_http)
                                         for i in self.proxy.registry.instances()))
        return node

    async def kv_ready_then_answer(self, spec: dict[str, Any]) -> None:
        """A prefill's KV delivery that returns (and lets the prefiller answer) only once the proxy heard every
        rank's KvReady, when the decoder's agent reports them all (``kv_mode`` "ready"). For a test whose short
        ``--kv-timeout-s`` is meant for another wait: the proxy times its wait from the prefill's answer, and on a
        loaded machine a KvReady already sent could otherwise be read after that short timeout."""
        await self.network.deliver(spec)
        agent = self.network.agent_for(spec)
        if agent is not None and agent.kv_mode == "ready":
            await eventually(lambda: self._kv_heard(spec["req_id"]))

    def _kv_heard(self, req_id: str) -> bool:
        waiter = self.proxy.waiters._waiters.get(req_id)
        return waiter is None or waiter.ready_at_s is not None  # None: the request is over

    async def post(self, path: str, body: dict[str, Any], timeout_s: float | None = None) -> httpx.Response:
        """``timeout_s``: between the answer's reads, for a request meant to wait longer (the client's default:
        ``CLIENT_TIMEOUT_S``)."""
        if timeout_s is None:
            return await self.client.post(path, json=body)
        return await self.client.post(path, json=body, timeout=timeout_s)

    async def stream(self, path: str, body: dict[str, Any]) -> list[dict[str, Any] | str]:
        """The SSE events of a streaming request ("[DONE]" as a string)."""
        events: list[dict[str, Any] | str] = []
        async with self.client.stream("POST", path, json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    events.append(data if data == "[DONE]" else json.loads(data))
        return events

    def metric(self, name: str, **labels: str) -> float:
        value = self.proxy.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


@asynccontextmanager
async def make_cluster(n_prefill: int = 1, n_decode: int = 1, *, tp_size: int = 1, secret: str | None = None,
                       setup_vllm: Callable[[FakeVllm], None] | None = None, kv_before_answers: bool = False,
                       **settings: Any) -> AsyncIterator[Cluster]:
    """A proxy with fake instances; ``setup_vllm`` shapes each fake before it serves (what the proxy
    reads once, such as the /v1/models card, must be there before the proxy can ask);
    ``kv_before_answers``: see :meth:`Cluster.kv_ready_then_answer`."""
    # No tokenizer unless a test names one (the fakes' model is no folder): each relay worker would import
    # transformers (torch) before it serves, seconds of CPU per worker for nothing here.
    defaults = dict(port=0, control_port=0, summary_interval_s=0, kv_timeout_s=10.0, instance_ttl_s=30.0,
                    tokenizer="none", prefill_timeout_s=5.0, decode_idle_timeout_s=5.0, graceful_shutdown_s=1.0,
                    health_probe_interval_s=0.05, health_probe_timeout_s=10.0,
                    workers=int(os.environ.get(WORKERS_ENV, "1")))
    proxy = Proxy(ProxySettings(**{**defaults, "shared_secret": secret, **settings}))
    await proxy.start()
    await proxy.start_http()
    client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{proxy.port}", timeout=CLIENT_TIMEOUT_S, trust_env=False)
    cluster = Cluster(proxy, client, KvNetwork(), [], [], secret, encode=_hf_encode(settings.get("tokenizer")),
                      setup_vllm=setup_vllm, kv_before_answers=kv_before_answers)
    try:
        for _ in range(n_prefill):
            await cluster.add_node(Role.SENDER)
        for _ in range(n_decode):
            await cluster.add_node(Role.RECEIVER, tp_size=tp_size)
        yield cluster
    finally:
        await client.aclose()
        nodes = cluster.prefillers + cluster.decoders
        for node in nodes:
            node.agent.close()
        await asyncio.gather(proxy.close(), *(node.vllm.server.stop() for node in nodes))


def _hf_encode(tokenizer: Any) -> Callable[[str], list[int]] | None:
    """With ``tokenizer=DIR`` the fakes tokenize as that tokenizer does, as vLLM serving its model would
    (the proxy checks that its tokenizer and the instances' agree before it uses it)."""
    if not isinstance(tokenizer, str) or not os.path.isdir(tokenizer):
        return None
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizer)
    return lambda text: list(hf.encode(text))


_PROXY_MAIN = """
import argparse, logging, sys
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
from lmcache_p2p.proxy.server import add_arguments, run
parser = argparse.ArgumentParser()
add_arguments(parser)
run(parser.parse_args(sys.argv[1:]))
"""
_PROXY_UP_RE = re.compile(r"proxy on (http://127\.0\.0\.1:\d+), control tcp://127\.0\.0\.1:\d+")


class ProxyProcess:
    """``lmcache-p2p proxy`` as a child process on ephemeral ports; its stderr is collected by a thread.

    Start-up waits for the "proxy on ..." line with a deadline; if it does not come (or the process
    exits first) the process is killed before the error is raised, so a failed start leaks nothing.
    """

    def __init__(self, *flags: str, start_timeout_s: float = PROXY_START_TIMEOUT_S) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _PROXY_MAIN, "--port", "0", "--control-port", "0",
                                      *flags], stderr=subprocess.PIPE, text=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._seen: list[str] = []
        threading.Thread(target=self._read, name="proxy-stderr", daemon=True).start()
        try:
            self.url = self._wait_up(start_timeout_s)
        except BaseException:
            self.kill()
            raise

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._lines.put(line)
        self._lines.put(None)

    def _wait_up(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                seen = "".join(self._seen)[-2000:]
                raise AssertionError(f"proxy did not start within {timeout_s:.0f}s: {seen}") from None
            if line is None:
                raise AssertionError(f"proxy exited with {self.proc.wait()}: {''.join(self._seen)[-2000:]}")
            self._seen.append(line)
            if m := _PROXY_UP_RE.search(line):
                return m.group(1)

    def rest_of_stderr(self, timeout_s: float = 30.0) -> str:
        """Everything the process wrote after start-up, once it has exited (waits up to ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        out = []
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return "".join(out)
            if line is None:
                return "".join(out)
            out.append(line)

    def kill(self) -> None:
        """Kill and reap the process; idempotent."""
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    from lmcache_p2p.cli.tiny_model import _train_tokenizer

    hf = _train_tokenizer(0)  # the tiny model's byte-level BPE
    path = tmp_path_factory.mktemp("tokenizer")
    hf.save_pretrained(path)
    return path, hf
