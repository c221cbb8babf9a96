"""The streamed load client of ``bench/anchor.py``: every system gets exactly this one.

The anchor's ``bench.py --mode single`` (``../shared/anchor/bench.py``) with, per request, the arrival
time of every SSE chunk that carries tokens, so that TPOT and inter-token latency come from the same
stream that gives TTFT. Requests: streaming ``/v1/completions``, temperature 0, ``ignore_eos``,
``return_token_ids``, ``max_tokens``. TTFT = the first SSE data line at the client (as bench.py).
Loads: ``cN`` (N closed-loop workers over the prompts) or ``open`` (the workload's arrival times).

    python bench/anchor_client.py --url URL --load c1|cN|open --workload FILE --model NAME --out FILE
                                  [--n N] [--max-tokens 32] [--timeout 120]

Output JSON: ``{"mode": "single", "load", "t0", "t1", "max_tokens", "res": [{i, target, t_send,
t_first, t_chunks, chunk_tokens, t_done_client, http, ok, token_ids, text, prompt_tokens, error}]}``
(bench.py's fields plus ``t_chunks``/``chunk_tokens``), so ``bench/anchor.py`` reads either.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx


def body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}


def feed_line(rec: dict[str, Any], line: str, now: float) -> None:
    """One SSE line of a completion stream into ``rec`` (token ids, text, chunk times)."""
    if not line.startswith("data:"):
        return
    rec.setdefault("t_first", now)
    data = line[5:].strip()
    if data == "[DONE]":
        return
    event = json.loads(data)
    for choice in event.get("choices") or ():
        ids = choice.get("token_ids") or []
        rec["token_ids"] += ids
        rec["text"] += choice.get("text") or ""
        if choice.get("prompt_token_ids"):
            rec["prompt_tokens"] = len(choice["prompt_token_ids"])
        if ids or choice.get("text"):  # LMCache PD's proxy streams its first token as text only
            rec["t_chunks"].append(now)
            rec["chunk_tokens"].append(len(ids))


async def one(client: httpx.AsyncClient, url: str, model: str, w: Mapping[str, Any], max_tokens: int,
              timeout_s: float) -> dict[str, Any]:
    rec: dict[str, Any] = {"i": w["i"], "target": w.get("target"), "t_send": time.time(), "ok": False,
                           "token_ids": [], "text": "", "t_chunks": [], "chunk_tokens": []}

    async def stream() -> None:
        async with client.stream("POST", f"{url}/v1/completions", json=body(model, w["prompt"], max_tokens)) as s:
            rec["http"] = s.status_code
            if s.status_code != 200:
                rec["error"] = (await s.aread()).decode(errors="replace")[:300]
                return
            buf = b""
            async for part in s.aiter_bytes():  # split on "\n" only (aiter_lines also splits at U+0085)
                buf += part
                now = time.time()
                while b"\n" in buf:
                    raw, buf = buf.split(b"\n", 1)
                    feed_line(rec, raw.rstrip(b"\r").decode(), now)
        rec["ok"] = True

    try:
        await asyncio.wait_for(stream(), timeout_s)
    except asyncio.TimeoutError:
        rec["ok"], rec["error"] = False, f"client timeout {timeout_s}s (hang)"
    except (httpx.HTTPError, ValueError, OSError) as exc:
        rec["ok"], rec["error"] = False, f"{type(exc).__name__}: {str(exc)[:200]}"
    rec["t_done_client"] = time.time()
    return rec


async def run(url: str, model: str, prompts: Sequence[Mapping[str, Any]], load: str, max_tokens: int,
              timeout_s: float) -> dict[str, Any]:
    res: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=128)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits, trust_env=False) as client:
        t0 = time.time()
        if load.startswith("c"):
            queue: asyncio.Queue[Mapping[str, Any]] = asyncio.Queue()
            for w in prompts:
                queue.put_nowait(w)

            async def worker() -> None:
                while not queue.empty():
                    res.append(await one(client, url, model, queue.get_nowait(), max_tokens, timeout_s))

            await asyncio.gather(*(worker() for _ in range(int(load[1:]))))
        else:
            base = prompts[0]["arrival_s"]

            async def scheduled(w: Mapping[str, Any]) -> None:
                await asyncio.sleep(max(0.0, t0 + w["arrival_s"] - base - time.time()))
                res.append(await one(client, url, model, w, max_tokens, timeout_s))

            await asyncio.gather(*(scheduled(w) for w in prompts))
        t1 = time.time()
    res.sort(key=lambda r: r["i"])
    return {"mode": "single", "load": load, "t0": t0, "t1": t1, "max_tokens": max_tokens, "res": res}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--load", required=True, help="cN (closed loop, N workers) or open")
    p.add_argument("--workload", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=None, help="the first N prompts")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=120.0, help="per request, s (a hang shows as this)")
    a = p.parse_args()
    if a.load != "open" and not (a.load.startswith("c") and a.load[1:].isdigit() and int(a.load[1:]) > 0):
        p.error(f"--load must be cN or open, got {a.load!r}")
    with open(a.workload) as f:
        prompts = json.load(f)[: a.n] if a.n else json.load(f)
    result = asyncio.run(run(a.url, a.model, prompts, a.load, a.max_tokens, a.timeout))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f)
    ok = sum(r["ok"] for r in result["res"])
    print(f"{a.load}: {ok}/{len(result['res'])} ok, wall {result['t1'] - result['t0']:.2f}s -> {a.out}", flush=True)
    for r in result["res"]:
        if not r["ok"]:
            print("  FAIL", r["i"], r.get("http"), r.get("error"), flush=True)


if __name__ == "__main__":
    main()
