"""The client's output text, made in the proxy from token ids, as one vLLM instance would make it.

The decoder is prompted with the prompt's ids + the prefiller's first token, so its own text
starts mid-context (mid-character with a byte-level BPE). The proxy therefore ignores the
decoder's text and detokenizes the output token ids itself, with the request's prompt ids as
context. This module is a faithful copy of vLLM 0.32's ``vllm/v1/engine/detokenizer.py``
(``BaseIncrementalDetokenizer`` + ``FastIncrementalDetokenizer`` + ``check_stop_strings``):

* ``tokenizers.decoders.DecodeStream`` primed with the prompt's last ids (``prompt_context``: as few as
  give the text of vLLM's stream, which it primes with the whole prompt), stepped once per output token;
  ``skip_special_tokens`` (default true) and ``spaces_between_special_tokens`` (default true)
  as in vLLM's sampling params;
* a token that ended the output (EOS / ``stop_token_ids``: the engine's ``stop_terminated``) is
  not detokenized unless ``include_stop_str_in_output``;
* stop strings are checked here (not on the decoder: its text starts mid-context), after
  ``min_tokens``, the earliest completing one wins, the text is cut before it (or after it with
  ``include_stop_str_in_output``) and tokens after the completing one are dropped;
* streamed text holds back ``max(len(stop)) - 1`` characters until the output ends, as vLLM does.

The process that streams a decode (a relay worker, or the client side of one process) makes the same text
again: the request's owner detokenized the first token to answer the prefill (or, for a text completion
without stop strings, took the prefiller's text and replays the token too). It replays that token only
when its text is first needed (``replay``, ``OutputText.prime``): after the first token's bytes went out,
while the decoder loads the KV, not on the first byte's path.

Only fast (``tokenizers``-backed) tokenizers are supported, as vLLM's fast path; see
``http/tokenizer.py`` for what happens otherwise.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

_INVALID_PREFIX_ERR_MSG = "Invalid prefix encountered"  # tokenizers' DecodeStream error that vLLM works around
_CONTEXT_MAX_IDS = 23  # the longest prompt suffix tried without U+FFFD in its text (``prompt_context``)
_BOUNDARY_MAX_IDS = 64  # the longest suffix tried that starts on a character boundary
_BOUNDARY_CHECK_IDS = 8  # the ids before such a suffix whose text it must end (> a character's 4 bytes)


@dataclasses.dataclass(frozen=True)
class TextParams:
    """The sampling parameters that shape the output text (vLLM's defaults)."""

    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> TextParams:
        stop = body.get("stop")
        stops = (stop,) if isinstance(stop, str) else tuple(s for s in (stop or ()) if isinstance(s, str))
        return cls(
            stop=tuple(s for s in stops if s),
            include_stop_str_in_output=bool(body.get("include_stop_str_in_output", False)),
            min_tokens=int(body.get("min_tokens") or 0),
            skip_special_tokens=bool(body.get("skip_special_tokens", True)),
            spaces_between_special_tokens=bool(body.get("spaces_between_special_tokens", True)),
        )


@dataclasses.dataclass(frozen=True)
class Step:
    """What one batch of output tokens added."""

    kept: int  # how many of the new tokens belong to the output (fewer when a stop string ended it)
    stop_string: str | None  # the stop string that ended the output here, if any


class OutputText:
    """The output text of one request, grown token by token (vLLM's incremental detokenizer)."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], params: TextParams,
                 replay: Sequence[int] = ()) -> None:
        """``tokenizer``: a ``tokenizers.Tokenizer`` (the fast backend of a Hugging Face tokenizer).

        ``replay``: output tokens another process has already shown the client (the first token): they are
        detokenized at ``prime`` (at the latest, the first ``update``), and their text is not handed out again.
        """
        import tokenizers.decoders  # lazy: only a proxy with a tokenizer needs it

        self._decoders = tokenizers.decoders
        self._tokenizer = tokenizer
        self._params = params
        self._prompt_ids = prompt_ids
        self._replay = list(replay)
        self._stream: Any = None  # the decode stream, made by ``prime``
        self._spaces_between_special = params.skip_special_tokens or params.spaces_between_special_tokens
        self._added: dict[int, str] = {}
        if not self._spaces_between_special:
            self._added = {tid: tok.content for tid, tok in tokenizer.get_added_tokens_decoder().items()}
            self._spaces_between_special = not self._added
        self._last_special = False
        self._stop_buffer_length = (max(len(s) for s in params.stop) - 1
                                    if params.stop and not params.include_stop_str_in_output else 0)
        self.token_ids: list[int] = []
        self.text = ""
        self._sent = 0  # characters already handed out by ``next_delta``
        if not self._replay:
            self.prime()

    def prime(self) -> None:
        """Prime the decode stream with the prompt's context and replay what another process showed (once)."""
        if self._stream is not None:
            return
        self._stream = self._decoders.DecodeStream(ids=prompt_context(self._tokenizer, self._prompt_ids, self._params),
                                                   skip_special_tokens=self._params.skip_special_tokens)
        replay, self._replay = self._replay, []
        if replay:  # as its owner did for the first token: no stop string ended it (a decode follows)
            self.update(replay, stop_terminated=False)
            self.next_delta(finished=False)

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool) -> Step:
        """Detokenize ``new_token_ids``; ``stop_terminated``: the last one is an EOS / stop token id."""
        if not new_token_ids:
            return Step(0, None)
        self.prime()
        new = list(new_token_ids)
        skipped = new.pop() if stop_terminated and not self._params.include_stop_str_in_output else None
        num_prev = len(self.token_ids)
        offsets = [len(self.text)] if self._params.stop else None
        for token_id in new:
            self.token_ids.append(token_id)
            self.text += self._decode_next(token_id)
            if offsets is not None:
                offsets.append(len(self.text))
        if skipped is not None:
            self.token_ids.append(skipped)
            if offsets is not None:
                offsets.append(len(self.text))
        kept = len(new_token_ids)
        stop_string = None
        if offsets is not None and len(self.token_ids) > self._params.min_tokens:
            check_from = offsets[max(self._params.min_tokens - num_prev, 0)]
            found = check_stop_strings(self.text, len(self.text) - check_from, self._params.stop,
                                       self._params.include_stop_str_in_output)
            if found is not None:
                stop_string, truncate_to = found
                stop_end = len(self.text) if truncate_to == -1 else truncate_to
                if not self._params.include_stop_str_in_output:
                    stop_end += len(stop_string)
                kept = bisect_left(offsets, stop_end, lo=1)
                del self.token_ids[num_prev + kept:]
                if truncate_to != -1:
                    self.text = self.text[:truncate_to]
        return Step(kept, stop_string)

    def next_delta(self, finished: bool) -> str:
        """The text not handed out yet (holding back what may still become a stop string)."""
        self.prime()
        length = len(self.text) - (0 if finished else self._stop_buffer_length)
        if self._sent < length:
            start, self._sent = self._sent, length
            return self.text[start:length]
        return ""

    def _decode_next(self, token_id: int) -> str:
        token = self._step(token_id)
        if not self._spaces_between_special:
            special = self._added.get(token_id)
            if special is not None and self._last_special:
                token = special
            self._last_special = special is not None
        return token or ""

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._tokenizer, token_id)
        except (OverflowError, TypeError):
            logger.warning("invalid output token id %r: no text for it", token_id)
            return None
        except Exception as exc:
            if not str(exc).startswith(_INVALID_PREFIX_ERR_MSG):
                raise
            logger.warning("invalid prefix while detokenizing: resetting the decode stream (as vLLM does)")
            self._stream = self._decoders.DecodeStream(skip_special_tokens=self._params.skip_special_tokens)
            return self._stream.step(self._tokenizer, token_id)


def prompt_context(tokenizer: Any, prompt_ids: Sequence[int], params: TextParams) -> list[int]:
    """The prompt's last ids the decode stream needs, as few as give the text vLLM makes with the whole prompt.

    vLLM 0.32 primes its stream with the whole prompt; the stream's first step decodes all it was primed
    with, twice, so a whole long prompt would put O(prompt) work (~10 ms per 16k ids) before the first token.
    What an output token's text depends on is where the prompt's text ends, not where it starts, so a
    suffix that decodes to the end of the prompt's own text gives the same deltas:

    * the shortest suffix of 4 to 23 ids whose text has no U+FFFD (vLLM's rule before it primed natively);
    * else (U+FFFD in the prompt's text: literal, or bytes that are no character, as in prompts of random
      token ids) the shortest suffix of up to 64 ids whose text does not end in U+FFFD and is the end of
      the text of 8 more ids (so it starts on a character boundary);
    * else (the prompt's text ends in U+FFFD: it ends mid-character, or with a literal one) the whole
      prompt, as vLLM: its stream then has no prefix to subtract and the first text holds the context's.
    """
    ids = list(prompt_ids)
    skip = params.skip_special_tokens
    for n in range(4, min(len(ids), _CONTEXT_MAX_IDS) + 1):
        if "\ufffd" not in tokenizer.decode(ids[-n:], skip_special_tokens=skip):
            return ids[-n:]
    for n in range(4, min(len(ids) - _BOUNDARY_CHECK_IDS, _BOUNDARY_MAX_IDS) + 1):
        text = tokenizer.decode(ids[-n:], skip_special_tokens=skip)
        if text and not text.endswith("\ufffd") and tokenizer.decode(
                ids[-n - _BOUNDARY_CHECK_IDS:], skip_special_tokens=skip).endswith(text):
            return ids[-n:]
    return ids


def check_stop_strings(output_text: str, new_char_count: int, stop: Sequence[str],
                       include_in_output: bool) -> tuple[str, int] | None:
    """vLLM's: the earliest-completing stop string in the new text and where to cut (-1: nowhere)."""
    if not new_char_count or not stop:
        return None
    best: str | None = None
    best_index = 0
    best_end = sys.maxsize
    for stop_str in stop:
        index = output_text.find(stop_str, 1 - new_char_count - len(stop_str))
        if index == -1:
            continue
        end = index + len(stop_str)
        if end < best_end:
            best, best_index, best_end = stop_str, index, end
    if best is None:
        return None
    if include_in_output:
        return (best, -1) if best_end >= len(output_text) else (best, best_end)
    return best, best_index
