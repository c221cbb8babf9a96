"""A long prompt tokenized in pieces at once, with the ids of one encode of the whole text.

The proxy tokenizes a prompt before it routes it (exact counts for the decoder's buffer credit, the prefix
policy, the ids the prefiller gets in place of the text), so that time is on the request's TTFT: 5-6.5 ms at
16k tokens and 9-11 ms at 32k on the GPU host, in one thread. The ``tokenizers`` backend encodes a batch on
every core but one text on one; cut into pieces, the same prompt is tokenized several times faster.

Where a cut leaves the ids unchanged. The backend encodes in steps: added tokens are cut out of the raw text,
the rest is normalized, split into words by the pre-tokenizer's regex, each word is encoded by the model
(BPE: a word's ids do not depend on its neighbours), and the post-processor adds the special tokens around.
The cut goes at a position ``b`` where ``text[b - 1]`` is an ASCII letter and ``text[b]`` a space. In each
regex accepted below, a match holding a letter ends at a letter and never goes on over a space (a space
only starts a word: `` ?\\p{L}+``), so the whole text's words end at ``b``; and no regex looks behind, so
the words after ``b`` are those of ``text[b:]`` alone. Hence only these tokenizers are cut (any other is
encoded whole):

* no normalizer;
* the pre-tokenizer is ByteLevel with GPT-2's regex, or a Split on one of the regexes below (Llama 3,
  Qwen 2) then ByteLevel without a regex; neither adds a prefix space;
* the model is BPE without dropout;
* no added token holds whitespace or strips it beside itself, so no occurrence of one spans a cut;
* with special tokens, the post-processor only puts fixed ids before and after the text (learned from one
  text); and all of it is checked at load on a text cut at every such position (``PieceEncoder.of``).
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["PieceEncoder"]

MIN_PIECE_CHARS = 4096  # a shorter text is encoded whole: fanning it out costs about what it saves
_MAX_PIECES = 8
_CUT = re.compile(r"[A-Za-z] ")  # a cut goes between the two
_SPLIT_REGEXES = frozenset({
    # Llama 3 (tiktoken's cl100k_base)
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+",
    # Qwen 2, 2.5, 3
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+",
})
# where a tokenizer that could be cut is checked at load: cut at every cut position, it must give the whole's ids
_CHECK_TEXT = ("The cat's  toy isn't hers, it's THEIRS.  Yes it is\n\n  ok a b  c\td 12 345 6789 x.y "
               "ünïcödé 中文 ½ <b>x</b> end?!  'Tis we'll I'm you're  they've I'd \r\n  z ")


class PieceEncoder:
    """Encodes a long text as cut pieces in one batch of the backend, ids equal to one encode of it."""

    def __init__(self, backend: Any, before: list[int], after: list[int], max_pieces: int,
                 min_piece_chars: int = MIN_PIECE_CHARS) -> None:
        self._backend = backend
        self._before, self._after = before, after  # the special tokens around a text (add_special_tokens)
        self._max_pieces = max_pieces
        self._min_piece_chars = min_piece_chars

    @classmethod
    def of(cls, backend: Any, max_pieces: int | None = None,
           min_piece_chars: int = MIN_PIECE_CHARS) -> PieceEncoder | None:
        """An encoder for ``backend`` (a ``tokenizers.Tokenizer`` that ``hf.encode`` runs alone), or None when
        it cannot be cut (see the module's list) or one core is all there is."""
        max_pieces = _cores() if max_pieces is None else max_pieces
        if max_pieces < 2 or os.environ.get("TOKENIZERS_PARALLELISM", "").lower() in ("0", "false", "off", "no"):
            return None
        try:
            why = _why_not_cut(json.loads(backend.to_str()))
            around = None if why else _special_around(backend)
        except Exception as exc:  # a tokenizer this cannot read is encoded whole
            why, around = f"{type(exc).__name__}: {exc}", None
        if around is None:
            logger.debug("the tokenizer encodes long prompts whole: %s", why or "special tokens inside the text")
            return None
        encoder = cls(backend, *around, max_pieces=max_pieces, min_piece_chars=min_piece_chars)
        if not encoder._cuts_keep_ids(_CHECK_TEXT):
            logger.warning("the tokenizer gives other ids when a text is cut between a letter and a space: long "
                           "prompts are tokenized whole")
            return None
        return encoder

    def encode(self, text: str, add_special_tokens: bool) -> list[int] | None:
        """The ids of ``text``, encoded in pieces; None when it is too short to be worth cutting, or has no cut."""
        pieces = min(self._max_pieces, len(text) // self._min_piece_chars)
        if pieces < 2:
            return None
        cuts = _cuts(text, pieces)
        if len(cuts) < 3:
            return None
        return self._encode_cut(text, cuts, add_special_tokens)

    def _encode_cut(self, text: str, cuts: list[int], add_special_tokens: bool) -> list[int]:
        ids = list(self._before) if add_special_tokens else []
        parts = [text[a:b] for a, b in zip(cuts, cuts[1:])]
        for encoding in self._backend.encode_batch_fast(parts, add_special_tokens=False):
            ids.extend(encoding.ids)
        if add_special_tokens:
            ids.extend(self._after)
        return ids

    def _cuts_keep_ids(self, text: str) -> bool:
        every = [0, *(m.start() + 1 for m in _CUT.finditer(text)), len(text)]
        return all(self._encode_cut(text, every, special) == self._backend.encode(text, add_special_tokens=special).ids
                   for special in (True, False))


def _cuts(text: str, pieces: int) -> list[int]:
    """0, the cut positions nearest after each ``i / pieces`` of the text, len(text)."""
    cuts = [0]
    for i in range(1, pieces):
        found = _CUT.search(text, max(len(text) * i // pieces, cuts[-1]))
        if found is None:
            break
        cuts.append(found.start() + 1)
    cuts.append(len(text))
    return cuts


def _why_not_cut(spec: dict[str, Any]) -> str | None:
    """Why a tokenizer (its tokenizer.json) may not be cut; None when it may."""
    if spec.get("normalizer") is not None:
        return "it has a normalizer"
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout") is not None:
        return "its model is not BPE without dropout"
    if not _words_end_at_letters(spec.get("pre_tokenizer") or {}):
        return "its pre-tokenizer is not one known to end every word at a letter before a space"
    for added in spec.get("added_tokens") or ():
        content = str(added.get("content", ""))
        if any(c.isspace() for c in content) or added.get("lstrip") or added.get("rstrip"):
            return f"its added token {content!r} holds or strips whitespace"
    return None


def _words_end_at_letters(pre: dict[str, Any]) -> bool:
    if pre.get("type") == "ByteLevel":
        return pre.get("use_regex", True) and not pre.get("add_prefix_space")
    if pre.get("type") != "Sequence":
        return False
    steps = pre.get("pretokenizers") or []
    if len(steps) != 2:
        return False
    split, byte_level = steps
    return (split.get("type") == "Split" and (split.get("pattern") or {}).get("Regex") in _SPLIT_REGEXES
            and split.get("behavior") == "Isolated" and not split.get("invert")
            and byte_level.get("type") == "ByteLevel" and not byte_level.get("use_regex", True)
            and not byte_level.get("add_prefix_space"))


def _special_around(backend: Any) -> tuple[list[int], list[int]] | None:
    """The ids the post-processor puts before and after a text; None when it puts them inside."""
    bare = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            return full[:start], full[start + len(bare):]
    return None


def _cores() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return min(_MAX_PIECES, cores)
