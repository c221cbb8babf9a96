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

Tensor parallelism: ``--tp N`` for every instance, ``--prefill-tp`` / ``--decode-tp`` per role.
On vLLM-CPU each rank gets a core (``VLLM_CPU_OMP_THREADS_BIND``, ``|`` between ranks; instances
share cores when there are fewer cores than ranks); a decoder rank r listens on its own control
port (7300+10*i+r).

vLLM's own connector (``--connector nixl``: NixlConnector, vLLM's pull connector; ``nixl-push``: NixlPushConnector,
for one node without RDMA): plain vLLM servers with that connector and no LMCache, placed, supervised and logged as
ours, each one's NIXL handshake listener (VLLM_NIXL_SIDE_CHANNEL_PORT) on --kv-port + its place in the launch order;
the proxy names them with --nixl-prefill / --nixl-decode (with --router vllm-router: vLLM's own PD stack). Our plugin's
flags, and different TP sizes on vLLM-CPU, are refused there (``connectors.check_flags``). ``nixl-lmcache-mp`` and
``nixl-push-lmcache-mp``, LMCache's multi-process PD recipe, add LMCacheMPConnector in vLLM's MultiConnector and an
LMCache server per instance, started first, supervised and logged like it.

GPUs (``--device cuda``): the instances' ranks (prefillers first) get the GPUs of ``--gpus`` (default
0,1,...) in order, one per rank, as their visible devices; a decoder rank's receive buffer lives in
VRAM and its vLLM gets ``--gpu-memory-utilization`` minus the buffer's share of the GPU. Extra vLLM
flags go after ``--`` or in ``--vllm-arg=...`` (every instance gets them).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time
from pathlib import Path

import yaml

from lmcache_p2p.cli import demo
from lmcache_p2p.cli import gpu as gpu_plan
from lmcache_p2p.cli import connectors, lmcache_servers, ports, routers
from lmcache_p2p.cli.drain import admin_headers
from lmcache_p2p.cli.instance import (  # noqa: F401 (launch's own names for them, as tests import them)
    GpuAssignment, Site, cache_flags, instance_spec, instance_utilization, lmcache_config, p2p_overrides, proxy_command,
    send_buffer_bytes, tp_flags,
)
from lmcache_p2p.cli.layout import (  # noqa: F401 (the launcher's plan, as tests and bench/ import it)
    KV_PORT_STRIDE, TRANSPORT_PORT_OFFSET, CpuPlacement, Instance, cpu_core_of, cpu_cores_of, cpu_sets,
    decoder_instance, plan, planned_ports, rank_slots_of, slot_of,
)
from lmcache_p2p.cli.tensor_parallel import add_tp_args, check_tp_fits_model, model_heads, tp_sizes
from lmcache_p2p.cli.processes import Child, StartupError, stop_all, wait_healthy
from lmcache_p2p.cli.supervise import OnExit, RestartPolicy, SupervisionError, Supervisor
from lmcache_p2p.cli.vllm_env import HOST, ucx_devices_for, write_logging_config
from lmcache_p2p.config import parse_size_bytes
from lmcache_p2p.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DIR = Path("models/tiny-llama")
SUPERVISE_EVERY_S = 1.0
REGISTER_TIMEOUT_S = 60.0  # our plugin announces within seconds of vLLM's /health: one that never does is a fault


def register_timeout_s(args: argparse.Namespace) -> float:
    """How long to wait for the proxy to list the healthy instances. Ours announce themselves, so a minute
    separates a plugin that is not running from a slow one. A vLLM connector's instances are named to the proxy
    at its start and listed at its first /health probe; nothing can fail to announce, and on loaded cores the
    proxy's answer can be slow, so their wait is the start-up's (``--startup-timeout-s``)."""
    return args.startup_timeout_s if connectors.native(args) else REGISTER_TIMEOUT_S


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    description = __doc__.replace("``", "")  # the module docstring, without reST markup
    p = subparsers.add_parser("launch", help="start XpYd: prefillers, decoders and the proxy",
                              description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plan_args(p, local=True)
    _add_supervision_args(p.add_argument_group("supervision"))
    p.set_defaults(func=run)
    return p


def add_plan_args(p: argparse.ArgumentParser, local: bool) -> None:
    """The flags the plan is made of (``local``: also those of processes on this host; without them
    the flags ``deploy`` shares with ``launch``, so both make the same instances from them)."""
    _add_deployment_args(p, local)
    add_tp_args(p)
    ports_title = "ports (each one is checked free before anything starts)" if local else "ports (in each pod)"
    _add_port_args(p.add_argument_group(ports_title), local)
    _add_instance_args(p, local)
    _add_gpu_args(p.add_argument_group("GPUs (--device cuda)"), local)


def _add_deployment_args(p: argparse.ArgumentParser, local: bool) -> None:
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
    if local:  # deploy kubernetes renders our proxy's Service only
        p.add_argument("--router", choices=[r.value for r in routers.Router], default=routers.Router.LMCACHE_P2P.value,
                       help="what stands in front of the instances on --proxy-port: lmcache_p2p (our proxy) or "
                            "vllm-router (vllm-project's router in its vLLM PD mode, unchanged; docs/ROUTERS.md says "
                            "what each gives up) (default %(default)s)")
    registered = "registered with the proxy by URL" if local else "each pod registered with the proxy by a sidecar"
    server = "an LMCache server per instance" if local else "an LMCache server container in each pod (vLLM-CPU only)"
    mp = (f"; nixl-lmcache-mp / nixl-push-lmcache-mp: the same beside LMCacheMPConnector in vLLM's MultiConnector, "
          f"with {server} (LMCache's multi-process PD recipe)")
    p.add_argument("--connector", choices=[c.value for c in connectors.Connector],
                   default=connectors.Connector.LMCACHE_P2P.value,
                   help=f"the instances' KV connector: lmcache_p2p (LMCache with our plugin), nixl (vLLM's own "
                        f"NixlConnector, the pull connector: plain vLLM servers, {registered}) or nixl-push (vLLM's "
                        f"NixlPushConnector; on one node without RDMA the one to run){mp} (default %(default)s)")
    p.add_argument("--policy", choices=[x.value for x in Policy], default=Policy.PREFIX.value,
                   help="the proxy's routing policy (default %(default)s)")
    p.add_argument("--proxy-workers", type=int, default=1,
                   help="relay processes of the proxy (its --workers): each streams its clients' decodes, one "
                        "coordinator routes; 1 = one process (default %(default)s)")
    p.add_argument("--proxy-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for the proxy (see lmcache-p2p proxy --help), e.g. "
                        "--proxy-arg=--kv-timeout-s=30; repeatable")
    if local:
        p.add_argument("--log-dir", type=Path, default=None,
                       help="where every child's log goes (default logs/<time>)")
    p.add_argument("--startup-timeout-s", type=float, default=600.0,
                   help="how long each start-up wave may take until every child answers as itself "
                        "(default %(default)s)")
    p.add_argument("--shared-secret", default=os.environ.get("LMCACHE_P2P_SECRET"),
                   help="authenticate control messages (default: $LMCACHE_P2P_SECRET); required beyond loopback")
    if local:
        p.add_argument("--host", default=HOST,
                       help="the address every listener binds (vLLM's HTTP, the proxy, the decoders' KV ports) and "
                            "peers dial; beyond loopback it needs --shared-secret (default %(default)s)")
        p.add_argument("--demo", action="store_true",
                       help="send one completion through the proxy, print it and what proves it was "
                            "disaggregated (the tokens the decoder loaded from the prefiller), then stop everything")


def _add_port_args(g: argparse._ArgumentGroup, local: bool) -> None:
    g.add_argument("--proxy-port", type=int, default=9100,
                   help="the proxy's OpenAI-compatible HTTP port (default %(default)s)")
    g.add_argument("--proxy-control-port", type=int, default=9101,
                   help="the proxy's registry, where instances announce themselves (default %(default)s)")
    g.add_argument("--prefill-port", type=int, default=7100, help="first prefiller HTTP port (default %(default)s)")
    g.add_argument("--decode-port", type=int, default=7200, help="first decoder HTTP port (default %(default)s)")
    g.add_argument("--kv-port", type=int, default=7300,
                   help=f"first decoder KV control port: decoder i uses --kv-port + {KV_PORT_STRIDE}*i "
                        f"(+ its TP rank); with --transport nccl its NCCL store {TRANSPORT_PORT_OFFSET} above "
                        f"(7400 + {KV_PORT_STRIDE}*i by default); with --connector nixl/nixl-push the i-th instance "
                        f"(prefillers first) takes --kv-port + i for its NIXL handshake (default %(default)s)")
    where = ("the i-th instance's LMCache server (prefillers first) takes --lmcache-server-port + 2*i" if local
             else "each pod's LMCache server takes --lmcache-server-port")
    g.add_argument("--lmcache-server-port", type=int, default=7600, action=connectors.Given,
                   help=f"--connector nixl-lmcache-mp / nixl-push-lmcache-mp: {where} for its requests and the next "
                        "port for its HTTP API, on 127.0.0.1 (default %(default)s)")


def _add_instance_args(p: argparse.ArgumentParser, local: bool) -> None:
    p.add_argument("--buffer-size", default="1GB", action=connectors.Given,
                   help="receive buffer per decoder rank (p2p.buffer_size)")
    p.add_argument("--send-buffer-size", default="2GB", action=connectors.Given,
                   help="--device cuda: VRAM arena per prefiller rank that LMCache stores chunks in before they are "
                        "sent (the sender's p2p.buffer_size with buffer_device cuda: no host round trip); 0 keeps "
                        "them in host memory (default %(default)s)")
    if local:
        p.add_argument("--cpu-placement", choices=[c.value for c in CpuPlacement], default=CpuPlacement.ROLES.value,
                       help="vLLM-CPU: roles (default): besides its worker (pinned to its core by vLLM), a "
                            "decoder's API server and engine core stay off the prefillers' worker cores (decode steps "
                            "and token streaming never take the core a prefill, and so time to first token, waits "
                            "for); workers: only the workers are pinned, everything else runs anywhere")
    p.add_argument("--lmcache-l1-size", default="2GB", action=connectors.Given,
                   help="--connector nixl-lmcache-mp / nixl-push-lmcache-mp: each LMCache server's L1 cache, in "
                        "host memory (allocated as it fills) (default %(default)s)")
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


def _add_gpu_args(g: argparse._ArgumentGroup, local: bool) -> None:
    if local:
        _add_gpu_placement_args(g)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                   help="vLLM's share of each GPU; a decoder's is lowered by its receive buffer's share "
                        "(default 0.85; a --gpu-memory-utilization among the vLLM args sets it too)")


def _add_gpu_placement_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--gpus", default=None,
                   help="comma list of GPU indices, one per instance, prefillers first (default 0,1,...)")
    g.add_argument("--share-gpus", action="store_true",
                   help="let --gpus name a GPU more than once (e.g. --gpus 0,0: 1P1D on one GPU, NIXL only): its "
                        "instances split --gpu-memory-utilization evenly (development and small models)")


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


def local_site(args: argparse.Namespace, log_dir: Path) -> Site:
    """Instances on this host: the plan's addresses (--host, loopback by default), the proxy's, files in
    the log folder, the secret written as given, UCX on the network device of --host."""
    return Site(proxy_host=proxy_host(args), shared_secret=args.shared_secret or None,
                config_file=str(log_dir / "{name}.yaml"), logging_file=str(log_dir / "logging.json"),
                env=ucx_devices_for(getattr(args, "host", HOST)))


def proxy_host(args: argparse.Namespace) -> str:
    """Where the proxy binds its HTTP port and registry, and the instances reach it."""
    return getattr(args, "proxy_host", None) or getattr(args, "host", HOST)


def write_lmcache_config(inst: Instance, args: argparse.Namespace, out_dir: Path) -> Path:
    """The instance's LMCache YAML (instance.lmcache_config), written into ``out_dir``."""
    path = out_dir / f"{inst.name}.yaml"
    path.write_text(yaml.safe_dump(lmcache_config(inst, args, local_site(args, out_dir)), sort_keys=False))
    return path


def plan_gpus(instances: list[Instance], args: argparse.Namespace,
              available: list[gpu_plan.GpuSlot] | None = None) -> dict[str, GpuAssignment]:
    """A GPU per TP rank of each instance and each one's vLLM memory share (``available`` from nvidia-smi if None)."""
    check_ucx_for_gpus(args, os.environ)
    wanted = [int(i) for i in args.gpus.split(",")] if args.gpus else None
    ranks = sum(inst.tp_size for inst in instances)
    slots = gpu_plan.pick_gpus(ranks, gpu_plan.query_gpus() if available is None else available, wanted,
                               *gpus_needed(instances, ranks))
    placed = {inst.name: [slots[s] for s in rank_slots_of(inst, args)] for inst in instances}
    for name, on in placed.items():
        if len({slot.index for slot in on}) < len(on):
            raise gpu_plan.GpuPlanError(f"--gpus puts two TP ranks of {name} on one GPU ({[s.index for s in on]}): "
                                        "each rank of an instance needs a GPU of its own")
    sharing = gpu_plan.shared_gpus([s for on in placed.values() for s in on],
                                   [name for name, on in placed.items() for _ in on],
                                   getattr(args, "share_gpus", False), args.transport)
    plan: dict[str, GpuAssignment] = {}
    for inst in instances:
        on = placed[inst.name]
        crowd = max(sharing[slot.index] for slot in on)
        total = min(slot.total_bytes for slot in on)  # every rank has its own buffer on its own GPU
        plan[inst.name] = GpuAssignment(tuple(slot.index for slot in on),
                                        instance_utilization(inst, args, total, crowd))
    return plan


def gpus_needed(instances: list[Instance], ranks: int) -> tuple[str | None, str]:
    """What the GPU count asks for, and the flags that lower it (for pick_gpus' errors)."""
    if all(inst.tp_size == 1 for inst in instances):
        return None, "lower --prefill/--decode"
    parts = []
    for role in ("prefiller", "decoder"):
        of_role = [i for i in instances if i.role == role]
        if of_role:
            parts.append(f"{len(of_role)} {role}{'s' if len(of_role) > 1 else ''} at TP {of_role[0].tp_size}")
    return (f"{' and '.join(parts)} need {ranks} GPUs (one per TP rank)",
            "lower --prefill/--decode or --prefill-tp/--decode-tp (--tp)")


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


def vllm_child(inst: Instance, model: Path, args: argparse.Namespace, log_dir: Path,
               gpu: GpuAssignment | None = None, site: Site | None = None) -> Child:
    """The instance's vLLM server; ``site``: where it runs (default: this host, :func:`local_site`)."""
    on_cpu = args.device == "cpu"
    spec = instance_spec(inst, model, args, site or local_site(args, log_dir), gpu,
                         cpu_core=cpu_cores_of(inst, args) if on_cpu else None)
    if spec.lmcache_config_file is not None:
        Path(spec.lmcache_config_file).write_text(yaml.safe_dump(spec.lmcache_config, sort_keys=False))
    return Child(inst.name, spec.argv, spec.env, log_dir / f"{inst.name}.log", spec.health_url,
                 cpus=cpu_sets(args).get(inst.name), gpus=() if gpu is None else gpu.indices)


def proxy_child(args: argparse.Namespace, log_dir: Path, site: Site | None = None) -> Child:
    """What serves clients on --proxy-port: our proxy, or the router chosen with --router."""
    if routers.foreign(args):
        host = (site.bind_host if site is not None else None) or proxy_host(args)
        return Child("router", routers.vllm_router_command(args, plan(args), host), dict(os.environ),
                     log_dir / "router.log", f"http://{host}:{args.proxy_port}/health")
    # With relay workers, name the tokenizer folder: each worker loads it before it serves (with "auto" a
    # worker learns the folder from the coordinator, after the instances are up: the first requests wait).
    model = Path(args.model) if args.model is not None else DEFAULT_MODEL_DIR
    tokenizer = str(model.resolve()) if args.proxy_workers > 1 and model.is_dir() else None
    env = dict(os.environ)
    if args.shared_secret:
        env["LMCACHE_P2P_SECRET"] = args.shared_secret
    site = site or Site(bind_host=proxy_host(args))
    named = connectors.proxy_flags(plan(args)) if connectors.native(args) else []  # they cannot announce
    return Child("proxy", [*proxy_command(args, site, tokenizer), *named], env, log_dir / "proxy.log",
                 f"http://{site.bind()}:{args.proxy_port}/health")


def resolve_model(args: argparse.Namespace) -> Path:
    if args.model is not None:
        if not (args.model / "config.json").is_file():
            raise SystemExit(f"--model {args.model}: no config.json there")
        return args.model.resolve()
    from lmcache_p2p.cli.tiny_model import build_tiny_model

    return build_tiny_model(DEFAULT_MODEL_DIR).resolve()


def wait_registered(proxy_url: str, instance_ids: list[str], timeout_s: float, secret: str | None = None) -> None:
    """Wait until the proxy's registry lists every instance by its id as routable: each one's plugin started and
    announced itself (an instance whose plugin is not running never shows up), or, with a vLLM connector, the
    proxy's probe of its /health succeeded. ``secret``: the proxy's shared secret (``/instances`` is an admin
    endpoint then: a Bearer token)."""
    import httpx

    headers = admin_headers(secret)
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
    raise StartupError(f"{', '.join(missing)} not routable at the proxy within {timeout_s:.0f}s (their LMCache "
                       "plugin is not running, or the proxy cannot reach them?); see their logs and proxy.log")


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


def buffer_sizing(buffer_size: str, model: Path) -> str | None:
    """What one decoder's receive buffer holds of ``model``'s KV, and how to size it for longer prompts
    (None when the model's config.json does not say its KV shape)."""
    try:
        config = json.loads((model / "config.json").read_text())
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        per_token = 2 * int(config["num_hidden_layers"]) * kv_heads * head_dim * 2  # K and V, 16-bit
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None
    nbytes = parse_size_bytes("--buffer-size", buffer_size)
    tokens = nbytes // per_token
    return (f"decoder receive buffer --buffer-size {buffer_size}: ~{tokens} prompt tokens of this model's KV "
            f"({per_token // 1024} KiB per token); a prompt whose KV fits no decoder buffer is served colocated "
            f"(no disaggregation), and one that fills most of it makes the next request wait for room. For prompts "
            f"of N tokens give each decoder at least 2 x N x {per_token // 1024} KiB (--buffer-size)")


def build_children(args: argparse.Namespace, model: Path, log_dir: Path) -> list[Child]:
    """The proxy first, then with LMCache MP every instance's LMCache server, then every vLLM instance (prefillers,
    then decoders)."""
    connectors.check_flags(args)
    connectors.check_runs_here(args)
    instances = plan(args)
    check_tp_fits_model(tp_sizes(args), model_heads(model),
                        [role for role in ("prefiller", "decoder") if any(i.role == role for i in instances)])
    sizing = buffer_sizing(args.buffer_size, model) if args.decode > 0 and not connectors.native(args) else None
    if sizing:
        logger.info("%s", sizing)
    gpus = plan_gpus(instances, args) if args.device == "cuda" else {}
    for inst in instances:
        if inst.name in gpus:
            logger.info("%s: GPU %s, --gpu-memory-utilization %.2f", inst.name,
                        ",".join(map(str, gpus[inst.name].indices)), gpus[inst.name].memory_utilization)
    servers = [lmcache_servers.child(i, args, log_dir, gpus.get(i.name)) for i in instances]
    return ([proxy_child(args, log_dir)] + [s for s in servers if s is not None]
            + [vllm_child(i, model, args, log_dir, gpus.get(i.name)) for i in instances])


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


def serving_line(args: argparse.Namespace, proxy_url: str, model: Path) -> str:
    """What the launcher prints once everything serves: what serves, its shape, where and which model."""
    sizes = tp_sizes(args)
    tp = "" if (sizes.prefill, sizes.decode) == (1, 1) else f" (prefill TP {sizes.prefill}, decode TP {sizes.decode})"
    front = "" if not routers.foreign(args) else f" behind {args.router}"
    served = connectors.connector_of(args).label
    return f"{served} is serving {args.prefill}P{args.decode}D{tp}{front}: {proxy_url}/v1  (model {model})"


def run(args: argparse.Namespace) -> int:
    if args.demo and routers.foreign(args):
        logger.error("--demo reads our proxy's /stats and /metrics: it cannot run with --router %s", args.router)
        return 2
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
        for wave in lmcache_servers.start_waves(children):  # instances sharing a GPU one after another
            for child in wave:
                child.start()
            wait_healthy(wave, args.startup_timeout_s)
        if not routers.foreign(args):  # a foreign router has no registry; its health waits for the instances'
            wait_registered(proxy_url, connectors.registry_ids(args, plan(args)), timeout_s=register_timeout_s(args),
                            secret=args.shared_secret)
        print(f"\n{serving_line(args, proxy_url, model)}\nlogs: {log_dir}\nCtrl-C stops everything.", flush=True)
        if args.demo:
            decoder = next((connectors.url_of(i) for i in plan(args) if i.role == "decoder"), None)
            print("\n".join(demo.demo_request(proxy_url, model, log_dir, tiny_model=args.model is None,
                                               nixl_decoder_url=decoder if connectors.native(args) else None)),
                  flush=True)
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
