"""The proxy's own share of the PD handover, without vLLM: prefill answer -> decode request -> client.

The handover (issues 7 and 9) is the time from the prefiller's answer to the first decoded token.
Its proxy share is what happens between the instances: read the prefill answer, write the first
token to the client, learn that the KV is ready, build and send the decode request, relay the
decoder's first token. This bench starts the real proxy as a child process (``lmcache-p2p proxy``
with a tokenizer, as ``launch`` runs it) with fake instances from ``tests/proxy/fakes.py`` in this
process: a prefiller that answers at once (KV "ready" on the decoder at once, or after
``--kv-delay-ms``) and a decoder whose first token goes out the moment its request arrives, the
rest paced at ``--token-delay-ms``. N closed-loop streaming clients (token-id prompts, one
``/v1/completions`` each at a time). The fakes stamp, per request, on this machine's monotonic
clock (``time.perf_counter``: one clock for every process here):

  answer_to_decode_ms   prefiller's answer handed to its server -> the decode request at the decoder
  answer_to_first_ms    prefiller's answer -> the client has the first token (the proxy's first byte)
  answer_to_second_ms   prefiller's answer -> the client has the first decoded token (the handover as
                        a client sees it: the decoder adds ~nothing here)

and the proxy's own ``/stats`` (reset after the warm-up) gives its ``handover_ms`` and ``timeline_ms``
phases (first_byte, kv_wait, decode_start, decode_first). Variants: ``baseline`` (the proxy at
``--baseline-ref``, extracted with ``git archive``) and ``current`` (this tree), each with every
``--workers`` count, side by side in one run, interleaved per repetition.

    flock /tmp/lmcache_p2p_vllm.lock timeout 900 env PYTHONPATH=$PWD .venv/bin/python bench/proxy_handover.py

Writes ``bench/results/proxy_handover.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from starlette.requests import Request

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proxy_relay import (  # noqa: E402  (bench/ is not a package)
    REPO,
    PacedVllm,
    ProxyChild,
    _heartbeat,
    _first_request,
    _pct,
    _pyspy,
    _wait_routable,
    fixed_model,
    metadata,
    variant_trees,
    write_result,
)

from proxy.fakes import FakeAgent, KvNetwork  # noqa: E402  (tests/ is on the path: proxy_relay put it there)

BASELINE_REF = "527db97"  # main before this work (branch fast's base)
_CLIENT_TIMEOUT_S = 60.0
_PROMPT_TOKENS = 64
_KEY_IDS = 16  # a prompt's first ids name its request (unique per request in both prompt kinds)


def _key(prompt: list[int]) -> tuple[int, ...]:
    return tuple(prompt[:_KEY_IDS])


class StampedVllm(PacedVllm):
    """A fake instance that stamps, per prompt key, when its prefill answered / its decode arrived; a
    decode's first token is written at once, the others paced at ``token_delay_s``."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.answered_s: dict[tuple[int, ...], float] = {}
        self.decode_at_s: dict[tuple[int, ...], float] = {}

    async def _completions(self, request: Request) -> Any:
        arrived = time.perf_counter()
        body = await request.json()
        if body.get("stream"):
            self.decode_at_s[_key(body["prompt"])] = arrived
        response = await super()._completions(_Replay(request, body))
        if not body.get("stream"):
            self.answered_s[_key(body["prompt"])] = time.perf_counter()
        self.requests.clear()  # not kept: a long run would hold every body
        return response

    step_s = 0.0  # the decode step after the first token (PacedVllm's own pacing stays off: token_delay_s 0)

    async def _stream(self, body: dict[str, Any], ids: list[int], tokens: list[int], finish: str) -> Any:
        first = True
        clock = time.perf_counter
        due = clock()
        async for event in super()._stream(body, ids, tokens, finish):
            if first:
                first = False
            elif self.step_s:
                due += self.step_s
                await asyncio.sleep(max(due - clock(), 0.0))
            yield event


class _Replay:
    """A request whose JSON body was already read (FakeVllm reads it again)."""

    def __init__(self, request: Request, body: dict[str, Any]) -> None:
        self._request, self._body = request, body

    async def json(self) -> dict[str, Any]:
        return self._body


def _prompt(n: int) -> list[int]:
    """A unique token-id prompt per request ``n`` (its first 4 ids, base 90, are the key)."""
    digits = [(n // 90 ** i) % 90 + 10 for i in range(4)]
    return digits + [(n * 7 + i) % 90 + 10 for i in range(_PROMPT_TOKENS - 4)]  # ids 5..16 follow from n too


class TextPrompts:
    """``--text-prompts``: unique text prompts of about ``_PROMPT_TOKENS`` tokens, which the proxy tokenizes
    (as a client of a real deployment sends them); each keyed by its first ids as the proxy's tokenizer
    (the same folder) makes them, which is what the fake prefiller sees. ``words``: English words;
    ``random``: as ``vllm bench serve --dataset-name random`` makes them (random ids to text, tokenized and
    cut to the length, to text again: full of U+FFFD, bytes that are no character, and often ending in one),
    what the GPU passes send."""

    def __init__(self, tokenizer_dir: str, kind: str) -> None:
        from transformers import AutoTokenizer
        self._tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        self._kind = kind
        words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly bears "
        per_copy = len(self._tok.encode(words, add_special_tokens=False))
        self._filler = words * max(1, _PROMPT_TOKENS // per_copy)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def make(self, n: int) -> tuple[str, tuple[int, ...]]:
        if self._kind == "random":
            rng = random.Random(n)
            body = self._tok.decode([rng.randrange(4, len(self._tok)) for _ in range(_PROMPT_TOKENS)])
            # and cut to the length again, as vllm bench does: the text then often ends mid-character (U+FFFD)
            body = self._tok.decode(self._tok.encode(body, add_special_tokens=False)[:_PROMPT_TOKENS])
        else:
            body = self._filler
        text = f"request {n} says: " + body
        return text, _key(self.encode(text))


class Clients:
    def __init__(self, text: TextPrompts | None = None) -> None:
        self._text = text
        self.first_s: dict[tuple[int, ...], float] = {}
        self.second_s: dict[tuple[int, ...], float] = {}
        self.measured: set[tuple[int, ...]] = set()
        self.failed = 0
        self.errors: dict[str, int] = {}
        self.measuring = False
        self._next = 0

    def next_prompt(self, base: int) -> tuple[list[int] | str, tuple[int, ...]]:
        """The next prompt (token ids, or text with ``--text-prompts``) and its key."""
        self._next += 1
        if self._text is not None:
            return self._text.make(base + self._next)
        prompt = _prompt(base + self._next)
        return prompt, _key(prompt)

    def fail(self, what: str) -> None:
        self.failed += 1
        self.errors[what[:160]] = self.errors.get(what[:160], 0) + 1


async def client_loop(client: httpx.AsyncClient, clients: Clients, stop_at: float, max_tokens: int,
                      base: int) -> None:
    clock = time.perf_counter
    while clock() < stop_at:
        prompt, key = clients.next_prompt(base)
        body = {"model": "fake-model", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True}
        measuring = clients.measuring
        events = 0
        try:
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    clients.fail(f"{resp.status_code} {(await resp.aread())[:200]!r}")
                    continue
                async for line in resp.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    events += 1
                    if events == 1:
                        clients.first_s[key] = clock()
                    elif events == 2:
                        clients.second_s[key] = clock()
        except httpx.HTTPError as exc:
            clients.fail(f"{type(exc).__name__}: {exc}")
            continue
        if measuring and clients.measuring:
            clients.measured.add(key)


def _ms(values: list[float]) -> dict[str, float]:
    ordered = sorted(v * 1e3 for v in values)
    if not ordered:
        return {"n": 0, "p50": float("nan"), "p99": float("nan"), "mean": float("nan")}
    return {"n": len(ordered), "p50": round(_pct(ordered, 50), 3), "p99": round(_pct(ordered, 99), 3),
            "mean": round(statistics.fmean(ordered), 3)}


async def measure(proxy: ProxyChild, prefill: StampedVllm, decoder: StampedVllm, args: argparse.Namespace,
                  streams: int, text: TextPrompts | None) -> dict[str, Any]:
    clients = Clients(text)
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    async with httpx.AsyncClient(base_url=proxy.url, timeout=_CLIENT_TIMEOUT_S, trust_env=False,
                                 limits=limits) as client:
        stop_at = time.perf_counter() + args.warmup_s + args.duration_s
        tasks = [asyncio.create_task(client_loop(client, clients, stop_at, args.max_tokens, 1_000_000 * (i + 1)))
                 for i in range(streams)]
        await asyncio.sleep(args.warmup_s)
        await client.post("/stats/reset")
        clients.measuring = True
        t0, cpu0, coord0 = time.perf_counter(), proxy.cpu_s(), proxy.coordinator_cpu_s()
        spy = _pyspy(proxy, args.duration_s, f"/tmp/proxy_handover_{proxy.label}_s{streams}.txt")  # PYSPY=exe
        await asyncio.sleep(args.duration_s)
        if spy is not None:
            spy.wait(30)
        clients.measuring = False
        wall_s = time.perf_counter() - t0
        cpu_s, coord_s = proxy.cpu_s() - cpu0, proxy.coordinator_cpu_s() - coord0
        stats = (await client.get("/stats")).json()
        await asyncio.wait(tasks, timeout=_CLIENT_TIMEOUT_S)
    keys = [k for k in clients.measured if k in prefill.answered_s and k in clients.second_s]
    answered = prefill.answered_s
    row: dict[str, Any] = {
        "streams": streams,
        "requests": len(keys),
        "req_s": round(len(keys) / wall_s, 1),
        "proxy_cpu_ms_per_req": round(cpu_s / max(len(keys), 1) * 1e3, 3),  # the coordinator's + its workers'
        "coordinator_cpu_ms_per_req": round(coord_s / max(len(keys), 1) * 1e3, 3),
        "failed": clients.failed,
        "errors": dict(sorted(clients.errors.items(), key=lambda kv: -kv[1])[:3]),
        "answer_to_decode_ms": _ms([decoder.decode_at_s[k] - answered[k] for k in keys if k in decoder.decode_at_s]),
        "answer_to_first_ms": _ms([clients.first_s[k] - answered[k] for k in keys]),
        "answer_to_second_ms": _ms([clients.second_s[k] - answered[k] for k in keys]),
        "proxy_handover_ms": _pick(stats.get("handover_ms")),
        "proxy_timeline_ms": {phase: _pick(v) for phase, v in (stats.get("timeline_ms") or {}).items()
                              if phase in ("queue", "first_byte", "kv_wait", "decode_start", "decode_first")},
    }
    prefill.answered_s.clear()
    decoder.decode_at_s.clear()
    return row


def _pick(summary: dict[str, Any] | None) -> dict[str, Any]:
    summary = summary or {}
    return {k: summary.get(k) for k in ("count", "p50", "p99", "mean")}


async def run_variant(name: str, rep: int, pythonpath: str, tokenizer_dir: str, args: argparse.Namespace,
                      workers: int) -> list[dict[str, Any]]:
    proxy = ProxyChild(pythonpath, tokenizer_dir, workers=workers)
    proxy.label = f"{name}_w{workers}_r{rep}"
    network = KvNetwork()
    nodes: list[tuple[StampedVllm, FakeAgent]] = []
    heartbeat: asyncio.Task[None] | None = None
    text = TextPrompts(tokenizer_dir, args.text_prompts) if args.text_prompts else None
    try:
        prefill = StampedVllm("prefill-0")
        prefill.model = fixed_model
        if text is not None:  # the proxy keeps its tokenizer only when the instances tokenize as it does
            prefill.encode = text.encode
        await prefill.server.start()
        prefill.kv_sink = network.deliver
        nodes.append((prefill, FakeAgent(proxy.control, "sender", prefill.url)))
        decoder = StampedVllm("decode-0")
        decoder.model = fixed_model
        if text is not None:
            decoder.encode = text.encode
        decoder.step_s = args.token_delay_ms / 1e3
        await decoder.server.start()
        agent = FakeAgent(proxy.control, "receiver", decoder.url, base_port=23000, capacity_slots=1 << 16)
        agent.kv_delay_s = args.kv_delay_ms / 1e3
        network.add(agent)
        nodes.append((decoder, agent))
        for _, a in nodes:
            await a.announce()
        await _wait_routable(proxy.url, 2)
        heartbeat = asyncio.create_task(_heartbeat([a for _, a in nodes]))
        for _ in range(4 * workers):
            await _first_request(proxy.url)
        rows = []
        for streams in args.streams:
            row = await measure(proxy, prefill, decoder, args, streams, text)
            rows.append({"variant": name, "workers": workers, "rep": rep, **row})
            print(_fmt(rows[-1]), flush=True)
        return rows
    finally:
        if heartbeat is not None:
            heartbeat.cancel()
        for _, a in nodes:
            a.close()
        await asyncio.gather(*(v.server.stop() for v, _ in nodes))
        proxy.kill()


_HEAD = ("variant", "workers", "rep", "streams", "req_s", "failed", "dec p50", "dec p99", "1st p50", "1st p99",
         "2nd p50", "2nd p99", "fb p50", "dstart p50", "dfirst p50", "ho p50", "ho p99", "cpu ms/req",
         "coord ms")


def _fmt(row: dict[str, Any]) -> str:
    t = row["proxy_timeline_ms"]
    cells = [row["variant"], row["workers"], row["rep"], row["streams"], row["req_s"], row["failed"],
             row["answer_to_decode_ms"]["p50"], row["answer_to_decode_ms"]["p99"],
             row["answer_to_first_ms"]["p50"], row["answer_to_first_ms"]["p99"],
             row["answer_to_second_ms"]["p50"], row["answer_to_second_ms"]["p99"],
             (t.get("first_byte") or {}).get("p50"), (t.get("decode_start") or {}).get("p50"),
             (t.get("decode_first") or {}).get("p50"), row["proxy_handover_ms"]["p50"],
             row["proxy_handover_ms"]["p99"], row["proxy_cpu_ms_per_req"], row["coordinator_cpu_ms_per_req"]]
    return "  ".join(f"{c!s:>10}" for c in cells)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (variant, workers, streams): medians over repetitions of each figure's p50 and p99."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(f"{row['variant']} workers={row['workers']} streams={row['streams']}", []).append(row)
    out: dict[str, Any] = {}
    for name, rs in groups.items():
        entry: dict[str, Any] = {"reps": len(rs), "req_s": statistics.median(r["req_s"] for r in rs),
                                 "failed": sum(r["failed"] for r in rs)}
        for key in ("proxy_cpu_ms_per_req", "coordinator_cpu_ms_per_req"):
            entry[key] = round(statistics.median(r[key] for r in rs), 3)
        for fig in ("answer_to_decode_ms", "answer_to_first_ms", "answer_to_second_ms", "proxy_handover_ms"):
            for q in ("p50", "p99"):
                values = [r[fig][q] for r in rs if r[fig].get(q) is not None]
                entry[f"{fig}_{q}"] = round(statistics.median(values), 3) if values else None
        for phase in ("first_byte", "kv_wait", "decode_start", "decode_first"):
            values = [r["proxy_timeline_ms"][phase]["p50"] for r in rs
                      if (r["proxy_timeline_ms"].get(phase) or {}).get("p50") is not None]
            entry[f"{phase}_ms_p50"] = round(statistics.median(values), 3) if values else None
        out[name] = entry
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-ref", default=BASELINE_REF, help="git ref of the 'baseline' proxy")
    p.add_argument("--variants", default="baseline,current")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 4], help="the proxy's --workers, each variant")
    p.add_argument("--streams", type=int, nargs="+", default=[4, 16], help="concurrent clients, one point each")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=_PROMPT_TOKENS,
                   help="token ids per prompt (default %(default)s; a long prompt's first byte: e.g. 16000)")
    p.add_argument("--text-prompts", choices=("words", "random"), default=None,
                   help="text prompts (the proxy tokenizes them, as for a real client) instead of token ids: "
                        "English words, or random ids made text as vllm bench's random dataset does")
    p.add_argument("--token-delay-ms", type=float, default=10.0, help="the fake decoder's step after its first token")
    p.add_argument("--kv-delay-ms", type=float, default=0.0, help="KV ready this long after the prefill answered")
    p.add_argument("--warmup-s", type=float, default=1.5)
    p.add_argument("--duration-s", type=float, default=5.0)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "proxy_handover.json"))
    return p.parse_args()


async def main() -> None:
    global _PROMPT_TOKENS
    args = parse_args()
    _PROMPT_TOKENS = args.prompt_tokens
    load_before = os.getloadavg()[0]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="proxy_handover_") as tmp:
        tok, paths = variant_trees(Path(tmp), args.variants, args.baseline_ref)
        print("  ".join(f"{c:>10}" for c in _HEAD), flush=True)
        for rep in range(args.reps):  # interleaved: the machine's load drifts
            for workers in args.workers:
                for name in args.variants.split(","):
                    rows += await run_variant(name, rep, paths[name], tok, args, workers)
    write_result(args.out, {"meta": metadata(args, load_before), "rows": rows, "summary": summarize(rows)})


if __name__ == "__main__":
    asyncio.run(main())
