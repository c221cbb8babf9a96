"""Attribute the decoder's share of the handover (``decode_first``) on a real 1P1D vLLM-CPU pair.

``decode_first`` (the proxy's timeline) = decode request sent -> the decoder's first streamed byte.
This starts ``lmcache-p2p launch --prefill 1 --decode 1`` once per *variant* (an environment
given to the launcher and so to every vLLM it starts, e.g. ``LMCACHE_P2P_VLLM_SPIN_S=0.02``), runs
closed-loop loads through the proxy (the anchor's prompts, streamed, 32 tokens, greedy), and per
load reads:

  * the proxy's ``GET /stats`` timeline (reset before the load): ``decode_first`` and the rest;
  * the decoder's vLLM ``/metrics`` deltas over the load (means: sum / count): TTFT as vLLM sees it
    (API server arrival -> first token out of the output processor), queue (engine core: queued ->
    scheduled), prefill (scheduled -> first token, the forward with LMCache's load inside);
  * the decoder log's LMCache lines over the load: ``Retrieved ... cost X ms`` (the retrieve:
    our ``batched_get_blocking`` + the CPU connector's copy into vLLM's KV cache).

Variants are run round-robin (``--rounds``: A B A B ...) in one sitting so drift hits each alike;
every start and load holds ``/tmp/lmcache_p2p_vllm.lock`` (take it outside: ``flock ... python
bench/decode_probe.py``). ``--spy`` records the decoder's processes with py-spy (``$PY_SPY``, default
``py-spy`` on PATH) during the last load. A variant runs the code on its ``PYTHONPATH`` (default:
this checkout); to compare commits, extract each (``git archive REV lmcache_p2p configs | tar -x -C
DIR``) and give ``--variant NAME=PYTHONPATH=DIR``. Writes ``--out`` JSON (per load: the rows printed,
the proxy timeline, per-request decode_first, per-thread CPU ms per request, output token ids).

    flock /tmp/lmcache_p2p_vllm.lock timeout 1800 .venv/bin/python bench/decode_probe.py \\
        --model runs/anchor/tiny-llama --workload runs/anchor/workload.json \\
        --variant base= --variant spin20=LMCACHE_P2P_VLLM_SPIN_S=0.02 --rounds 2 --out /tmp/p.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
PROXY_PORT = 9100
DECODER_URL = "http://127.0.0.1:7200"
STARTUP_TIMEOUT_S = 300
STOP_TIMEOUT_S = 60
REQUEST_TIMEOUT_S = 60
PY_SPY = os.environ.get("PY_SPY", "py-spy")  # --spy: py-spy is not a dependency; install it in a scratch venv
RETRIEVED_RE = re.compile(r"Retrieved (\d+) out of (\d+) required tokens .*?cost ([0-9.]+) ms")
METRICS = ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
           "vllm:request_prefill_time_seconds", "vllm:e2e_request_latency_seconds")


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, rest = text.partition("=")
    env = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    return name, env


def metric_sums(text: str) -> dict[str, tuple[float, float]]:
    """{metric: (sum, count)} of the histograms in METRICS (summed over label sets)."""
    out: dict[str, list[float]] = {m: [0.0, 0.0] for m in METRICS}
    for line in text.splitlines():
        for m in METRICS:
            if line.startswith(m + "_sum"):
                out[m][0] += float(line.rsplit(" ", 1)[1])
            elif line.startswith(m + "_count"):
                out[m][1] += float(line.rsplit(" ", 1)[1])
    return {m: (s, c) for m, (s, c) in out.items()}


def metric_means_ms(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, Any]:
    means = {}
    for m in METRICS:
        ds, dc = after[m][0] - before[m][0], after[m][1] - before[m][1]
        means[m.split(":", 1)[1].replace("_seconds", "")] = round(ds / dc * 1e3, 3) if dc else None
    return means


class Pair:
    """``lmcache-p2p launch --prefill 1 --decode 1`` with an extra environment."""

    def __init__(self, model: Path, log_dir: Path, env: dict[str, str], extra_args: list[str]) -> None:
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "lmcache_p2p.cli.main", "launch", "--prefill", "1", "--decode", "1",
                "--model", str(model), "--proxy-port", str(PROXY_PORT), "--max-model-len", "2048",
                "--log-dir", str(log_dir), "--no-prefix-caching",
                *[f"--vllm-arg={a}" for a in ("--max-num-seqs", "256", "--max-num-batched-tokens", "16384",
                                              "--dtype", "bfloat16")], *extra_args]
        # The code a variant runs is the one on its PYTHONPATH (default: this checkout). The launcher
        # and vLLM run with ``python -m``, which puts the working directory first on sys.path: run
        # them in the log folder, or every variant would import the checkout it was started from.
        env = {**os.environ, "PYTHONPATH": str(REPO), **env}
        with open(log_dir / "launch.log", "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env=env, cwd=log_dir)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"launch exited {self.proc.returncode}: {log_dir}/launch.log")
            try:
                health = httpx.get(f"http://127.0.0.1:{PROXY_PORT}/health", timeout=5, trust_env=False).json()
                if (health.get("prefillers"), health.get("decoders")) == (1, 1):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"not up within {STARTUP_TIMEOUT_S} s: {log_dir}/launch.log")
            time.sleep(1)

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=STOP_TIMEOUT_S)

    def decoder_log_text(self) -> str:
        path = self.log_dir / "decoder-0.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def decoder_pids(self) -> list[int]:
        """The decoder's API server and every process below it (engine core, worker)."""
        out = subprocess.run(["pgrep", "-f", "--", "--port 7200"], capture_output=True, text=True).stdout.split()
        todo, pids = [int(p) for p in out], []
        while todo:
            pid = todo.pop()
            pids.append(pid)
            todo += [int(c) for c in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                                                    text=True).stdout.split()]
        return pids


def thread_ticks(pids: list[int]) -> dict[str, int]:
    """CPU ticks (user + system) per (process name / thread name), summed over same-named threads."""
    out: dict[str, int] = {}
    for pid in pids:
        try:
            pname = Path(f"/proc/{pid}/comm").read_text().strip()
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                tname = (task / "comm").read_text().strip()
            except OSError:
                continue
            key = f"{pname}/{tname}"
            out[key] = out.get(key, 0) + int(fields[11]) + int(fields[12])
    return out


async def one(client: httpx.AsyncClient, model: str, prompt: str) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "temperature": 0, "max_tokens": 32, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    t0 = time.perf_counter()
    first = None
    ids: list[int] = []
    async with client.stream("POST", f"http://127.0.0.1:{PROXY_PORT}/v1/completions", json=body) as s:
        s.raise_for_status()
        async for line in s.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter() - t0
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or ():
                ids += choice.get("token_ids") or []
    return {"ttft_ms": round((first or float("nan")) * 1e3, 3), "token_ids": ids}


async def closed_loop(model: str, prompts: list[str], concurrency: int) -> list[dict[str, Any]]:
    todo = list(enumerate(prompts))
    out: dict[int, dict[str, Any]] = {}
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, trust_env=False) as client:
        async def worker() -> None:
            while todo:
                i, p = todo.pop(0)
                out[i] = await one(client, model, p)
        await asyncio.gather(*[worker() for _ in range(concurrency)])
    return [out[i] for i in range(len(prompts))]


def measure(pair: Pair, model: str, prompts: list[str], concurrency: int, spy: Path | None) -> dict[str, Any]:
    httpx.post(f"http://127.0.0.1:{PROXY_PORT}/stats/reset", timeout=5, trust_env=False).raise_for_status()
    before = metric_sums(httpx.get(f"{DECODER_URL}/metrics", timeout=5, trust_env=False).text)
    log_at = len(pair.decoder_log_text())
    load = os.getloadavg()[0]
    pids = pair.decoder_pids()
    ticks_before = thread_ticks(pids)
    spies = []
    if spy is not None:
        for pid in pids:
            spies.append(subprocess.Popen([PY_SPY, "record", "-r", "250", "--nonblocking", "-f", "raw",
                                           "-p", str(pid), "-o", f"{spy}_{pid}.txt", "-d", "60"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1.0)
    t0 = time.perf_counter()
    records = asyncio.run(closed_loop(model, prompts, concurrency))
    wall = time.perf_counter() - t0
    for s in spies:
        s.send_signal(signal.SIGINT)
    for s in spies:
        try:
            s.wait(timeout=30)
        except subprocess.TimeoutExpired:
            s.kill()
            s.wait(timeout=10)
    ticks_after = thread_ticks(pids)
    hz = os.sysconf("SC_CLK_TCK")
    cpu_ms = {k: round((v - ticks_before.get(k, 0)) * 1e3 / hz / len(prompts), 3) for k, v in ticks_after.items()
              if v - ticks_before.get(k, 0) > 0}
    after = metric_sums(httpx.get(f"{DECODER_URL}/metrics", timeout=5, trust_env=False).text)
    stats = httpx.get(f"http://127.0.0.1:{PROXY_PORT}/stats", timeout=5, trust_env=False).json()
    retrieved = [float(c) for _, _, c in RETRIEVED_RE.findall(pair.decoder_log_text()[log_at:])]
    timeline = {k: v.get("p50") for k, v in (stats.get("timeline_ms") or {}).items() if isinstance(v, dict)}
    return {
        "load_1m_before": load, "wall_s": round(wall, 3),
        "ttft_ms_p50": statistics.median(r["ttft_ms"] for r in records),
        "timeline_p50_ms": timeline,
        "timeline_ms": {k: v for k, v in (stats.get("timeline_ms") or {}).items() if isinstance(v, dict)},
        "decoder_vllm_mean_ms": metric_means_ms(before, after),
        "retrieve_ms": {"n": len(retrieved), "p50": statistics.median(retrieved) if retrieved else None,
                        "mean": round(statistics.fmean(retrieved), 3) if retrieved else None},
        "decoder_cpu_ms_per_request": dict(sorted(cpu_ms.items(), key=lambda kv: -kv[1])),
        "decode_first_ms": [r.get("decode_first") for r in (stats.get("recent") or [])],
        "token_ids": [r["token_ids"] for r in records],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--workload", type=Path, required=True)
    p.add_argument("--variant", action="append", required=True, help="NAME=ENV=VALUE,ENV2=VALUE2 (NAME= for none)")
    p.add_argument("--launch-arg", action="append", default=[], help="NAME=ARG: an extra launch argument for NAME")
    p.add_argument("--loads", default="1,4")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--n", type=int, default=48)
    p.add_argument("--passes", type=int, default=1, help="send the prompts this many times per load")
    p.add_argument("--spy", action="store_true", help="py-spy the decoder during each variant's last load")
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/decode_probe"))
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    variants = [parse_variant(v) for v in args.variant]
    launch_args: dict[str, list[str]] = {}
    for la in args.launch_arg:
        name, arg = la.split("=", 1)
        launch_args.setdefault(name, []).append(arg)
    prompts = [w["prompt"] for w in json.loads(args.workload.read_text())][: args.n] * args.passes
    model = str(args.model.resolve())
    loads = [int(c) for c in args.loads.split(",")]
    result: dict[str, Any] = {"argv": sys.argv, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "runs": []}
    for rnd in range(args.rounds):
        for name, env in variants:
            log_dir = args.log_dir / f"r{rnd}_{name}"
            load_before_start = os.getloadavg()[0]
            pair = Pair(args.model.resolve(), log_dir, env, launch_args.get(name, []))
            try:
                asyncio.run(closed_loop(model, prompts[:4], 1))  # warm-up, unrecorded
                for c in loads:
                    spy = log_dir / f"spy_c{c}" if args.spy and c == loads[-1] else None
                    row = measure(pair, model, prompts, c, spy)
                    row.update(round=rnd, variant=name, env=env, concurrency=c, load_1m_before_start=load_before_start)
                    result["runs"].append(row)
                    tl = row["timeline_p50_ms"]
                    print(f"r{rnd} {name:10s} c{c}: ttft {row['ttft_ms_p50']:.2f} decode_first "
                          f"{tl.get('decode_first')} kv_wait {tl.get('kv_wait')} transfer "
                          f"{tl.get('transfer')} vllm {row['decoder_vllm_mean_ms']} "
                          f"retrieve {row['retrieve_ms']} load {row['load_1m_before']:.2f}\n    cpu/req "
                          f"{list(row['decoder_cpu_ms_per_request'].items())[:8]}", flush=True)
                    args.out.write_text(json.dumps(result, indent=1))
            finally:
                pair.stop()
    ref = None
    for row in result["runs"]:
        key = row["concurrency"]
        ref = ref or {}
        if key in ref and ref[key] != row["token_ids"]:
            print(f"outputs differ: {row['variant']} r{row['round']} c{key}")
        ref.setdefault(key, row["token_ids"])
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
