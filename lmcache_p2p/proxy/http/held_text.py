"""Text an instance held back when its decode stream broke, for the proxy without a tokenizer.

vLLM sends a token whose text ends in an incomplete UTF-8 character without that character; its
bytes come with the token that completes it. A stream that breaks right after such a token and
continues on another instance prompted with it loses the character: the next instance takes the
token as prompt and never emits its text. Without a tokenizer the proxy cannot tell which tokens of
a delta (deltas merge tokens) are missing text, so a greedy request's continuation is prompted
without the last delta's tokens: the next instance generates them again (greedy: the same ones),
the client gets none of their ids twice, and of their text only what the broken stream had not sent.

This module owns that bookkeeping only (the last output as the client got it; what of the next
stream's output the client already has). It must not open streams or choose instances: the decode
session does. A next instance that generates other tokens (or other text) than the client already
has ends the output with :class:`ContinuationMismatch`: its tokens would take positions the client
holds, be sent twice and run past ``max_tokens``. With the proxy's tokenizer the proxy makes the text
itself and needs none of this; under sampling another instance would not generate the same tokens,
so the output continues after every token the client has (as before, its held-back character is
then lost).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lmcache_p2p.proxy.errors import ContinuationMismatch
from lmcache_p2p.proxy.http.responses import Delta
from lmcache_p2p.proxy.http.shaping import ClientRequest

# More tokens without text than this means an instance that sends no text at all (started without a
# tokenizer), not a held-back character: such a stream is not generated again.
_MAX_REPLAY_TOKENS = 16
_GREEDY_TEMPERATURE = 1e-5  # vLLM samples greedily below this temperature


def greedy(req: ClientRequest) -> bool:
    temperature = req.body.get("temperature")
    return isinstance(temperature, (int, float)) and temperature < _GREEDY_TEMPERATURE


class HeldText:
    """The last output delta with text, and the deltas without text after it, as the client got them."""

    def __init__(self, enabled: bool) -> None:
        self._enabled = enabled
        self._ids: list[int] = []
        self._text = ""

    @classmethod
    def for_request(cls, req: ClientRequest, proxy_text: bool) -> HeldText:
        return cls(enabled=not proxy_text and greedy(req))

    def observe(self, delta: Delta) -> None:
        """An output delta the client got (its text as the instance sent it)."""
        if not self._enabled:
            return
        if delta.text:
            self._ids, self._text = list(delta.token_ids), delta.text
        else:
            self._ids.extend(delta.token_ids)

    def replay(self) -> Replay:
        """What the next instance generates again (nothing when it need not, or cannot)."""
        if not self._ids or len(self._ids) > _MAX_REPLAY_TOKENS:
            return Replay((), "")
        return Replay(self._ids, self._text)


class Replay:
    """The start of a continued stream: tokens, and text of them, that the client already has."""

    def __init__(self, token_ids: Sequence[int], text: str | None) -> None:
        """``text``: what the client has of those tokens' text; None when the proxy makes the text from token ids
        (the instance's text of those tokens is then dropped unread)."""
        self.rewound = len(token_ids)  # the output's last tokens the next instance generates again
        self._ids = list(token_ids)
        self._text = text

    def filter(self, delta: Delta) -> Delta | None:
        """``delta`` without what the client has of it; None when nothing is left. Raises
        :class:`ContinuationMismatch` when the delta is not what the client has."""
        if not self._ids and not self._text:
            return delta
        ids, logprobs = delta.token_ids, delta.logprobs
        n = min(len(self._ids), len(ids))
        if ids[:n] != self._ids[:n]:
            raise _mismatch(f"generated token ids {ids[:n]} where the client already has {self._ids[:n]}")
        del self._ids[:n]
        ids, logprobs = ids[n:], _after(logprobs, n)
        if self._text is None:
            text = delta.text if ids else ""
        else:
            text = self._strip_text(delta.text)
        if not text and not ids and delta.finish_reason is None:
            return None
        return Delta(text, ids, logprobs, delta.finish_reason, delta.stop_reason)

    def _strip_text(self, text: str) -> str:
        if self._text.startswith(text):
            self._text = self._text[len(text):]
            return ""
        if text.startswith(self._text):
            text, self._text = text[len(self._text):], ""
            return text
        raise _mismatch(f"sent the text {text!r} where the client already has {self._text!r}")


def _mismatch(what: str) -> ContinuationMismatch:
    return ContinuationMismatch(
        f"the instance continuing this broken stream {what}: the output ends here rather than send those "
        "positions twice (with the model's tokenizer in the proxy, --tokenizer auto or a folder, nothing is "
        "generated again)")


def _after(logprobs: dict[str, Any] | None, n: int) -> dict[str, Any] | None:
    """Completion-format logprobs without the first ``n`` tokens'."""
    if not logprobs or not n:
        return logprobs
    return {k: v[n:] if isinstance(v, list) else v for k, v in logprobs.items()}
