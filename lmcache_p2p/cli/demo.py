"""``lmcache-p2p launch --demo``: one completion through the proxy and what proves it was disaggregated.

The default model is a tiny Llama with random weights (``lmcache-p2p tiny-model``): its text is
gibberish by design; what the tests compare is token ids. The proof of the disaggregation is the
decoder's LMCache log: the prompt tokens it loaded from the prefiller's KV instead of computing
them, plus the KV bytes and the handover time the proxy reports. A decoder running vLLM's own
NixlConnector (``launch --connector nixl``) has no LMCache log: it counts the prompt tokens it pulled
from the prefiller as vLLM's external prefix cache hits, on its ``/metrics``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

DEMO_PROMPT = "The quick brown fox jumps over the lazy dog. " * 20
DEMO_MAX_TOKENS = 16
DEMO_TIMEOUT_S = 120.0
STATS_TIMEOUT_S = 10.0
# Logged by LMCache's vLLM adapter for every lookup an instance makes.
HIT_RE = re.compile(r"Total tokens (\d+), Inference Engine computed tokens: (\d+), LMCache hit tokens: (\d+)")
REQUEST_HIT_RE = re.compile(r"Reqid: (\S+), " + HIT_RE.pattern)


class Lookup(NamedTuple):
    """One LMCache lookup of an instance: its prompt length and how many tokens hit."""

    total_tokens: int
    hit_tokens: int


def lookups_in_log(log_path: Path) -> list[Lookup]:
    """Every LMCache lookup an instance logged, in order."""
    text = log_path.read_text(errors="replace")
    return [Lookup(int(total), int(hit)) for total, _, hit in HIT_RE.findall(text)]


def request_lookups_in_log(log_path: Path) -> list[tuple[str, Lookup]]:
    """Every LMCache lookup an instance logged, with its request id, in order."""
    text = log_path.read_text(errors="replace")
    return [(req, Lookup(int(total), int(hit))) for req, total, _, hit in REQUEST_HIT_RE.findall(text)]


def final_lookups(lookups: list[tuple[str, Lookup]]) -> list[Lookup]:
    """The last lookup of each request, in the order the requests came: a decode held for its KV (our proxy's
    ``--early-decode``, or behind vllm-router) is looked up on every scheduler step until the KV arrived, and
    its last lookup is what it loaded."""
    last: dict[str, Lookup] = {}
    for req, lookup in lookups:
        last[req] = lookup
    return list(last.values())


def demo_request(proxy_url: str, model: Path, log_dir: Path, *, tiny_model: bool,
                 nixl_decoder_url: str | None = None) -> list[str]:
    """Send the demo completion; the lines to print: its text (and what it is), then the proof
    (``nixl_decoder_url``: decoder-0's, when it runs vLLM's NixlConnector)."""
    import httpx

    body = {"model": str(model), "prompt": DEMO_PROMPT, "max_tokens": DEMO_MAX_TOKENS, "temperature": 0}
    resp = httpx.post(f"{proxy_url}/v1/completions", json=body, timeout=DEMO_TIMEOUT_S)
    resp.raise_for_status()
    answer = resp.json()
    lines = [f"demo completion through the proxy: {answer['choices'][0]['text']!r}"]
    if tiny_model:
        lines.append("  (the default model is a tiny Llama with random weights: gibberish text is expected; "
                     "pass --model for a real one)")
    lines.append(f"  prompt tokens: {answer.get('usage', {}).get('prompt_tokens', '?')}")
    lines += proof_lines(proxy_url, log_dir, nixl_decoder_url)
    return lines


def proof_lines(proxy_url: str, log_dir: Path, nixl_decoder_url: str | None = None) -> list[str]:
    """What proves the disaggregation: the tokens decoder-0 loaded from the prefiller, the KV bytes moved
    and the handover (the decoder's log or, running NixlConnector, its /metrics; the proxy's /metrics and
    /stats)."""
    import httpx

    lines = ["what proves the disaggregation:"]
    if nixl_decoder_url is not None:
        lines.append(pulled_line(httpx.get(f"{nixl_decoder_url}/metrics", timeout=STATS_TIMEOUT_S).text))
        return lines + proxy_lines(proxy_url)
    decoder_log = log_dir / "decoder-0.log"
    lookups = lookups_in_log(decoder_log) if decoder_log.exists() else []
    if lookups:
        last = lookups[-1]
        lines.append(f"  decoder-0 loaded {last.hit_tokens} of the {last.total_tokens} tokens it looked up from the "
                     "prefiller's KV instead of computing them (prompt + first token; the last one is never "
                     "looked up)")
    else:
        lines.append("  decoder-0 logged no LMCache lookup: nothing was loaded from a prefiller")
    return lines + proxy_lines(proxy_url)


def pulled_line(metrics_text: str) -> str:
    """What a NixlConnector decoder's /metrics says it pulled: its external prefix cache hits (the prompt
    tokens whose KV it read from a prefiller) of the tokens it asked for, since it started."""
    hits, queries = (metric_total(metrics_text, f"vllm:external_prefix_cache_{kind}_total")
                     for kind in ("hits", "queries"))
    if not queries:
        return "  decoder-0 asked no prefiller for KV (vllm:external_prefix_cache_queries_total is 0)"
    return (f"  decoder-0 pulled the KV of {hits:.0f} of the {queries:.0f} prompt tokens it asked the prefiller for "
            "instead of computing them (vLLM's external prefix cache hits)")


def metric_total(text: str, name: str) -> float:
    """The sum of a Prometheus text's samples of ``name`` over its label sets."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " ")))


def proxy_lines(proxy_url: str) -> list[str]:
    """The KV bytes and the handover the proxy reports (its /metrics and /stats)."""
    import httpx

    lines: list[str] = []
    stats = httpx.get(f"{proxy_url}/stats", timeout=STATS_TIMEOUT_S).json()
    handover = stats.get("handover_ms", {}).get("p50")
    metrics = httpx.get(f"{proxy_url}/metrics", timeout=STATS_TIMEOUT_S).text
    kv_bytes = next((float(line.split()[-1]) for line in metrics.splitlines()
                     if line.startswith("lmcache_p2p_proxy_kv_bytes_total ")), None)
    lines.append(f"  KV moved prefiller -> decoder: {kv_bytes:.0f} bytes" if kv_bytes is not None else
                 "  KV moved: not reported")
    lines.append(f"  handover (prefill answer -> first decoded token): {handover:.1f} ms" if handover is not None
                 else "  handover: not measured")
    return lines
