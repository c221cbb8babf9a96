"""The client side of the fault suite: send streamed completions, classify how each one ended.

Every request has a deadline. Outcomes:
  ok             HTTP 200, the stream ended with ``[DONE]`` and carried ``max_tokens`` token ids
  clean_error    an OpenAI-style error the client can act on: a non-200 answer whose JSON body has
                 ``error.message``, or an in-stream ``data: {"error": ...}`` followed by ``[DONE]``
  unclean_error  anything else that ended: a reset connection, a stream cut without ``[DONE]``,
                 a 200 with fewer tokens and no error, a body that is not JSON
  hung           no end within the deadline (the request is cancelled then)
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import random
import time
from collections.abc import Sequence

import httpx

from fault_cluster import SERVED_MODEL_NAME


class Kind(str, enum.Enum):
    OK = "ok"
    CLEAN_ERROR = "clean_error"
    UNCLEAN_ERROR = "unclean_error"
    HUNG = "hung"


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt of the workload and the reference output ids of each model (key: model key)."""

    ids: tuple[int, ...]
    max_tokens: int
    reference: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def matches(self, ids: Sequence[int], models: Sequence[str] = ("a",)) -> bool:
        return any(tuple(ids) == self.reference[m] for m in models if m in self.reference)


@dataclasses.dataclass
class Outcome:
    prompt: Prompt
    kind: Kind
    ids: tuple[int, ...] = ()
    error: str = ""
    started_s: float = 0.0
    elapsed_s: float = 0.0
    first_token_s: float | None = None
    response_id: str = ""  # the response's "id" as the client got it (the proxy's /stats names it)


def body_of(prompt: Prompt) -> dict:
    return {"model": SERVED_MODEL_NAME, "prompt": list(prompt.ids), "max_tokens": prompt.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}


async def send(client: httpx.AsyncClient, url: str, prompt: Prompt, deadline_s: float,
               progress: dict | None = None) -> Outcome:
    """One streamed completion, classified; ``progress[id(outcome)]`` counts tokens as they arrive."""
    out = Outcome(prompt, Kind.HUNG, started_s=time.monotonic())
    ids: list[int] = []
    if progress is not None:
        progress[id(out)] = ids
    try:
        await asyncio.wait_for(_stream(client, url, prompt, out, ids), deadline_s)
    except asyncio.TimeoutError:
        out.kind, out.error = Kind.HUNG, f"no end within {deadline_s:.0f}s ({len(ids)} tokens so far)"
    out.ids = tuple(ids)
    out.elapsed_s = time.monotonic() - out.started_s
    if progress is not None:
        progress.pop(id(out), None)
    return out


async def _stream(client: httpx.AsyncClient, url: str, prompt: Prompt, out: Outcome, ids: list[int]) -> None:
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body_of(prompt)) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                out.kind, out.error = _error_body(resp.status_code, raw)
                return
            done = False
            stream_error = None
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if not out.response_id and isinstance(event.get("id"), str):
                    out.response_id = event["id"]
                if "error" in event:
                    stream_error = str(event["error"])[:300]
                    continue
                for choice in event.get("choices") or ():
                    tokens = choice.get("token_ids") or ()
                    if tokens and out.first_token_s is None:
                        out.first_token_s = time.monotonic() - out.started_s
                    ids.extend(tokens)
    except (httpx.HTTPError, ValueError) as exc:
        out.kind, out.error = Kind.UNCLEAN_ERROR, f"{type(exc).__name__}: {exc}"[:300]
        return
    if stream_error is not None:
        out.kind = Kind.CLEAN_ERROR if done else Kind.UNCLEAN_ERROR
        out.error = f"in stream after {len(ids)} tokens: {stream_error}"
    elif not done:
        out.kind, out.error = Kind.UNCLEAN_ERROR, f"stream cut without [DONE] after {len(ids)} tokens"
    elif len(ids) != prompt.max_tokens:
        out.kind, out.error = Kind.UNCLEAN_ERROR, f"{len(ids)} tokens and no error, expected {prompt.max_tokens}"
    else:
        out.kind = Kind.OK


def _error_body(status: int, raw: bytes) -> tuple[Kind, str]:
    try:
        message = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return Kind.UNCLEAN_ERROR, f"HTTP {status} without an OpenAI error body: {raw[:200]!r}"
    return Kind.CLEAN_ERROR, f"HTTP {status}: {str(message)[:300]}"


def new_client(concurrency: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    return httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits, trust_env=False)


async def run_concurrent(url: str, prompts: Sequence[Prompt], concurrency: int, deadline_s: float,
                         progress: dict | None = None) -> list[Outcome]:
    """Every prompt once, ``concurrency`` in flight."""
    queue: asyncio.Queue[Prompt] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[Outcome] = []
    async with new_client(concurrency) as client:
        async def worker() -> None:
            while not queue.empty():
                results.append(await send(client, url, queue.get_nowait(), deadline_s, progress))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def run_at_rate(url: str, prompts: Sequence[Prompt], rate_per_s: float, deadline_s: float) -> list[Outcome]:
    """Every prompt once, started at a steady rate (Poisson-free: evenly spaced), whatever is in flight."""
    async with new_client(64) as client:
        start = time.monotonic()
        tasks = []
        for i, p in enumerate(prompts):
            delay = start + i / rate_per_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(client, url, p, deadline_s)))
        return list(await asyncio.gather(*tasks))


def make_prompts(vocab: Sequence[int], count: int, min_tokens: int, max_tokens_in: int, output_tokens: int,
                 seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    return [Prompt(tuple(rng.choice(vocab) for _ in range(rng.randint(min_tokens, max_tokens_in))), output_tokens)
            for _ in range(count)]
