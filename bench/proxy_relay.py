"""The proxy's relay capacity on this machine, without vLLM: tokens/s through it, its CPU per token.

Every decoded token passes through the proxy (SSE line read, JSON decode, the proxy's own
detokenizer, shaping, rendering, JSON encode, the client write), so one proxy process has a
ceiling in tokens/s. This bench starts the real proxy as a child process (``lmcache-p2p proxy``,
with a tokenizer, as ``launch`` runs it: the proxy makes the client's text from token ids) with
fake prefill/decode instances from ``tests/proxy/fakes.py`` (announced over the control socket,
KV "ready" at once) that stream SSE token events paced at a given rate, and N concurrent
streaming clients (``/v1/completions``, token-id prompts, ``include_usage``).

Per (variant, point) row:
  tokens_s        output tokens the clients received per second of the measured window
  proxy_us_token  the proxy process's CPU time (user + system) over the window / tokens relayed
  proxy_cpu_util  the proxy process's CPU time / wall time (1.0 = one core saturated)
  gap_ms_p50/p99  client-side gaps between consecutive SSE chunks of one stream (first excluded)
  decoder_gap_ms  the decoder's own pacing (what the gaps would be through a perfect relay)

Points: ``capacity`` (decoders stream as fast as the fakes can: on a 2-core machine the proxy
and this process, which runs the fakes and clients, saturate together), each fixed offered rate
(``--offered-tok-s``, N streams paced at N / rate each, one event per write: the GPU case, where a
decode step emits one token per stream), and the same rate with ``--backlog-events`` events per
write (what a proxy lagging behind its decoder finds in its socket buffers). Variants: ``baseline``
(the proxy at ``--baseline-ref``, extracted with ``git archive``) and ``current`` (this tree),
side by side in one run, alternating. ``--workers 1 2`` runs this tree's proxy once per count
(``--workers N``: N relay processes and a coordinator; ``proxy_us_token`` and ``proxy_cpu_util`` add
up all of them). On a 2-core machine the fakes and clients of this process share the cores with
the proxy's workers, so more workers cannot add much capacity here: what the rows show is the cost
per token of the split (IPC per request, the coordinator's share) and whether it spreads.

    flock /tmp/lmcache_p2p_vllm.lock timeout 600 env PYTHONPATH=$PWD .venv/bin/python bench/proxy_relay.py

Writes ``bench/results/proxy_relay.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from proxy.fakes import FakeAgent, FakeVllm, KvNetwork  # noqa: E402  (the test doubles, reused)

BASELINE_REF = "f880af3"  # main before the relay work (branch relay's base)
_PROXY_MAIN = """
import argparse, logging, sys
logging.basicConfig(level=logging.WARNING, format="%(name)s %(message)s")
logging.getLogger("lmcache_p2p.proxy.server").setLevel(logging.INFO)
from transformers import AutoTokenizer  # before the loop: the baseline's tokenizer load raced its own import
import lmcache_p2p.proxy.server as server
if "{loop}" == "asyncio" and hasattr(server, "_loop_factory"):
    server._loop_factory = lambda: None  # the ablation: this tree on asyncio's own loop
from lmcache_p2p.proxy.server import add_arguments, run
parser = argparse.ArgumentParser()
add_arguments(parser)
run(parser.parse_args(sys.argv[1:]))
"""
_UP_RE = re.compile(r"proxy on (http://127\.0\.0\.1:\d+), control (tcp://127\.0\.0\.1:\d+)")
_PROXY_START_TIMEOUT_S = 60.0
_CLIENT_TIMEOUT_S = 60.0


# ---- the fake decoder, paced, pre-encoded -----------------------------------------------------------


class PacedVllm(FakeVllm):
    """``FakeVllm`` whose decode stream is cheap (events pre-encoded) and paced at ``token_delay_s``.

    ``events_per_write`` > 1 writes that many events at once (a backlog: what a proxy that lags behind a
    decoder finds in its socket buffer). Pacing keeps a schedule (sleeps until the next due time) so a busy
    loop does not lower the offered rate more than it must; 0 streams as fast as this process can.
    """

    events_per_write = 1

    async def _stream(self, body: dict[str, Any], ids: list[int], tokens: list[int], finish: str) -> Any:
        head = '{"id":"x","object":"text_completion","created":1700000000,"model":"fake-model","choices":[{"index":0,'
        events = []
        for i, token in enumerate(tokens):
            last = i == len(tokens) - 1
            choice = (f'"text":" t{token}","logprobs":null,"finish_reason":{json.dumps(finish) if last else "null"},'
                      f'"stop_reason":null,"token_ids":[{token}]')
            events.append(f"data: {head}{choice}}}]}}\n\n".encode())
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(tokens), "total_tokens": len(ids) + len(tokens)}
        events.append(b'data: {"id":"x","object":"text_completion","created":1700000000,"model":"fake-model",'
                      b'"choices":[],"usage":' + json.dumps(usage).encode() + b"}\n\n")
        events.append(b"data: [DONE]\n\n")
        clock = time.perf_counter
        due = clock()
        per_write = self.events_per_write
        for start in range(0, len(events), per_write):
            if self.token_delay_s:
                due += self.token_delay_s * per_write
                delay = due - clock()
                await asyncio.sleep(max(delay, 0.0))
            else:
                await asyncio.sleep(0)
            yield b"".join(events[start:start + per_write])


def fixed_model(ids: list[int]) -> int:
    """A cheap deterministic next token (ids 10..99: plain tokens of any byte-level BPE)."""
    return (len(ids) * 7) % 90 + 10


# ---- the proxy child ---------------------------------------------------------------------------------


class ProxyChild:
    def __init__(self, pythonpath: str, tokenizer_dir: str, loop: str = "auto", workers: int = 1) -> None:
        env = {**os.environ, "PYTHONPATH": pythonpath}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _PROXY_MAIN.replace("{loop}", loop), "--port", "0", "--control-port", "0",
             "--summary-interval-s", "0", "--tokenizer", tokenizer_dir, "--kv-timeout-s", "10",
             "--health-probe-interval-s", "1", *(["--workers", str(workers)] if workers > 1 else [])],
            stderr=subprocess.PIPE, text=True, env=env, cwd=pythonpath)  # cwd: "-c" puts it first on sys.path
        self.url, self.control = self._wait_up()
        self.log_tail: collections.deque[str] = collections.deque(maxlen=50)
        threading.Thread(target=self._drain, name="proxy-stderr", daemon=True).start()

    def _drain(self) -> None:
        """Keep reading the proxy's log (a full pipe would stall it); the tail is printed at the end."""
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log_tail.append(line)

    def _wait_up(self) -> tuple[str, str]:
        deadline = time.monotonic() + _PROXY_START_TIMEOUT_S
        seen = []
        assert self.proc.stderr is not None
        os.set_blocking(self.proc.stderr.fileno(), True)
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            seen.append(line)
            if m := _UP_RE.search(line):
                return m.group(1), m.group(2)
        self.kill()
        raise RuntimeError(f"proxy did not start: {''.join(seen)[-2000:]}")

    def cpu_s(self) -> float:
        """User + system CPU seconds so far of the proxy process and its live children (--workers: the relay
        workers; they are not restarted during a run, so none of their time is lost to reaping), from /proc."""
        return sum(_cpu_s(pid) for pid in [self.proc.pid, *_children(self.proc.pid)])

    def coordinator_cpu_s(self) -> float:
        """The proxy process alone (with --workers: the coordinator)."""
        return _cpu_s(self.proc.pid)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid:
                out.append(int(entry.name))
    return out


# ---- clients -----------------------------------------------------------------------------------------


class Tally:
    def __init__(self) -> None:
        self.tokens = 0
        self.gaps_s: list[float] = []
        self.failed = 0
        self.measuring = False
        self.errors: dict[str, int] = {}

    def fail(self, what: str) -> None:
        self.failed += 1
        self.errors[what] = self.errors.get(what, 0) + 1


async def client_loop(client: httpx.AsyncClient, tally: Tally, stop_at: float, max_tokens: int, seed: int) -> None:
    prompt = [(seed * 31 + i) % 90 + 10 for i in range(32)]
    body = {"model": "fake-model", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    clock = time.perf_counter  # uvloop's loop.time() has 1 ms resolution
    while clock() < stop_at:
        last: float | None = None
        tail = b""
        try:
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    tally.fail(f"{resp.status_code} {(await resp.aread())[:200]!r}")
                    continue
                async for chunk in resp.aiter_raw():
                    now = clock()
                    if last is not None and tally.measuring:
                        tally.gaps_s.append(now - last)
                    last = now
                    tail = (tail + chunk)[-400:]
        except httpx.HTTPError as exc:
            tally.fail(f"{type(exc).__name__}: {exc}"[:200])
            continue
        m = re.search(rb'"completion_tokens":\s*(\d+)', tail)
        if m is None:
            tally.fail(f"no usage at the end: {tail[-200:]!r}")
        elif tally.measuring:
            tally.tokens += int(m.group(1))


async def measure(proxy: ProxyChild, decoders: list[FakeVllm], *, streams: int, token_delay_s: float,
                  max_tokens: int, warmup_s: float, duration_s: float, profile_to: str | None = None,
                  events_per_write: int = 1) -> dict[str, Any]:
    for d in decoders:
        d.token_delay_s = token_delay_s
        d.events_per_write = events_per_write
    tally = Tally()
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    async with httpx.AsyncClient(base_url=proxy.url, timeout=_CLIENT_TIMEOUT_S, trust_env=False,
                                 limits=limits) as client:
        stop_at = time.perf_counter() + warmup_s + duration_s
        tasks = [asyncio.create_task(client_loop(client, tally, stop_at, max_tokens, i)) for i in range(streams)]
        await asyncio.sleep(warmup_s)
        tally.measuring = True
        cpu0, own0, t0 = proxy.cpu_s(), time.process_time(), time.perf_counter()
        coord0 = proxy.coordinator_cpu_s()
        spy = _pyspy(proxy, duration_s, profile_to)
        await asyncio.sleep(duration_s)
        if spy is not None:
            spy.wait(30)
        cpu1, own1, t1 = proxy.cpu_s(), time.process_time(), time.perf_counter()
        coord1 = proxy.coordinator_cpu_s()
        tally.measuring = False
        # tokens of streams that finish after the window are not counted; those before it were
        await asyncio.wait(tasks, timeout=_CLIENT_TIMEOUT_S)
    wall_s = t1 - t0
    gaps_ms = sorted(g * 1e3 for g in tally.gaps_s)
    tokens = max(tally.tokens, 1)
    return {
        "streams": streams,
        "decoder_gap_ms": round(token_delay_s * 1e3, 3),
        "offered_tok_s": round(streams / token_delay_s) if token_delay_s else None,
        "events_per_write": events_per_write,
        "tokens_s": round(tally.tokens / wall_s),
        "proxy_us_token": round((cpu1 - cpu0) / tokens * 1e6, 1),
        "proxy_cpu_util": round((cpu1 - cpu0) / wall_s, 2),
        "coordinator_cpu_util": round((coord1 - coord0) / wall_s, 2),  # = proxy_cpu_util with one process
        "bench_cpu_util": round((own1 - own0) / wall_s, 2),
        "gap_ms_p50": round(_pct(gaps_ms, 50), 2),
        "gap_ms_p99": round(_pct(gaps_ms, 99), 2),
        "failed": tally.failed,
        "errors": dict(sorted(tally.errors.items(), key=lambda kv: -kv[1])[:3]),
    }


def _pyspy(proxy: ProxyChild, duration_s: float, profile_to: str | None) -> subprocess.Popen[bytes] | None:
    """py-spy (``--pyspy``: its executable) sampling the proxy over the window, collapsed stacks."""
    if profile_to is None or not os.environ.get("PYSPY"):
        return None
    return subprocess.Popen([os.environ["PYSPY"], "record", "-p", str(proxy.proc.pid), "-d", str(int(duration_s)),
                             "-f", "raw", "-o", profile_to, "-r", "200", "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q / 100))]


# ---- one variant: proxy + fakes ----------------------------------------------------------------------


async def run_variant(name: str, rep: int, pythonpath: str, tokenizer_dir: str, args: argparse.Namespace,
                      workers: int = 1) -> list[dict[str, Any]]:
    proxy = ProxyChild(pythonpath, tokenizer_dir, loop="asyncio" if name.endswith("-asyncio") else "auto",
                       workers=workers)
    network = KvNetwork()
    nodes: list[tuple[FakeVllm, FakeAgent]] = []
    try:
        prefill = PacedVllm("prefill-0")
        prefill.model = fixed_model
        await prefill.server.start()
        prefill.kv_sink = network.deliver
        nodes.append((prefill, FakeAgent(proxy.control, "sender", prefill.url)))
        decoders = []
        for i in range(args.decoders):
            dec = PacedVllm(f"decode-{i}")
            dec.model = fixed_model
            await dec.server.start()
            agent = FakeAgent(proxy.control, "receiver", dec.url, base_port=21000 + 1000 * i, capacity_slots=4096)
            network.add(agent)
            nodes.append((dec, agent))
            decoders.append(dec)
        for _, agent in nodes:
            await agent.announce()
        await _wait_routable(proxy.url, 1 + args.decoders)
        heartbeat = asyncio.create_task(_heartbeat([agent for _, agent in nodes]))
        for _ in range(4 * workers):  # each on its own connection: every worker serves one (SO_REUSEPORT)
            await _first_request(proxy.url)
        rows = []
        points = [("capacity", args.capacity_streams, 0.0, 1)]
        for rate in args.offered_tok_s:
            points.append((f"offered-{rate}", args.rate_streams, args.rate_streams / rate, 1))
            if args.backlog_events > 1:
                points.append((f"offered-{rate}-backlog-{args.backlog_events}", args.rate_streams,
                               args.rate_streams / rate, args.backlog_events))
        for point, streams, delay_s, per_write in points:
            row = await measure(proxy, decoders, streams=streams, token_delay_s=delay_s, max_tokens=args.max_tokens,
                                warmup_s=args.warmup_s, duration_s=args.duration_s,
                                profile_to=f"/tmp/proxy_relay_{name}_{point}.txt", events_per_write=per_write)
            rows.append({"variant": name, "workers": workers, "rep": rep, "point": point, **row})
            print(_fmt(rows[-1]), flush=True)
        heartbeat.cancel()
        return rows
    finally:
        for _, agent in nodes:
            agent.close()
        await asyncio.gather(*(v.server.stop() for v, _ in nodes))
        proxy.kill()
        if proxy.log_tail:
            print(f"{name} proxy's last log lines:\n" + "".join(proxy.log_tail), file=sys.stderr)


async def _heartbeat(agents: list[FakeAgent], interval_s: float = 1.0) -> None:
    """Re-announce (an instance's heartbeat) so that the proxy's TTL keeps them registered."""
    while True:
        await asyncio.sleep(interval_s)
        for agent in agents:
            await agent.announce()


async def _first_request(url: str) -> None:
    """One request through, so that the proxy's tokenizer is loaded before anything is measured."""
    body = {"model": "fake-model", "prompt": list(range(10, 42)), "max_tokens": 4, "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=_PROXY_START_TIMEOUT_S, trust_env=False) as client:
        resp = await client.post("/v1/completions", json=body)
        if resp.status_code != 200:
            raise RuntimeError(f"the first request failed: {resp.status_code} {resp.text[:300]}")


async def _wait_routable(url: str, n: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(trust_env=False) as client:
        while time.monotonic() < deadline:
            health = (await client.get(url + "/health")).json()
            if health["prefillers"] + health["decoders"] >= n:
                return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"instances not routable within {timeout_s} s: {health}")


_COLS = ("variant", "workers", "rep", "point", "streams", "decoder_gap_ms", "tokens_s", "proxy_us_token", "proxy_cpu_util",
         "coordinator_cpu_util", "bench_cpu_util", "gap_ms_p50", "gap_ms_p99", "failed")


def _fmt(row: dict[str, Any]) -> str:
    return "  ".join(f"{row[c]!s:>14}" for c in _COLS)


# ---- setup ---------------------------------------------------------------------------------------------


def baseline_tree(ref: str, into: Path) -> str:
    """``lmcache_p2p`` at ``ref``, extracted under ``into``; returns the PYTHONPATH for it."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "lmcache_p2p"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return str(into)


def variant_trees(tmp_path: Path, variants: str, baseline_ref: str,
                  current: Sequence[str] = ("current",)) -> tuple[str, dict[str, str]]:
    """The tokenizer folder and each variant's PYTHONPATH: this checkout for ``current`` names, and
    ``baseline_ref`` extracted under ``tmp_path`` when ``variants`` lists the baseline."""
    (tmp_path / "tok").mkdir()
    (tmp_path / "base").mkdir()
    tok = tokenizer_folder(tmp_path / "tok")
    paths = {name: str(REPO) for name in current}
    if "baseline" in variants:
        paths["baseline"] = baseline_tree(baseline_ref, tmp_path / "base")
    return tok, paths


def write_result(out: str, result: dict[str, Any]) -> None:
    """Write a bench's ``{"meta", "rows", "summary"}`` to ``out`` and print its summary."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))


def tokenizer_folder(into: Path) -> str:
    """The tiny model's byte-level BPE tokenizer (what the proxy detokenizes with)."""
    from lmcache_p2p.cli.tiny_model import _train_tokenizer

    _train_tokenizer(0).save_pretrained(into)
    return str(into)


def metadata(args: argparse.Namespace, load_before: float) -> dict[str, Any]:
    """bench/meta.py's block plus this run's baseline and arguments."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from meta import collect  # bench/ is not a package

    return {**collect(), "load_1m_before": round(load_before, 2), "baseline_ref": args.baseline_ref,
            "args": {k: v for k, v in vars(args).items()}}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-ref", default=BASELINE_REF, help="git ref of the 'baseline' proxy")
    p.add_argument("--variants", default="baseline,current,current-asyncio",
                   help="baseline: the proxy at --baseline-ref; current: this tree; current-asyncio: this tree on "
                        "asyncio's loop instead of uvloop")
    p.add_argument("--reps", type=int, default=3, help="runs of each variant (medians are summarized)")
    p.add_argument("--workers", type=int, nargs="+", default=[1],
                   help="the proxy's --workers, one set of rows per count (the baseline runs with 1 only: it has "
                        "no such flag); proxy CPU is the coordinator's plus its workers'")
    p.add_argument("--decoders", type=int, default=1)
    p.add_argument("--capacity-streams", type=int, default=32)
    p.add_argument("--rate-streams", type=int, default=32)
    p.add_argument("--offered-tok-s", type=int, nargs="*", default=[4000])
    p.add_argument("--backlog-events", type=int, default=4,
                   help="also each offered rate with the decoder writing this many events at once (1: not)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--warmup-s", type=float, default=2.0)
    p.add_argument("--duration-s", type=float, default=6.0)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "proxy_relay.json"))
    return p.parse_args()


async def main() -> None:
    args = parse_args()
    load_before = os.getloadavg()[0]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="proxy_relay_") as tmp:
        tok, paths = variant_trees(Path(tmp), args.variants, args.baseline_ref, ("current", "current-asyncio"))
        print("  ".join(f"{c:>14}" for c in _COLS), flush=True)
        for rep in range(args.reps):  # variants interleaved: the machine's load drifts
            for name in args.variants.split(","):
                for workers in ([1] if name == "baseline" else args.workers):
                    rows += await run_variant(name, rep, paths[name], tok, args, workers)
    write_result(args.out, {"meta": metadata(args, load_before), "rows": rows, "summary": _summary(rows)})


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (variant, point): medians over the repetitions, and the ratio to the baseline's."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        variant = row["variant"] if row.get("workers", 1) == 1 else f"{row['variant']}-workers{row['workers']}"
        groups.setdefault((variant, row["point"]), []).append(row)
    keys = ("tokens_s", "proxy_us_token", "proxy_cpu_util", "coordinator_cpu_util", "gap_ms_p50", "gap_ms_p99", "failed")
    medians = {g: {k: statistics.median(r[k] for r in rs) for k in keys} for g, rs in groups.items()}
    out: dict[str, Any] = {}
    for (variant, point), med in medians.items():
        entry = {**med, "reps": len(groups[(variant, point)])}
        base = medians.get(("baseline", point))
        if variant != "baseline" and base is not None:
            entry["tokens_s_x_baseline"] = round(med["tokens_s"] / max(base["tokens_s"], 1), 2)
            entry["us_token_x_baseline"] = round(med["proxy_us_token"] / max(base["proxy_us_token"], 1e-9), 2)
        out[f"{variant} {point}"] = entry
    return out


if __name__ == "__main__":
    try:
        import uvloop  # the fakes and clients on uvloop: less of this process's CPU per token

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main())
