"""Prompt prefixes in the proxy: LMCache's chunk hashes, and which instance recently got which chunks.

Hashing, as LMCache 0.5.6 does it (``lmcache/v1/token_database.py``, ``ChunkedTokenDatabase`` with the
default ``pre_caching_hash_algorithm: builtin``, which vLLM's ``get_hash_fn_by_name`` does not know, so
LMCache falls back to Python's builtin ``hash``):

* the tokens are cut into chunks of ``chunk_size`` tokens (``save_unfull_chunk``: the partial last
  chunk is a chunk too);
* ``h[-1] = NONE_HASH``, ``h[k] = hash((h[k-1], tuple(chunk_k), ()))``: a chain, so ``h[k]`` names the
  whole prefix up to the end of chunk k;
* ``NONE_HASH`` comes from vLLM's ``init_none_hash(hash)``: ``hash(os.environ["PYTHONHASHSEED"])``,
  a *string* hash, so it depends on the instance's hash seed (the launcher sets PYTHONHASHSEED=0).

Python's ``hash`` of ints and of tuples of ints does not depend on the hash seed (ints hash
arithmetically, tuples mix their items' hashes with fixed constants; CPython >= 3.8), so the proxy
computes the chain with the builtin ``hash`` whatever its own seed. Only ``NONE_HASH`` hashes a
string: :func:`str_hash` computes it as CPython 3.11+ does under a given PYTHONHASHSEED (SipHash-1-3,
key derived from the seed), never by changing the proxy's own seed. ``--prefix-hash-seed`` names the
instances' seed; ``tests/proxy/router/test_prefix.py`` checks the chain against LMCache's own function.

The index: per instance, the chunk hashes recently sent there (a prefiller: the prompts it computed;
a decoder: the prompts whose KV it received plus the output it generated, since its vLLM prefix
cache holds both), LRU-bounded per instance (``--prefix-index-chunks``) and forgotten when the
instance leaves the registry or comes back (restarted, moved, down: its caches are gone). It is a
hint for routing, never a promise: a stale entry only costs a less good choice.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

_MASK64 = (1 << 64) - 1


# ---- hashing -------------------------------------------------------------------------------------


def _rotl(x: int, b: int) -> int:
    return ((x << b) | (x >> (64 - b))) & _MASK64


def _siphash13(k0: int, k1: int, data: bytes) -> int:
    """CPython's ``siphash13`` (Python/pyhash.c), unsigned 64-bit."""
    v0, v1 = k0 ^ 0x736F6D6570736575, k1 ^ 0x646F72616E646F6D
    v2, v3 = k0 ^ 0x6C7967656E657261, k1 ^ 0x7465646279746573

    def sip_round() -> None:
        nonlocal v0, v1, v2, v3
        v0 = (v0 + v1) & _MASK64
        v2 = (v2 + v3) & _MASK64
        v1 = _rotl(v1, 13) ^ v0
        v3 = _rotl(v3, 16) ^ v2
        v0 = _rotl(v0, 32)
        v2 = (v2 + v1) & _MASK64
        v0 = (v0 + v3) & _MASK64
        v1 = _rotl(v1, 17) ^ v2
        v3 = _rotl(v3, 21) ^ v0
        v2 = _rotl(v2, 32)

    full = len(data) - len(data) % 8
    for i in range(0, full, 8):
        m = int.from_bytes(data[i:i + 8], "little")
        v3 ^= m
        sip_round()
        v0 ^= m
    b = ((len(data) & 0xFF) << 56) | int.from_bytes(data[full:], "little")
    v3 ^= b
    sip_round()
    v0 ^= b
    v2 ^= 0xFF
    for _ in range(3):
        sip_round()
    return (v0 ^ v1) ^ (v2 ^ v3)


def _hash_secret(seed: int) -> tuple[int, int]:
    """SipHash's (k0, k1) as CPython derives them from PYTHONHASHSEED (Python/bootstrap_hash.c):
    seed 0 = all zero; else ``lcg_urandom(seed)`` fills the 24-byte secret."""
    if seed == 0:
        return 0, 0
    x, secret = seed & 0xFFFFFFFF, bytearray()
    for _ in range(24):
        x = (x * 214013 + 2531011) & 0xFFFFFFFF
        secret.append((x >> 16) & 0xFF)
    return int.from_bytes(secret[0:8], "little"), int.from_bytes(secret[8:16], "little")


def str_hash(text: str, python_hash_seed: int) -> int:
    """``hash(text)`` in a CPython >= 3.11 process started with ``PYTHONHASHSEED=python_hash_seed``."""
    if not text:
        return 0
    if max(map(ord, text)) < 256:
        data = text.encode("latin-1")  # PEP 393: 1-byte kind
    elif max(map(ord, text)) < 65536:
        data = text.encode("utf-16-le")
    else:
        data = text.encode("utf-32-le")
    value = _siphash13(*_hash_secret(python_hash_seed), data)
    if value >= 1 << 63:
        value -= 1 << 64
    return -2 if value == -1 else value


def none_hash(python_hash_seed: int) -> int:
    """LMCache's ``NONE_HASH`` (the chain's start) in an instance started with that PYTHONHASHSEED."""
    return str_hash(str(python_hash_seed), python_hash_seed)


def chunk_hashes(tokens: Sequence[int], chunk_tokens: int, start: int) -> list[int]:
    """LMCache's prefix hash of every chunk of ``tokens`` (the partial last one too), chained from ``start``."""
    hashes: list[int] = []
    prefix = start
    for i in range(0, len(tokens), chunk_tokens):
        prefix = hash((prefix, tuple(tokens[i:i + chunk_tokens]), ()))
        hashes.append(prefix)
    return hashes


class PromptPrefix:
    """One prompt's token ids and their chunk hashes, computed once per chunk size."""

    def __init__(self, token_ids: Sequence[int], start_hash: int) -> None:
        self.token_ids = tuple(token_ids)
        self._start = start_hash
        self._hashes: dict[int, list[int]] = {}

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    def hashes(self, chunk_tokens: int) -> list[int]:
        if chunk_tokens <= 0:
            return []
        if chunk_tokens not in self._hashes:
            self._hashes[chunk_tokens] = chunk_hashes(self.token_ids, chunk_tokens, self._start)
        return self._hashes[chunk_tokens]


# ---- the index -----------------------------------------------------------------------------------


class PrefixIndex:
    """Per instance, the chunk hashes recently sent there; at most ``max_chunks`` per instance (LRU)."""

    def __init__(self, max_chunks: int) -> None:
        if max_chunks <= 0:
            raise ValueError(f"max_chunks must be positive, got {max_chunks}")
        self.max_chunks = max_chunks
        self._held: dict[str, collections.OrderedDict[int, None]] = {}

    def record(self, instance_id: str, hashes: Sequence[int]) -> None:
        """``instance_id`` now holds these chunks. The first chunks become the most recent, so the LRU
        drops a sequence's tail first, as vLLM's prefix cache evicts (a prefix without its first chunk
        is of no use)."""
        if not hashes:
            return
        held = self._held.setdefault(instance_id, collections.OrderedDict())
        for h in reversed(hashes):
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.max_chunks:
            held.popitem(last=False)

    def matched_chunks(self, instance_id: str, hashes: Sequence[int]) -> int:
        """How many leading chunks of ``hashes`` the instance holds."""
        held = self._held.get(instance_id)
        if not held:
            return 0
        matched = 0
        for h in hashes:
            if h not in held:
                break
            matched += 1
        return matched

    def forget(self, instance_id: str) -> None:
        self._held.pop(instance_id, None)

    def chunks_held(self, instance_id: str) -> int:
        return len(self._held.get(instance_id, ()))

    def instances(self) -> list[str]:
        return list(self._held)


@dataclasses.dataclass(frozen=True)
class PrefixSettings:
    """The knobs of ``--policy prefix`` (see ``router/routing.py``)."""

    # matched prefix / prompt at or above this: the match wins (balanced load). SGLang's default too; the
    # index sees whole LMCache chunks only (256 tokens), so it under-counts a cache's reach by up to a chunk.
    cache_threshold: float = 0.3
    # imbalanced when max - min in-flight requests > this ... (SGLang: 32-64; vLLM batches every running
    # request, so a few more on the instance holding the prefix cost it little against moving and
    # recomputing the prefix elsewhere. 2 broke affinity on noise: at 4 in flight over 2 decoders, "the
    # other 3 all on one" happens by chance a quarter of the time; the relative gate governs large counts)
    balance_abs_requests: int = 8
    balance_rel: float = 1.5  # ... and max > this * min: then the least loaded wins (SGLang's default)
    index_chunks: int = 8192  # chunk hashes remembered per instance (LRU)
    hash_seed: int = 0  # the instances' PYTHONHASHSEED (the launcher sets 0)
