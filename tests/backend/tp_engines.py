"""Real LMCache engines as the TP ranks of prefillers and decoders (helpers for test_engine_tp*.py).

An :class:`Instance` is one engine process per TP rank (engine_proc.py with ``P2P_ENGINE_TP``),
sharing one YAML; a decoder's ranks each listen on their own control and transport port. Engines
of a set start in parallel (each takes ~20 s alone on 2 cores); if any fails, all are killed.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from engines import EngineProc, free_ports, write_config

READY_TIMEOUT_S = 60.0
SETTLE_TIMEOUT_S = 30.0


class Instance:
    """The engines of one prefiller or decoder, rank by rank."""

    def __init__(self, name: str, role: str, tp: int, ranks: list[EngineProc], ports: list[int]) -> None:
        self.name, self.role, self.tp, self.ranks, self.ports = name, role, tp, ranks, ports

    def close(self) -> None:
        for engine in self.ranks:
            engine.close()


def start_instances(tmp: Path, specs: list[dict], transport: str = "nixl") -> dict[str, Instance]:
    """Start every instance of ``specs`` at once: {name, role: sender|receiver, tp, heads, mla; optional
    env (engine_proc's environment), p2p (``p2p.*`` keys), lmcache (top-level LMCache keys), buffer}."""
    plans: list[tuple[dict, int, Path, list[int]]] = []
    for spec in specs:
        ports = free_ports(2 * spec["tp"]) if spec["role"] == "receiver" else []
        extra = {"save_only_first_rank": False} if spec.get("mla") else {}
        # the model's total heads, as vLLM would know them (a replicated head is not heads x TP size)
        p2p = {} if spec.get("mla") else {"kv_heads_total": spec.get("heads", 2)}
        p2p.update(spec.get("p2p", {}))
        if spec["role"] == "receiver":
            config = write_config(tmp / f"{spec['name']}.yaml", "decoder.yaml", buffer_size=spec.get("buffer", "64MB"),
                                  transport=transport, control_ports=ports[:spec["tp"]],
                                  transport_ports=ports[spec["tp"]:], **p2p)
        else:
            config = write_config(tmp / f"{spec['name']}.yaml", "prefiller.yaml", alloc_timeout_s=5.0,
                                  transport=transport, lmcache_overrides=spec.get("lmcache"), **p2p)
        _extra_config(config, extra)
        for rank in range(spec["tp"]):
            plans.append((spec, rank, config, ports[:spec["tp"]]))
    engines: dict[tuple[str, int], EngineProc] = {}
    errors: list[BaseException] = []

    def start(spec: dict, rank: int, config: Path) -> None:
        env = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo", "P2P_ENGINE_TP": f"{spec['tp']}:{rank}",
               "P2P_ENGINE_KV_HEADS": str(spec.get("heads", 2)), "P2P_ENGINE_MLA": "1" if spec.get("mla") else "0",
               **spec.get("env", {})}
        try:
            engines[(spec["name"], rank)] = EngineProc(f"{spec['name']}-r{rank}", config,
                                                       tmp / f"{spec['name']}-r{rank}-{time.monotonic_ns()}.log",
                                                       env_extra=env)
        except BaseException as exc:  # reported below, after every start ended
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(spec, rank, config)) for spec, rank, config, _ in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for engine in engines.values():
            engine.kill()
        raise errors[0]
    out = {}
    for spec in specs:
        ports = next(p for s, _, _, p in plans if s is spec)
        out[spec["name"]] = Instance(spec["name"], spec["role"], spec["tp"],
                                     [engines[(spec["name"], r)] for r in range(spec["tp"])], ports)
    return out


def _extra_config(path: Path, extra: dict) -> None:
    import yaml

    cfg = yaml.safe_load(path.read_text())
    cfg["extra_config"].update(extra)
    path.write_text(yaml.safe_dump(cfg))


def store(prefiller: Instance, decoder: Instance, seed: int, n: int, req_id: str) -> None:
    """Every prefiller rank stores the sequence for ``req_id``, addressed to every decoder rank."""
    for engine in prefiller.ranks:
        reply = engine.call(op="store", seed=seed, num_tokens=n, end=n, skip=0, req_id=req_id, last=True,
                            ports=decoder.ports)
        assert reply == {"ok": True}


def load_everywhere(decoder: Instance, seed: int, n: int, req_id: str) -> list[dict]:
    """Wait for the whole prompt on every decoder rank, then load it as vLLM would (its own slice)."""
    out = []
    for engine in decoder.ranks:
        assert engine.call(op="wait_ready", seed=seed, num_tokens=n, timeout_s=READY_TIMEOUT_S) == {"hit_tokens": n}
        out.append(engine.call(op="load", seed=seed, num_tokens=n, req_id=req_id))
    return out


def wait_settled(prefiller: Instance, decoder: Instance) -> tuple[list[dict], list[dict]]:
    """Sender stats (nothing pending) and receiver slots (every slot free), once settled."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        sent = [e.call(op="slots") for e in prefiller.ranks]
        slots = [e.call(op="slots") for e in decoder.ranks]
        done = all(s["pending"] == 0 for s in sent) and all(s["free"] == s["capacity"] for s in slots)
        if done or time.monotonic() > deadline:
            return sent, slots
        time.sleep(0.05)
