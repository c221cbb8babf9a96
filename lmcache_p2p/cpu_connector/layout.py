"""Learn where vLLM-CPU puts each K/V element inside a (block, head) page.

vLLM-CPU's per-layer KV cache is ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``. Each
(block, head) page holds ``block_size * head_size`` K elements followed by as many V elements, but
the order inside the page depends on the attention ISA and dtype (e.g. on AVX-512 "vec" the K part
is stored transposed, ``[head_size, block_size]``, while V is ``[block_size, head_size]``; AMX packs
differently again). Rather than hard-coding those layouts, :func:`learn_page_layout` asks vLLM's own
writer (``vllm._custom_ops.cpu_attn_reshape_and_cache``) to write probe values that encode each
element's (token, dim) and reads back where they landed.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import torch

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Probe values are base-16 digits stored as digit + 1 (1..16): exact in fp32, fp16 and bf16, and a
# zero left in the page means the writer did not touch that position.
_DIGIT_BASE = 16


@dataclasses.dataclass(frozen=True)
class PageLayout:
    """Where each element of a (block, head) page lives, for one (dtype, block size, head size, ISA).

    ``k_offsets[t, d]`` / ``v_offsets[t, d]`` is the element offset, from the start of the page, of
    dim ``d`` of token ``t`` (the token's offset inside its block) of K / V.
    """

    isa: str
    dtype: torch.dtype
    block_size: int
    head_size: int
    k_offsets: torch.Tensor  # [block_size, head_size] int64
    v_offsets: torch.Tensor  # [block_size, head_size] int64

    @property
    def page_elems(self) -> int:
        """Elements in one (block, head) page: K and V of ``block_size`` tokens."""
        return 2 * self.block_size * self.head_size


def attention_isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    """The ISA vLLM-CPU's attention picks for this cache (same call its metadata builder makes)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_size, "auto")


@functools.lru_cache(maxsize=16)
def learn_page_layout(dtype: torch.dtype, block_size: int, head_size: int, isa: str) -> PageLayout:
    """Probe vLLM's writer once for this (dtype, block size, head size, ISA) and return the layout.

    Raises ``ValueError`` for an unsupported dtype and ``RuntimeError`` if the writer's placement
    is not a permutation of the page (a layout this connector cannot express).
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"KV cache dtype {dtype} is not supported by the CPU connector (supported: {SUPPORTED_DTYPES})"
        )
    page_tokens = block_size * head_size
    num_codes = 2 * page_tokens
    num_digits = max(1, math.ceil(math.log(num_codes, _DIGIT_BASE)))
    codes = torch.arange(num_codes, dtype=torch.int64)
    decoded = torch.zeros(num_codes, dtype=torch.int64)
    for digit in range(num_digits):
        values = (codes // _DIGIT_BASE**digit) % _DIGIT_BASE + 1
        page = _write_probe_page(values, dtype, block_size, head_size, isa)
        _check_fully_written(page, isa, dtype)
        decoded += (page.to(torch.int64) - 1) * _DIGIT_BASE**digit
    # decoded[p] = code written at page position p; invert to code -> position.
    positions = torch.full((num_codes,), -1, dtype=torch.int64)
    positions[decoded] = torch.arange(num_codes, dtype=torch.int64)
    if not torch.equal(torch.sort(decoded).values, codes):
        raise RuntimeError(
            f"vLLM's cpu_attn_reshape_and_cache (isa={isa}, dtype={dtype}, block_size={block_size}, "
            f"head_size={head_size}) does not place K/V as a permutation of the page; "
            "the CPU connector cannot transfer this layout"
        )
    layout = PageLayout(
        isa=isa,
        dtype=dtype,
        block_size=block_size,
        head_size=head_size,
        k_offsets=positions[:page_tokens].reshape(block_size, head_size).contiguous(),
        v_offsets=positions[page_tokens:].reshape(block_size, head_size).contiguous(),
    )
    logger.info(
        "learned vLLM-CPU page layout isa=%s dtype=%s block_size=%d head_size=%d (K %s, V %s)",
        isa,
        dtype,
        block_size,
        head_size,
        _describe(layout.k_offsets, 0),
        _describe(layout.v_offsets, page_tokens),
    )
    return layout


def _write_probe_page(
    values: torch.Tensor, dtype: torch.dtype, block_size: int, head_size: int, isa: str
) -> torch.Tensor:
    """Write ``values`` (K codes then V codes, token-major) into one page with vLLM's writer."""
    from vllm import _custom_ops as ops

    page_tokens = block_size * head_size
    key = values[:page_tokens].reshape(block_size, 1, head_size).to(dtype)
    value = values[page_tokens:].reshape(block_size, 1, head_size).to(dtype)
    kv_cache = torch.zeros(1, 1, block_size, 2 * head_size, dtype=dtype)
    # Same views vLLM's CPU attention backend builds before calling the writer.
    key_cache, value_cache = kv_cache.view(1, 1, 2 * block_size, head_size).chunk(2, dim=2)
    slot_mapping = torch.arange(block_size, dtype=torch.int64)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa)
    return kv_cache.reshape(-1)


def _check_fully_written(page: torch.Tensor, isa: str, dtype: torch.dtype) -> None:
    unwritten = int((page == 0).sum())
    if unwritten:
        raise RuntimeError(
            f"vLLM's cpu_attn_reshape_and_cache (isa={isa}, dtype={dtype}) left {unwritten} page "
            "elements unwritten; the CPU connector cannot learn this layout"
        )


def _describe(offsets: torch.Tensor, base: int) -> str:
    """A short name for the common layouts, for the log line."""
    block_size, head_size = offsets.shape
    row_major = torch.arange(block_size * head_size, dtype=torch.int64).reshape(block_size, head_size)
    transposed = torch.arange(block_size * head_size, dtype=torch.int64).reshape(head_size, block_size).t()
    if torch.equal(offsets, row_major + base):
        return "[block_size, head_size]"
    if torch.equal(offsets, transposed + base):
        return "[head_size, block_size]"
    return "permuted"
