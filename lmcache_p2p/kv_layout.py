"""How a model's KV heads are split over tensor-parallel ranks, and how KV moves between two splits.

A rank's layout (:class:`KvLayout`) is its model's total KV heads, the TP size, its rank and
whether the model is MLA. vLLM splits KV heads contiguously: with ``tp <= heads`` rank r holds
heads ``[r*h, (r+1)*h)`` (``h = heads // tp``); with ``tp > heads`` every rank holds one head,
replicated over ``tp // heads`` consecutive ranks (rank r holds head ``r // (tp // heads)``). An
MLA model holds one latent per token, identical on every rank: one "head" replicated everywhere.

A prefiller of TP p and a decoder of TP d exchange KV when both describe the same heads (same
total, MLA on both or neither) and one TP size divides the other (:func:`irreconcilable`). Each
decoder rank then gets exactly the heads it owns as :class:`Piece` s: for every head it holds one
sender rank is chosen (the decoder rank's own rank number when that sender holds the head, so
equal TP is rank r -> rank r; otherwise one of its holders, spread by decoder rank), and
consecutive heads of one sender form one piece. A replicated head or an MLA latent is therefore
sent once per decoder rank that needs it, never once per sender rank; a sender rank with no
piece sends nothing.

A decoder rank fed by several pieces (prefiller TP larger than the decoder's) receives each
piece as a *sub-request* of the request, ``req_id~index/count`` on the wire
(:func:`sub_request_id`); the receiver merges a chunk's pieces once all landed.

Pure arithmetic: no torch, no I/O. Owns: layouts, their reconciliation, the piece plan. Must not:
move or copy bytes (``backend/relayout.py`` does).
"""

from __future__ import annotations

import dataclasses
import functools

from lmcache_p2p.protocol import Fingerprint

MLA_FORMAT = "KV_MLA_FMT"
_SUB_SEP = "~"


@dataclasses.dataclass(frozen=True)
class KvLayout:
    """The KV heads one TP rank holds (``total_heads`` is 1 for an MLA latent)."""

    total_heads: int
    tp_size: int
    tp_rank: int = 0
    mla: bool = False

    def problem(self) -> str:
        """Why this is no layout vLLM makes ("" when it is one)."""
        if self.total_heads < 1 or self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            return f"{self.describe()}: heads, TP size and rank out of range"
        if self.mla and self.total_heads != 1:
            return f"{self.describe()}: an MLA model holds one latent, not {self.total_heads} heads"
        big, small = max(self.tp_size, self.total_heads), min(self.tp_size, self.total_heads)
        if big % small:
            return f"{self.describe()}: {self.total_heads} KV heads do not split evenly over TP {self.tp_size}"
        return ""

    @property
    def heads_per_rank(self) -> int:
        return max(1, self.total_heads // self.tp_size)

    @property
    def head_start(self) -> int:
        if self.tp_size <= self.total_heads:
            return self.tp_rank * self.heads_per_rank
        return self.tp_rank // (self.tp_size // self.total_heads)

    @property
    def head_end(self) -> int:
        return self.head_start + self.heads_per_rank

    def holds(self, head: int) -> bool:
        return self.head_start <= head < self.head_end

    def at_rank(self, rank: int) -> KvLayout:
        return dataclasses.replace(self, tp_rank=rank)

    def describe(self) -> str:
        if self.mla:
            return f"MLA latent on TP {self.tp_size} (rank {self.tp_rank})"
        return (f"KV heads [{self.head_start}, {self.head_end}) of {self.total_heads} on TP {self.tp_size} "
                f"(rank {self.tp_rank})")


def layout_of(fp: Fingerprint) -> KvLayout:
    """The layout a fingerprint describes (an older peer's, without ``kv_heads_total``: no replication)."""
    mla = fp.kv_format == MLA_FORMAT
    total = 1 if mla else (fp.kv_heads_total or fp.kv_heads * fp.tp_size)
    return KvLayout(total, fp.tp_size, fp.tp_rank, mla)


def irreconcilable(sender: KvLayout, receiver: KvLayout) -> str:
    """Why KV of ``sender``'s split cannot become ``receiver``'s ("" when it can), naming both."""
    both = f"prefiller {sender.describe()}, decoder {receiver.describe()}"
    for layout in (sender, receiver):
        if layout.problem():
            return f"invalid KV layout: {layout.problem()} ({both})"
    if sender.mla != receiver.mla:
        return f"KV layouts cannot be reconciled: MLA on one side only ({both})"
    if sender.total_heads != receiver.total_heads:
        return (f"KV layouts cannot be reconciled: {sender.total_heads} KV heads vs {receiver.total_heads} "
                f"({both})")
    big, small = max(sender.tp_size, receiver.tp_size), min(sender.tp_size, receiver.tp_size)
    if big % small:
        return (f"KV layouts cannot be reconciled: TP {sender.tp_size} and TP {receiver.tp_size}, neither divides "
                f"the other ({both})")
    return ""


_LAYOUT_FIELDS = ("tp_size", "tp_rank", "kv_heads", "kv_heads_total", "kv_format")


def kv_mismatch(sender: Fingerprint, receiver: Fingerprint) -> str:
    """Why ``receiver`` cannot load ``sender``'s KV ("" when it can): every field but the TP split
    must agree, and the two splits must be reconcilable (:func:`irreconcilable`)."""
    fields = receiver.differing_fields(sender, ignore=_LAYOUT_FIELDS)
    if fields:
        sides = "; ".join(f"{name}: decoder {getattr(receiver, name)!r}, prefiller {getattr(sender, name)!r}"
                          for name in fields)
        return (f"KV fingerprint mismatch in {', '.join(fields)} ({sides}): this decoder cannot load that "
                "prefiller's KV; serve the same model (same weights), dtype and chunk_size on both")
    if sender.kv_format != receiver.kv_format and MLA_FORMAT not in (sender.kv_format, receiver.kv_format):
        return f"KV format mismatch: decoder {receiver.kv_format}, prefiller {sender.kv_format}"
    theirs, ours = layout_of(sender), layout_of(receiver)
    for fp, layout in ((sender, theirs), (receiver, ours)):
        if fp.kv_heads != layout.heads_per_rank:
            return (f"KV layout inconsistent: {layout.describe()} should hold {layout.heads_per_rank} heads, its "
                    f"fingerprint says {fp.kv_heads} (p2p.kv_heads_total)")
    return irreconcilable(theirs, ours)


@dataclasses.dataclass(frozen=True)
class Piece:
    """Heads ``[head_lo, head_hi)`` (global) of every chunk, from sender rank ``src_rank`` to decoder
    rank ``dst_rank``: the ``index``-th of the ``count`` pieces that decoder rank gets."""

    src_rank: int
    dst_rank: int
    head_lo: int
    head_hi: int
    index: int = 0
    count: int = 1

    @property
    def heads(self) -> int:
        return self.head_hi - self.head_lo


def source_rank(head: int, dst_rank: int, sender: KvLayout) -> int:
    """The sender rank that feeds ``head`` to decoder rank ``dst_rank``."""
    holders = [r for r in range(sender.tp_size) if sender.at_rank(r).holds(head)]
    return dst_rank if dst_rank in holders else holders[dst_rank % len(holders)]


@functools.lru_cache(maxsize=256)
def pieces_for(receiver: KvLayout, sender: KvLayout) -> tuple[Piece, ...]:
    """The pieces ``receiver``'s rank gets from a prefiller laid out as ``sender`` (any of its ranks),
    in head order. Assumes the two are reconcilable."""
    runs: list[list[int]] = []  # [src, lo, hi]
    for head in range(receiver.head_start, receiver.head_end):
        src = source_rank(head, receiver.tp_rank, sender)
        if runs and runs[-1][0] == src:
            runs[-1][2] = head + 1
        else:
            runs.append([src, head, head + 1])
    return tuple(Piece(src, receiver.tp_rank, lo, hi, i, len(runs)) for i, (src, lo, hi) in enumerate(runs))


@functools.lru_cache(maxsize=256)
def routes_of(sender: KvLayout, receiver_tp: int) -> tuple[Piece, ...]:
    """What ``sender``'s rank sends to a decoder of TP ``receiver_tp`` (same heads): one piece per
    decoder rank it feeds, in decoder rank order; empty when another rank feeds them all."""
    receiver = KvLayout(sender.total_heads, receiver_tp, 0, sender.mla)
    return tuple(p for r in range(receiver_tp) for p in pieces_for(receiver.at_rank(r), sender)
                 if p.src_rank == sender.tp_rank)


def sub_request_id(req_id: str, piece: Piece) -> str:
    """The wire id of ``piece``'s share of a request: the request's own id for a decoder rank fed by
    one piece, else ``req_id~index/count``."""
    return share_id(req_id, piece.index, piece.count)


def share_id(req_id: str, index: int, count: int) -> str:
    return req_id if count == 1 else f"{req_id}{_SUB_SEP}{index}/{count}"


def parse_sub_request(wire_id: str) -> tuple[str, int, int]:
    """(request id, piece index, piece count) of a wire id; (wire_id, 0, 1) for a plain one.
    ValueError for a malformed sub-request id."""
    base, sep, rest = wire_id.rpartition(_SUB_SEP)
    if not sep:
        return wire_id, 0, 1
    index, slash, count = rest.partition("/")
    if not (base and slash and index.isdigit() and count.isdigit() and 0 <= int(index) < int(count)
            and int(count) > 1):
        raise ValueError(f"malformed sub-request id {wire_id!r} (expected REQ{_SUB_SEP}INDEX/COUNT)")
    return base, int(index), int(count)
