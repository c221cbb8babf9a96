"""Moving KV heads between TP splits: a sender rank's share for one decoder rank, and a decoder
rank's chunk merged from the shares of several sender ranks (see ``kv_layout``).

A chunk is KV_2LTD, ``[2, layers, tokens, heads * head_size]``: the heads are the innermost run of
each token's row, so any head range is a strided view, and one copy makes it contiguous. MLA
chunks (one latent) are never split. Owns: these copies. Must not: decide who sends what.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lmcache_p2p import protocol


def pack_heads(tensor: torch.Tensor, lo: int, hi: int, heads: int) -> torch.Tensor:
    """Heads ``[lo, hi)`` (of the ``heads`` the chunk holds) as a new contiguous chunk (one copy)."""
    width = tensor.shape[-1] // heads
    packed = tensor[..., lo * width:hi * width].contiguous()
    if packed.is_cuda:  # a transport reads the bytes directly, outside the stream that copied them
        torch.cuda.current_stream(packed.device).synchronize()
    return packed


def merge_pieces(buffer: torch.Tensor, slot_bytes: int,
                 pieces: Sequence[tuple[int, protocol.ChunkShape]]) -> protocol.ChunkShape:
    """Merge the pieces of one chunk, each in its own slot of ``buffer`` (flat bytes) and given in
    head order, into the first piece's slot; return the merged chunk's shape. ValueError when the
    pieces do not make one chunk (their shapes disagree, or it exceeds a slot)."""
    first = pieces[0][1]
    dtype = getattr(torch, first.dtype)
    views = []
    for slot, shape in pieces:
        if shape.dtype != first.dtype or shape.shape[:-1] != first.shape[:-1] or shape.fmt != first.fmt:
            raise ValueError(f"pieces of one chunk disagree: {shape.shape} {shape.dtype} vs {first.shape} {first.dtype}")
        start = slot * slot_bytes
        views.append(buffer[start:start + shape.nbytes].view(dtype).view(shape.shape))
    merged_shape = [*first.shape[:-1], sum(v.shape[-1] for v in views)]
    nbytes = math.prod(merged_shape) * dtype.itemsize
    if nbytes > slot_bytes:
        raise ValueError(f"merged chunk of {nbytes} bytes exceeds the slot size {slot_bytes}")
    start = pieces[0][0] * slot_bytes
    out = buffer[start:start + nbytes].view(dtype).view(merged_shape)
    sources = [views[0].clone(), *views[1:]]  # the first piece is overwritten by the merge
    offset = 0
    for view in sources:
        out[..., offset:offset + view.shape[-1]].copy_(view)
        offset += view.shape[-1]
    if out.is_cuda:  # the engine reads the slot on its own stream once it is READY
        torch.cuda.current_stream(out.device).synchronize()
    return protocol.ChunkShape(merged_shape, first.dtype, nbytes, first.fmt)
