"""Time the same prompts, one at a time, against several endpoints, to attribute a TTFT gap.

Each case is one way of asking for the first token:

  stream URL      streamed /v1/completions (max_tokens 32, ignore_eos): time to the first SSE data line
                  (what bench/anchor.py's client measures as TTFT)
  prefill URL     the proxy's prefill request, sent straight to an instance: non-streamed, max_tokens 1,
                  return_token_ids (shaping.prefill_body); with ``--kv HOST:CTRL:XPORT`` it carries the
                  kv_transfer_params the proxy would send (the KV then really goes to that decoder)
  prefill_kv URL  that body with kv_transfer_params (``--kv``; ``--case-kv NAME=HOST:CTRL:XPORT`` gives
                  one case its own target, e.g. a port nothing listens on)

Cases are interleaved per prompt (prompt 0 on every case, then prompt 1 ...), so noise hits every
case alike; ``--reps`` repeats the whole pass. Prints p50 / mean per case and writes ``--out`` JSON.

    python bench/ttft_probe.py --workload runs/anchor/workload.json --model tiny \\
        --case single=stream:http://127.0.0.1:8300 --reps 3 --out /tmp/probe.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import httpx


def parse_case(text: str) -> tuple[str, str, str]:
    name, rest = text.split("=", 1)
    kind, url = rest.split(":", 1)
    if kind not in ("stream", "prefill", "prefill_kv"):
        raise SystemExit(f"--case {text}: kind must be stream, prefill or prefill_kv")
    return name, kind, url


def kv_params(kv: str) -> dict[str, Any]:
    host, ctrl, xport = kv.split(":")
    return {"ret_first_tok": True, "disagg_spec": {"req_id": uuid.uuid4().hex, "receiver_host": host,
                                                   "receiver_init_port": [int(xport)],
                                                   "receiver_alloc_port": [int(ctrl)]}}


async def one(client: httpx.AsyncClient, kind: str, url: str, model: str, prompt: str, kv: str | None) -> float:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "temperature": 0, "return_token_ids": True}
    t0 = time.perf_counter()
    if kind == "stream":
        body.update(max_tokens=32, ignore_eos=True, stream=True)
        async with client.stream("POST", f"{url}/v1/completions", json=body) as s:
            s.raise_for_status()
            first = None
            async for part in s.aiter_bytes():
                if first is None and b"data:" in part:
                    first = time.perf_counter() - t0
            return first if first is not None else float("nan")
    body.update(max_tokens=1, ignore_eos=True, stream=False)
    if kind == "prefill_kv":
        body["kv_transfer_params"] = kv_params(kv or "127.0.0.1:7300:7500")
    resp = await client.post(f"{url}/v1/completions", json=body)
    resp.raise_for_status()
    return time.perf_counter() - t0


async def run(args: argparse.Namespace) -> dict[str, Any]:
    workload = json.loads(Path(args.workload).read_text())[: args.n]
    cases = [parse_case(c) for c in args.case]
    out: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    kv_of = {name: args.kv for name, _, _ in cases}
    kv_of.update(dict(c.split("=", 1) for c in args.case_kv))
    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
        for name, kind, url in cases:  # warm-up: one unrecorded request each
            await one(client, kind, url, args.model, workload[0]["prompt"], kv_of[name])
        for _ in range(args.reps):
            for w in workload:
                for name, kind, url in cases:
                    out[name].append(await one(client, kind, url, args.model, w["prompt"], kv_of[name]))
                    await asyncio.sleep(args.gap_s)
    return {name: [round(x * 1e3, 3) for x in xs] for name, xs in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--case", action="append", required=True, help="NAME=KIND:URL (KIND stream, prefill, prefill_kv)")
    p.add_argument("--kv", default=None, help="HOST:CTRL_PORT:TRANSPORT_PORT of the decoder for prefill_kv")
    p.add_argument("--case-kv", action="append", default=[], help="NAME=HOST:CTRL:XPORT: that case's KV target")
    p.add_argument("--n", type=int, default=48)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--gap-s", type=float, default=0.0, help="pause between requests")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import os

    load = os.getloadavg()[0]
    result = asyncio.run(run(args))
    for name, xs in result.items():
        print(f"{name:24s} n={len(xs):3d} p50={statistics.median(xs):7.2f} mean={statistics.fmean(xs):7.2f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps({"load_1m_before": load, "argv": vars(args), "ms": result}, indent=1))


if __name__ == "__main__":
    main()
